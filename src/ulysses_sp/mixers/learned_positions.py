"""Learned position embeddings that fall back to a cumulative sum of the mask (OPT, BioGPT and kin).

The module: an ``nn.Embedding`` subclass whose ``forward(attention_mask, cache_length, position_ids=None)``
looks up ``position_ids`` (plus an offset), and only when none are given computes them itself as
``cumsum(attention_mask) - 1``. Given position ids it acts on every token alone (a table lookup), so
under sequence parallelism each rank looks up its own tokens' global positions: exact, nothing sent.
Without them the cumulative sum runs over the rank's shard alone and every shard would restart at
position 0: a silently wrong model. ``train``, ``eval`` and the integrations always pass them (the
shard's global positions, restarting at each packed document as the model expects of packed rows); a
model call without them is refused on every rank by the SP attention's check (``attention/positions.py``),
and the handler refuses a call of the embedding itself without them at sp > 1 (a decoder that would
pass ``None`` through).

Matched by structure (an ``nn.Embedding`` subclass whose forward takes ``position_ids`` and whose code
calls ``cumsum``), never by model name. Any sp size and any layout (the ring's zigzag order
included): a lookup needs no neighbour.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from ulysses_sp.mixers._kernels import replace_forward
from ulysses_sp.mixers.classify import code_names


class LearnedPositionsHandler:
    """Lets a learned position embedding run on each shard's global position ids (module docstring)."""

    name = "learned_positions"
    plain_layout_only = False
    """A lookup works in any token order (``apply_mixers`` refuses the ring only for handlers that exchange)."""

    def __init__(self, positions: Any = None) -> None:
        del positions  # the ids arrive as the module's own argument

    def matches(self, module: nn.Module) -> bool:
        if not isinstance(module, nn.Embedding) or type(module) is nn.Embedding:
            return False
        params = inspect.signature(type(module).forward).parameters
        return "position_ids" in params and "cumsum" in code_names(type(module), depth=0)

    def check(self, module: nn.Module, sp_size: int) -> None:
        del module, sp_size  # every sp size: each token's row of the table, nothing else

    def wrap(self, module: nn.Module, mesh: Any) -> Callable[[], None]:
        what, sp_size = type(module).__name__, mesh.sp_size
        signature = inspect.signature(type(module).forward)

        def forward(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            if sp_size > 1 and signature.bind(module, *args, **kwargs).arguments.get("position_ids") is None:
                raise ValueError(
                    f"{what}: without position_ids it numbers tokens by a cumulative sum of the attention "
                    f"mask over the rank's own shard, so every one of the {sp_size} shards would start at "
                    "position 0; pass position_ids (the shard's global positions) to the model"
                )
            return original(*args, **kwargs)

        return replace_forward(module, forward)


HANDLER = LearnedPositionsHandler()
"""An unbound instance for ``claimed_by`` (the closed-world guard); ``apply_mixers`` binds its own."""
