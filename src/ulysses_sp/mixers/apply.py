"""The entry point that makes a model's sequence mixers sequence-parallel: ``apply_mixers``.

It installs the ``PositionTracker`` (the batch's position ids, for global document boundaries) on
the model's root, binds this package's handlers to it, and runs ``base.shard_mixers``; the handle
it returns undoes both. ``HANDLERS`` are unbound instances for the closed-world guard's
``claimed_by`` (matching only); ``is_sharded(module)`` says whether a claimed module was actually
wrapped (a guard should require both). The engine calls ``apply_mixers`` for models that have mixers.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ulysses_sp.mixers import gated_delta, kda, mamba2, short_conv
from ulysses_sp.mixers._kernels import is_sharded
from ulysses_sp.mixers.base import MixerHandle, MixerHandler, claimed_by, shard_mixers

__all__ = ["HANDLERS", "apply_mixers", "has_unsharded_mixers", "is_sharded"]
from ulysses_sp.mixers.documents import PositionTracker

HANDLERS: tuple[MixerHandler, ...] = (short_conv.HANDLER, mamba2.HANDLER, gated_delta.HANDLER, kda.HANDLER)
"""The mixers this package shards (for ``claimed_by``; ``apply_mixers`` binds fresh ones)."""


def has_mixers(model: nn.Module, handlers: tuple[MixerHandler, ...] = HANDLERS) -> bool:
    """True when some module of ``model`` is a sequence mixer these handlers claim."""
    return any(claimed_by(m, handlers) is not None for m in model.modules())


def has_unsharded_mixers(model: nn.Module) -> bool:
    """True when ``model`` has mixers these handlers claim and none is sharded yet (a user who
    called ``apply_mixers`` before ``initialize`` keeps their handle)."""
    claimed = [m for m in model.modules() if claimed_by(m, HANDLERS) is not None]
    return bool(claimed) and not any(is_sharded(m) for m in claimed)


def apply_mixers(model: nn.Module, mesh: Any) -> MixerHandle:
    """Shard every short-convolution, Mamba-2, gated delta-net and KDA mixer of ``model`` over
    ``mesh``'s SP group.

    Checks every mixer before changing any (``ValueError`` listing each that cannot be sharded at
    ``mesh.sp_size``). Call before FSDP/DDP wrapping or after: only the mixers' ``forward`` changes.
    Returns the handle whose ``remove()`` restores the model.
    """
    positions = PositionTracker(mesh)
    handlers = (
        short_conv.ShortConvHandler(positions),
        mamba2.Mamba2Handler(positions),
        gated_delta.GatedDeltaNetHandler(positions),
        kda.KimiDeltaAttentionHandler(positions),
    )
    handle = shard_mixers(model, mesh, handlers)
    handle._undo.insert(0, positions.install(model))  # removed last
    return handle
