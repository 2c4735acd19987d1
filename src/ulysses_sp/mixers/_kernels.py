"""What every mixer handler shares: the model's own kernel functions, the wrapped-forward plumbing,
and the checks every handler makes of the mesh and the call.

Kernels are looked up at call time in the mixer's modeling module (``causal_conv1d_fn``,
``mamba2_chunk_scan``, ``apply_mask_to_padding_states``): the very functions the model's forward
calls, with their hub-kernel / package / torch fallback dispatch intact, never a copy.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def model_function(module: nn.Module, name: str) -> Callable[..., Any] | None:
    """``name`` from the modeling module that defines ``type(module)``, or ``None``."""
    fn = getattr(sys.modules.get(type(module).__module__), name, None)
    return fn if callable(fn) else None


def check_layout(mesh: Any, what: str) -> None:
    """Refuse layouts the head-sharded exchange does not cover (the ring's zigzag token order)."""
    if getattr(mesh, "ring_size", 1) > 1:
        raise ValueError(
            f"{what}: sequence mixers need the plain Ulysses layout (ring_size 1), got ring_size "
            f"{mesh.ring_size}; use ring_size=1 (the mixer heads must divide sp_size)"
        )


def replace_forward(module: nn.Module, forward: Callable[..., Any]) -> Callable[[], None]:
    """Point ``module.forward`` at ``forward(original, *args, **kwargs)``; returns the undo."""
    if "forward" in vars(module):
        raise ValueError(f"{type(module).__name__} already has a wrapped forward (sharded twice?)")
    original = module.forward
    wrapped = functools.wraps(original)(functools.partial(forward, original))
    wrapped.ulysses_sp_mixer = True  # what is_sharded() looks for
    module.forward = wrapped

    def undo() -> None:
        vars(module).pop("forward", None)

    return undo


def refuse_cache(cache: Any, sp_size: int, what: str) -> None:
    """Cached decoding runs on one rank's tokens: not sequence-parallel. The one cache rule of every
    mixer handler: at sp 1 the model's own cached path runs; at sp > 1 a cache is refused (a mixer
    that ignored it would leave it unfilled, and generation from it would be silently wrong)."""
    if cache is not None and sp_size > 1:
        raise ValueError(
            f"{what}: a cache (use_cache=True: generation) is not supported under sequence "
            "parallelism; pass use_cache=False (training forwards in model.train() have none)"
        )


LOCAL_BOUNDARY_KWARGS = ("seq_idx", "cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k")
"""Keyword arguments that would carry per-shard document boundaries into a kernel."""


def is_sharded(module: nn.Module) -> bool:
    """True while ``module``'s forward is a mixer handler's sharded forward."""
    return getattr(vars(module).get("forward"), "ulysses_sp_mixer", False) is True


def refuse_local_boundaries(kwargs: dict[str, Any], what: str) -> None:
    """Document boundaries come from the gathered ``position_ids``; a shard's own ``seq_idx`` or
    ``cu_seqlens`` would describe the local tokens only."""
    given = [k for k in LOCAL_BOUNDARY_KWARGS if kwargs.get(k) is not None]
    if given:
        raise ValueError(
            f"{what}: {', '.join(given)} describe the local shard's documents; under sequence "
            "parallelism pass position_ids that restart at 0 at each document instead"
        )


def local_span(n: int, sp_size: int, sp_rank: int) -> tuple[int, int]:
    """``(start, length)`` of this rank's share of ``n`` heads/channels (``n % sp_size == 0``)."""
    per = n // sp_size
    return sp_rank * per, per


def index_of(spans: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """The concatenated ranges ``[(start, length), ...]`` as one index tensor."""
    return torch.cat([torch.arange(s, s + n, device=device) for s, n in spans])


def require_positions(positions: Any, handler: str) -> Any:
    """The handler's ``PositionTracker``, or ``ValueError`` for an unbound handler."""
    if positions is None:
        raise ValueError(f"{handler} needs a PositionTracker: use mixers.apply.apply_mixers(model, mesh)")
    return positions


def wrap_sharded_forward(
    module: nn.Module, mesh: Any, what: str, sharded: Callable[..., Any]
) -> Callable[[], None]:
    """Point ``module.forward(hidden_states, cache=None, attention_mask=None, **kwargs)`` at
    ``sharded(original, hidden_states, attention_mask, **kwargs)``; returns the undo. With a cache: the model's own
    cached path at sp 1 (generation), refused at sp > 1 (``refuse_cache``); per-shard document
    boundaries refused (``refuse_local_boundaries``). ``what`` names the module in errors."""

    def forward(original: Callable[..., Any], hidden_states: torch.Tensor, cache: Any = None,
                attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:  # fmt: skip
        if cache is not None and mesh.sp_size == 1:  # generation: the model's own cached path
            return original(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        refuse_cache(cache if cache is not None else kwargs.get("cache_params"), mesh.sp_size, what)
        refuse_local_boundaries(kwargs, what)
        return sharded(original, hidden_states, attention_mask, **kwargs)

    return replace_forward(module, forward)


class ForwardHandler:
    """What every handler shares (``mixers.base.MixerHandler``): the ``PositionTracker`` it is bound
    to, and the wrap of a handler that replaces the mixer's whole forward with
    ``sharded(module, mesh, positions, hidden [B, S_l, D], mask) -> [B, S_l, D]`` (short convolution,
    Mamba-2; the linear-attention handlers override ``wrap``)."""

    name = ""

    def __init__(self, positions: Any = None) -> None:
        self.positions = positions
        """Where the forward's position ids come from (``apply_mixers`` binds a ``PositionTracker``)."""

    def check(self, module: nn.Module, sp_size: int) -> None:
        raise NotImplementedError

    def sharded(self, module: nn.Module, mesh: Any, positions: Any, hidden: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        raise NotImplementedError

    def wrap(self, module: nn.Module, mesh: Any) -> Callable[[], None]:
        positions = require_positions(self.positions, type(self).__name__)
        check_layout(mesh, type(module).__name__)
        self.check(module, mesh.sp_size)
        return wrap_sharded_forward(module, mesh, type(module).__name__,
                                    lambda _, hidden, mask, **__: self.sharded(module, mesh, positions, hidden, mask))  # fmt: skip
