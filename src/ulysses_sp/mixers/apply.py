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

from ulysses_sp.mixers import (
    causal_window,
    counted_positions,
    depth_attention,
    gated_delta,
    kda,
    learned_positions,
    lightning,
    mamba1,
    mamba2,
    mask_window,
    mlstm,
    own_scores,
    pair_bias,
    prefix_attention,
    rg_lru,
    rwkv,
    segment_bias,
    short_conv,
    xlnet,
)
from ulysses_sp.mixers._kernels import is_sharded
from ulysses_sp.mixers.base import MixerHandle, MixerHandler, claimed_by, shard_mixers

__all__ = ["HANDLERS", "apply_mixers", "has_unsharded_mixers", "is_sharded", "usable_sp_sizes"]
from ulysses_sp.mixers.documents import PositionTracker

HANDLERS: tuple[MixerHandler, ...] = (
    short_conv.HANDLER, mamba2.HANDLER, mamba1.HANDLER, mamba1.HEADS_HANDLER, gated_delta.HANDLER, kda.HANDLER,
    kda.FULL_GATE_HANDLER, learned_positions.HANDLER, prefix_attention.HANDLER, own_scores.HANDLER, pair_bias.HANDLER, segment_bias.HANDLER,
    depth_attention.HANDLER, xlnet.HANDLER,
    causal_window.HANDLER, mask_window.HANDLER,
    counted_positions.HANDLER, counted_positions.LOOKUP_HANDLER, rg_lru.HANDLER, rwkv.HANDLER, lightning.HANDLER, mlstm.HANDLER,
)
"""The mixers this package shards (for ``claimed_by``; ``apply_mixers`` binds fresh ones)."""


def has_mixers(model: nn.Module, handlers: tuple[MixerHandler, ...] = HANDLERS) -> bool:
    """True when some module of ``model`` is a sequence mixer these handlers claim."""
    return any(claimed_by(m, handlers) is not None for m in model.modules())


def needs_plain_layout(model: nn.Module) -> bool:
    """True when a mixer of ``model`` exchanges heads for tokens (every handler but a lookup's, such as
    learned positions): those need the plain Ulysses token order, not the ring's zigzag."""
    return any(getattr(h, "plain_layout_only", True) for m in model.modules() if (h := claimed_by(m, HANDLERS)))


def has_unsharded_mixers(model: nn.Module) -> bool:
    """True when ``model`` has mixers these handlers claim and none is sharded yet (a user who
    called ``apply_mixers`` before ``initialize`` keeps their handle)."""
    claimed = [m for m in model.modules() if claimed_by(m, HANDLERS) is not None]
    return bool(claimed) and not any(is_sharded(m) for m in claimed)


def apply_mixers(model: nn.Module, mesh: Any) -> MixerHandle:
    """Shard every short-convolution, Mamba-2, Mamba-1, gated delta-net, KDA (both gates), RG-LRU, RWKV,
    lightning-attention and mLSTM (xLSTM) mixer of ``model`` over ``mesh``'s SP group, give every causal-window module (convolutions inside projections)
    its halo, hold learned and self-numbering position tables to the shard's global position ids, run
    attention that computes its own scores or its own pair bias head-parallel (XLNet's relative attention over its
    model's encodings for the full sequence; CPM-Ant's over its
    prompt-prefixed row), and tell the SP attention a sliding window the
    model applies only through its mask.

    Checks every mixer before changing any (``ValueError`` listing each that cannot be sharded at
    ``mesh.sp_size``). Call before FSDP/DDP wrapping or after: only the mixers' ``forward`` changes.
    Returns the handle whose ``remove()`` restores the model.
    """
    if getattr(mesh, "ring_size", 1) > 1 and needs_plain_layout(model):
        raise ValueError(
            f"sequence mixers need the plain Ulysses layout (ring_size 1), but at sp_size {mesh.sp_size} this "
            f"model's attention heads only split with ring_size {mesh.ring_size}; use an sp size whose ranks "
            f"split its attention heads and its mixers' heads: {usable_sp_sizes(model)}"
        )
    positions = PositionTracker(mesh)
    xlnet_handler = xlnet.XlnetHandler(positions)
    xlnet_handler.bind(model)  # each relative attention's model: it builds r and the mask for S
    handlers = (
        short_conv.ShortConvHandler(positions),
        mamba2.Mamba2Handler(positions),
        mamba1.Mamba1Handler(positions),
        mamba1.MultiHeadMamba1Handler(positions),
        gated_delta.GatedDeltaNetHandler(positions),
        kda.KimiDeltaAttentionHandler(positions),
        kda.FullGateKdaHandler(positions),
        learned_positions.LearnedPositionsHandler(positions),
        prefix_attention.PrefixAttentionHandler(positions),
        own_scores.OwnScoresHandler(positions),
        pair_bias.PairBiasHandler(positions),
        segment_bias.SegmentBiasHandler(positions),
        depth_attention.DepthAttentionHandler(positions),
        xlnet_handler,
        causal_window.CausalWindowHandler(positions),
        mask_window.MaskWindowHandler(positions),
        counted_positions.CountedPositionsHandler(positions),
        counted_positions.CountedLookupHandler(positions),
        rg_lru.RgLruHandler(positions),
        rwkv.RwkvHandler(positions),
        lightning.LightningAttentionHandler(positions),
        mlstm.MlstmHandler(positions),
    )
    handle = shard_mixers(model, mesh, handlers)
    handle._undo.insert(0, positions.install(model))  # removed last
    return handle


def usable_sp_sizes(model: nn.Module, up_to: int = 64) -> str:
    """The sp sizes (2..``up_to``) at which plain Ulysses splits ``model``'s attention heads and every
    claimed mixer's heads, as a message fragment (``"2, 3 or 6"``; ``"none above 1"`` when none do)."""
    from ulysses_sp.parallel.mesh_shape import head_counts, valid_ring_sizes

    pairs = head_counts(getattr(model, "config", None)) if hasattr(model, "config") else []
    mixers = [(m, h) for m in model.modules() if (h := claimed_by(m, HANDLERS)) is not None]

    def fits(p: int) -> bool:
        if not all(valid_ring_sizes(p, h, kv)[:1] == [1] for h, kv in pairs):
            return False
        try:
            for module, handler in mixers:
                handler.check(module, p)
        except ValueError:
            return False
        return True

    sizes = [str(p) for p in range(2, up_to + 1) if fits(p)]
    if not sizes:
        return "none above 1 (train it with sp 1)"
    return ", ".join(sizes[:-1]) + " or " + sizes[-1] if len(sizes) > 1 else sizes[0]
