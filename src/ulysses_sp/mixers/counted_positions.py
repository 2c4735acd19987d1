"""Position tables that number the tokens they are given themselves (Musicgen, Musicgen-Melody).

The module: a sinusoidal table (a ``weights`` buffer ``[N, D]``, grown by ``make_weights``) whose
``forward(input_ids [B, K, S_l], cache_length)`` takes no position ids and returns the rows
``arange(S_l) + cache_length`` (``[S_l, D]``, added to every row of the batch). On a sequence shard
every rank would number its tokens from 0: a silently wrong model. Under this handler the table
returns the rows of the forward's ``position_ids`` instead (captured at the model's root by the
``PositionTracker``: the shard's global positions, ``[B|1, S_l] -> [B|1, S_l, D]``), so rank ``r``
of a plain row reads rows ``r*S_l .. (r+1)*S_l - 1``: exactly the model without SP, nothing sent.

Packed documents (position ids restarting at 0): the model itself numbers the whole row
``0..S-1`` (it cannot see documents); here each document is numbered from 0, as if it were alone —
the numbering the SP attention's per-document masks already assume. This departs from the model's
own packed behaviour on purpose (as Llama 4's query temperature does, per document), at sp 1 as at
sp > 1 (``apply_mixers`` applies it at sp 1 too), so a packed row trains the same at every sp size.

No position ids at sp > 1 (a model call without them is refused by the SP attention's check; the
table refuses a direct call too), or a cache (generation): the model's own forward at sp 1, refused
at sp > 1. Matched by structure (a non-``nn.Embedding`` module with a 2-D ``weights`` buffer and
``make_weights``, whose ``forward`` builds positions with ``arange`` and takes none), never by
model name. Any layout (the ring's zigzag order included): a lookup needs no neighbour.

Learned tables that number their tokens only when given no ids (TrOCR's decoder; BART's kin): an
``nn.Embedding`` subclass whose ``forward(input_ids [B, S_l], cache_length, position_ids=None)`` builds
``arange(S_l) + cache_length`` when its caller passes no ``position_ids`` (TrOCR's decoder never does).
``CountedLookupHandler`` passes given ids through, and otherwise the forward's position ids row by row
(``[S_l]`` each: the table's own ``position_ids`` path and offset, ``[B|1, S_l, D]`` out); the same
refusals and per-document numbering as above.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ulysses_sp.mixers._kernels import refuse_cache, replace_forward, require_positions
from ulysses_sp.mixers.classify import _numbers_tokens_itself, code_names


class CountedPositionsHandler:
    """Makes a self-numbering position table read the shard's global position ids (module docstring)."""

    name = "counted_positions"
    plain_layout_only = False
    """A lookup works in any token order (``apply_mixers`` refuses the ring only for handlers that exchange)."""

    def __init__(self, positions: Any = None) -> None:
        self.positions = positions
        """Where the forward's position ids come from (``apply_mixers`` binds a ``PositionTracker``)."""

    def matches(self, module: nn.Module) -> bool:
        weights = getattr(module, "weights", None)
        return (
            not isinstance(module, nn.Embedding)
            and isinstance(weights, torch.Tensor)
            and weights.dim() == 2
            and callable(getattr(module, "make_weights", None))
            and isinstance(getattr(module, "embedding_dim", None), int)
            and _numbers_tokens_itself(type(module))
        )

    def check(self, module: nn.Module, sp_size: int) -> None:
        del module, sp_size  # every sp size: each token's row of the table, nothing else

    def wrap(self, module: nn.Module, mesh: Any) -> Callable[[], None]:
        tracker = require_positions(self.positions, type(self).__name__)
        what, sp_size = type(module).__name__, mesh.sp_size
        names = list(inspect.signature(type(module).forward).parameters)
        seq_dim = 1 if "embeds" in names[1] else -1  # Musicgen: ids [B, K, S_l]; Musicgen-Melody: embeds [B, S_l, D]

        def forward(original: Callable[..., Any], input_ids: torch.Tensor, cache_length: int = 0) -> torch.Tensor:
            refuse_cache(cache_length or None, sp_size, what)
            pos = tracker.current()  # [B|1, S_l]: the shard's global positions, restarting at each document
            if pos is None or cache_length:
                if sp_size > 1:
                    raise ValueError(
                        f"{what}: it numbers the tokens it is given 0..S_l-1 itself, so every one of the {sp_size} "
                        "shards would start at position 0; pass position_ids (the shard's global positions) to "
                        "the model"
                    )
                return original(input_ids, cache_length)  # sp 1 without position ids, or generation
            s_local = input_ids.shape[seq_dim]
            if pos.dim() != 2 or pos.shape[-1] != s_local:
                raise ValueError(
                    f"{what}: position_ids {tuple(pos.shape)} do not number the {s_local} positions it is given "
                    "(conditioning states prepended to the sequence are not sequence-parallel); pass [B, S_l] ids"
                )
            rows = s_local * sp_size  # every position id is below the global length: no read of the ids
            if rows > module.weights.size(0):
                module.make_weights(rows, module.embedding_dim)  # as the model grows its own table
            return module.weights[pos].detach()  # [B|1, S_l] -> [B|1, S_l, D]

        return replace_forward(module, forward)


class CountedLookupHandler(CountedPositionsHandler):
    """Makes a learned table that numbers its tokens when given no ids read the shard's global position ids."""

    name = "counted_lookup"

    def matches(self, module: nn.Module) -> bool:
        return (
            isinstance(module, nn.Embedding)
            and type(module) is not nn.Embedding
            and "position_ids" in inspect.signature(type(module).forward).parameters
            and "arange" in code_names(type(module), depth=0)
            and "cumsum" not in code_names(type(module), depth=0)  # a mask's cumsum: learned_positions
        )

    def wrap(self, module: nn.Module, mesh: Any) -> Callable[[], None]:
        tracker = require_positions(self.positions, type(self).__name__)
        what, sp_size = type(module).__name__, mesh.sp_size
        signature = inspect.signature(type(module).forward)

        def forward(original: Callable[..., Any], *args: Any, **kwargs: Any) -> torch.Tensor:
            bound = signature.bind(module, *args, **kwargs)
            bound.apply_defaults()
            call = dict(bound.arguments)
            if call.get("position_ids") is not None:  # the caller's ids: a lookup of each token's own
                return original(*args, **kwargs)
            call.pop(next(iter(signature.parameters)))  # self
            ids = next(iter(call.values()))  # [B, S_l] token ids (or a [B, S_l] slice of the embeddings)
            cache = next((v for k, v in call.items() if k.endswith("length") and isinstance(v, int)), 0)
            refuse_cache(cache or None, sp_size, what)
            pos = tracker.current()  # [B|1, S_l]: the shard's global positions, restarting at each document
            if pos is None or cache:
                if sp_size > 1:
                    raise ValueError(
                        f"{what}: given no position ids it numbers the tokens it is given 0..S_l-1 itself, so every "
                        f"one of the {sp_size} shards would start at position 0; pass position_ids (the shard's "
                        "global positions) to the model"
                    )
                return original(*args, **kwargs)  # sp 1 without position ids, or generation
            s_local = ids.shape[1]
            if pos.dim() != 2 or pos.shape[-1] != s_local:
                raise ValueError(f"{what}: position_ids {tuple(pos.shape)} do not number the {s_local} positions "
                                 "it is given; pass [B, S_l] ids")  # fmt: skip
            # [S_l] ids per row -> [1, S_l, D] each -> [B|1, S_l, D]
            rows = [original(**{**call, "position_ids": row}).reshape(1, s_local, -1) for row in pos]
            return torch.cat(rows)

        return replace_forward(module, forward)


HANDLER = CountedPositionsHandler()
"""An unbound instance for ``claimed_by`` (the closed-world guard); ``apply_mixers`` binds its own."""
LOOKUP_HANDLER = CountedLookupHandler()
"""The learned-table variant, unbound (``claimed_by``)."""
