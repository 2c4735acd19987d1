"""Sequence-tiled compute (ALST): token-local work done over the sequence a tile at a time.

Ulysses SP divides activations by ``P``; some per-token work is still far larger than the model's
hidden state: the MLP's intermediate ``[B, S_l, I]`` (``I`` is 3-4x ``h``) and the logits
``[B, S_l, V]`` (``V`` is 30-1000x ``h``). Both are token-local, so they can be computed over
``n`` tiles of the sequence, keeping for backward only the tile *inputs* and recomputing each tile
in backward. The big tensor then exists for one tile, ``1/n`` of it, at any time.

This module is the mechanism, independent of any model library:

* ``sequence_tiled_compute(fn, x, n, ...)``: the generic mechanism (one autograd Function).
* ``TiledMLP.apply(fn, module, x, shards)``: DeepSpeed's entry point for a tiled MLP block.
* ``tiled_causal_lm_loss``: ``lm_head`` + cross-entropy per tile, with the same contract as
  ``ulysses_sp.loss.sp_causal_lm_loss``.
* ``auto_num_shards`` / ``check_num_shards``: the default tile count and its validation.

The HuggingFace integration (``apply_tiled_mlp``/``TiledMLPHandle``, which patch a model's MLP
blocks after checking they are token-local, and ``TiledCausalLMLoss``, the engine's ``loss_fn``)
lives in ``ulysses_sp.tiling_hf`` and is re-exported here on first access.

Contract: ``fn`` must treat every position independently, and every tensor requiring grad that it
uses besides ``x`` must be passed in ``params`` (a missing one raises ``ValueError`` in backward).
The result and the gradients equal those of the untiled call.

Where it sits in the step (DESIGN.md): steps 3 (MLPs) and 5 (loss) of the forward, mirrored in
backward. Tiles are local to the rank (no communication per tile), so ranks may use different
tile counts; the tiled loss's only collective is ``sp_mean_loss``'s all-reduce, as untiled.

Composition. Parameters are *inputs* of the autograd Function: their gradients are summed over the
tiles inside the Function and handed to autograd once, so a parameter's gradient hook fires once
per backward as with an untiled module (DDP, FSDP2's reduce-scatter, ZeRO-1). Under FSDP2 the
tiled module runs inside its FSDP unit's forward, whose parameters are gathered once for all tiles
(and once more for backward, as without tiling). Under activation checkpointing the Function is
simply part of the recomputed layer.

Shape legend: ``B`` batch, ``S_l`` local sequence, ``h`` hidden, ``I`` MLP intermediate, ``V``
vocabulary, ``n`` number of tiles, ``T = ceil(S_l / n)`` tile length.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.function import once_differentiable
from torch.distributed.fsdp import FSDPModule

from .loss import IGNORE_INDEX, causal_lm_loss_parts, sp_mean_loss


def auto_num_shards(seq_len: int, hidden_size: int, batch_size: int = 1) -> int:
    """Default tile count: tiles of about ``hidden_size`` tokens, ``ceil(B * S_l / h)``.

    ALST's TiledMLP rule: a tile's ``[T, I]`` MLP activations (``[T, V]`` logits) are then no
    larger than the block's own ``[h, I]`` (``[V, h]``) weight, which is in memory anyway.
    Clamped to ``[1, S_l]``.
    """
    return max(1, min(seq_len, math.ceil(batch_size * seq_len / max(hidden_size, 1))))


def check_num_shards(num_shards: Any, seq_len: int | None = None, *, what: str = "num_shards") -> int:
    """Validate a tile count (and, given ``seq_len``, that every tile holds at least one token)."""
    if isinstance(num_shards, bool) or not isinstance(num_shards, int):
        raise ValueError(f"{what} must be a positive int, got {num_shards!r}")
    if num_shards < 1:
        raise ValueError(f"{what} must be >= 1, got {num_shards}")
    if seq_len is not None and num_shards > seq_len:
        raise ValueError(
            f"{what} ({num_shards}) is larger than the local sequence length ({seq_len}): "
            f"every tile needs at least one token; use at most {seq_len} (or None for auto)"
        )
    return num_shards


def _tiles(length: int, n: int) -> list[tuple[int, int]]:
    """``(start, size)`` of ``n`` tiles covering ``length`` (sizes differ by at most one)."""
    base, extra = divmod(length, n)
    out, start = [], 0
    for i in range(n):
        size = base + (i < extra)
        out.append((start, size))
        start += size
    return out


@contextlib.contextmanager
def _rng_restored(state: tuple[torch.Tensor, torch.Tensor | None] | None, device: torch.device) -> Iterator:
    """Replay the RNG from ``state`` (dropout masks of the forward) without disturbing the caller's."""
    if state is None:
        yield
        return
    accel = device.type != "cpu"
    with torch.random.fork_rng(devices=[device] if accel else [], device_type=device.type):
        torch.set_rng_state(state[0])
        if accel:
            torch.get_device_module(device.type).set_rng_state(state[1], device)
        yield


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    dev = torch.get_device_module(device.type).get_rng_state(device) if device.type != "cpu" else None
    return torch.get_rng_state(), dev


def _unlisted_leaves(y: torch.Tensor, listed: set[int]) -> list[torch.Tensor]:
    """Leaf tensors requiring grad that ``y``'s graph reaches but that are not in ``listed``."""
    found, seen, stack = [], set(), [y.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if var is not None and id(var) not in listed:
            found.append(var)
        stack.extend(f for f, _ in node.next_functions)
    return found


def _check_not_freed(params: Sequence[torch.Tensor]) -> None:
    freed = [tuple(p.shape) for p in params if p.numel() and p.untyped_storage().nbytes() == 0]
    if freed:
        raise ValueError(
            f"parameters {freed} of a tiled function were freed between forward and backward (FSDP2 "
            "resharded them): run the tiled module inside an FSDP unit whose parameters are gathered "
            "again for backward (its own unit's pre-backward hook, or the root with the default "
            "reshard_after_forward), not in a unit that never sees the gradient"
        )


@dataclass(frozen=True)
class _Spec:
    seq_dim: int
    num_shards: int
    n_aux: int
    reduce_sum: bool
    preserve_rng: bool


class _TiledCompute(torch.autograd.Function):
    """Forward: ``fn`` on each tile under ``no_grad``, outputs concatenated (or summed); saves only
    ``x`` (and the aux tensors). Backward: each tile recomputed with grad and back-propagated; the
    tile gradients of ``x`` are concatenated and the parameter gradients summed."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, spec: _Spec, x: torch.Tensor, *rest: torch.Tensor):
        ctx.fn, ctx.spec, ctx.params = fn, spec, rest[spec.n_aux :]
        ctx.rng = _rng_state(x.device) if spec.preserve_rng else None
        aux = rest[: spec.n_aux]
        d, out = spec.seq_dim, None
        with torch.no_grad():
            for start, size in _tiles(x.shape[d], spec.num_shards):
                y = fn(x.narrow(d, start, size), *(a.narrow(d, start, size) for a in aux))
                if spec.reduce_sum:
                    out = y if out is None else out.add_(y)
                    continue
                if out is None:  # [B, T, ...] -> preallocate [B, S_l, ...]: no list of tiles, no cat
                    out = y.new_empty(y.shape[:d] + x.shape[d : d + 1] + y.shape[d + 1 :])
                out.narrow(d, start, size).copy_(y)
                del y  # the tile's activations die here, before the next tile
        ctx.save_for_backward(x, *aux)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor):
        x, *aux = ctx.saved_tensors
        spec, params = ctx.spec, ctx.params
        _check_not_freed(params)
        want_x = ctx.needs_input_grad[2]
        want = [i for i, p in enumerate(params) if ctx.needs_input_grad[3 + spec.n_aux + i]]
        grad_x = torch.zeros_like(x) if want_x else None
        grad_p: list[torch.Tensor | None] = [None] * len(params)
        d, checked = spec.seq_dim, False
        with _rng_restored(ctx.rng, x.device), torch.enable_grad():
            for start, size in _tiles(x.shape[d], spec.num_shards):
                xt = x.narrow(d, start, size).detach().requires_grad_(want_x)
                yt = ctx.fn(xt, *(a.narrow(d, start, size) for a in aux))
                if yt.grad_fn is None:  # the tile does not depend on anything (e.g. no valid label)
                    continue
                inputs = ([xt] if want_x else []) + [params[i] for i in want]
                if not checked and (extra := _unlisted_leaves(yt, {id(t) for t in inputs})):
                    shapes = [tuple(t.shape) for t in extra]
                    raise ValueError(
                        f"the tiled function uses {len(extra)} tensor(s) that require grad but were "
                        f"not passed in params (shapes {shapes}); their gradients would be lost"
                    )
                checked = True
                g = grad_out if spec.reduce_sum else grad_out.narrow(d, start, size)
                grads = torch.autograd.grad(yt, inputs, g, allow_unused=True)
                if want_x:
                    grad_x.narrow(d, start, size).copy_(grads[0])
                    grads = grads[1:]
                for i, gi in zip(want, grads):
                    if gi is not None:
                        grad_p[i] = gi if grad_p[i] is None else grad_p[i].add_(gi)
                del yt, grads
        for i in want:  # e.g. every tile skipped: a zero gradient, as the untiled graph would give
            if grad_p[i] is None:
                grad_p[i] = torch.zeros_like(params[i])
        return (None, None, grad_x, *([None] * spec.n_aux), *grad_p)


def sequence_tiled_compute(
    fn: Callable[..., torch.Tensor],
    x: torch.Tensor,
    num_shards: int,
    *,
    params: Iterable[torch.Tensor] = (),
    aux: Sequence[torch.Tensor] = (),
    seq_dim: int = 1,
    reduction: str | None = None,
    preserve_rng_state: bool = True,
) -> torch.Tensor:
    """Run a token-local ``fn`` over ``num_shards`` tiles of ``x``'s sequence dim, recomputing in backward.

    Args:
        fn: ``fn(x_tile, *aux_tiles) -> y_tile``; must treat every position independently.
        x: ``[B, S_l, ...]`` the differentiable input (tiled along ``seq_dim``).
        num_shards: number of tiles, ``1 <= num_shards <= x.shape[seq_dim]``.
        params: every tensor requiring grad that ``fn`` uses besides ``x`` (a module's
            ``parameters()``); their gradients are summed over tiles and returned to autograd once.
            A tensor missing here is detected in backward (``ValueError``).
        aux: non-differentiable tensors tiled along the same dim (e.g. labels ``[B, S_l]``).
        seq_dim: the sequence dim of ``x`` and of ``aux``.
        reduction: ``None`` concatenates the tile outputs along ``seq_dim``; ``"sum"`` adds them
            (for a scalar per tile, e.g. a loss sum).
        preserve_rng_state: replay the forward's RNG in the backward recompute (dropout).

    Returns:
        What ``fn(x, *aux)`` would return (the ``reduction`` of the tile outputs). Only ``x``,
        ``aux`` and the output are kept; one tile's intermediates exist at a time.
    """
    seq_dim %= x.dim()
    check_num_shards(num_shards, x.shape[seq_dim])
    if reduction not in (None, "sum"):
        raise ValueError(f"reduction must be None or 'sum', got {reduction!r}")
    for a in aux:
        if a.dim() <= seq_dim or a.shape[seq_dim] != x.shape[seq_dim]:
            raise ValueError(f"aux {tuple(a.shape)} does not match x {tuple(x.shape)} in dim {seq_dim}")
    spec = _Spec(seq_dim, num_shards, len(aux), reduction == "sum", preserve_rng_state)
    return _TiledCompute.apply(fn, spec, x, *aux, *params)


class TiledMLP:
    """DeepSpeed-compatible entry point: ``TiledMLP.apply(fn, self, x, shards, compute_params)``.

    Runs ``fn(module, x_tile)`` over ``shards`` tiles of ``x [B, S_l, h]`` (dim 1, or dim 0 for a
    2-D ``[T, h]``) with ``sequence_tiled_compute``; ``compute_params=None`` means all of
    ``module.parameters()``. Most users want ``apply_tiled_mlp(model)`` instead.
    """

    @staticmethod
    def apply(
        fn: Callable[[nn.Module, torch.Tensor], torch.Tensor],
        module: nn.Module,
        x: torch.Tensor,
        shards: int,
        compute_params: Iterable[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        params = list(module.parameters() if compute_params is None else compute_params)
        preserve = any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in module.modules())
        return sequence_tiled_compute(
            lambda t: fn(module, t),
            x,
            shards,
            params=params,
            seq_dim=x.dim() - 2,
            preserve_rng_state=preserve,
        )


def tiled_causal_lm_loss(
    hidden_states: torch.Tensor,
    lm_head: nn.Module,
    shift_labels: torch.Tensor,
    sp_group: dist.ProcessGroup | None,
    *,
    num_shards: int | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """``sp_causal_lm_loss(lm_head(hidden_states), shift_labels, sp_group)`` without the logits.

    The logits ``[B, S_l, V]`` and their gradient only ever exist for one ``[B, T, V]`` tile:
    forward computes each tile's fp32 cross-entropy sum and drops the tile; backward recomputes
    each tile's logits and back-propagates into ``hidden_states`` and ``lm_head``'s parameters.
    Tiles whose labels are all ``ignore_index`` are skipped (no work, zero gradient).

    Args:
        hidden_states: ``[B, S_l, h]`` the final (normed) hidden states of this rank's shard.
        lm_head: the output projection (``model.get_output_embeddings()``), token-local; under
            FSDP2 it must belong to its parent's unit (the usual recipe), not be sharded alone.
        shift_labels: ``[B, S_l]`` labels already shifted over the full sequence.
        sp_group: the sequence-parallel group, ``None`` without SP.
        num_shards: tiles per shard; ``None`` = ``auto_num_shards(S_l, h, B)``.

    Returns:
        The global mean over valid tokens of the SP group (value identical on every SP rank,
        gradient this rank's share), exactly as ``ulysses_sp.loss.sp_causal_lm_loss``.
    """
    if hidden_states.dim() != 3 or hidden_states.shape[:2] != shift_labels.shape:
        raise ValueError(
            f"hidden_states {tuple(hidden_states.shape)} and shift_labels {tuple(shift_labels.shape)} "
            "disagree: expected hidden_states [B, S_l, h] and labels [B, S_l]"
        )
    if isinstance(lm_head, FSDPModule):
        raise ValueError(
            "tiled loss needs lm_head's parameters gathered by its parent FSDP unit: fully_shard the "
            "decoder layers and the whole model, not lm_head on its own"
        )
    b, s_l, h = hidden_states.shape
    n = auto_num_shards(s_l, h, b) if num_shards is None else num_shards
    check_num_shards(n, s_l, what="tiled loss num_shards")
    labels = shift_labels.to(hidden_states.device)
    head = lm_head.forward  # the module's own forward: hooks (FSDP, ours) ran for the whole call

    def tile_loss(h_tile: torch.Tensor, label_tile: torch.Tensor) -> torch.Tensor:
        if not bool((label_tile != ignore_index).any()):  # zero-token tile: nothing to compute
            return torch.zeros((), dtype=torch.float32, device=h_tile.device)
        # [B, T, h] -> [B, T, V] (one tile of logits) -> fp32 sum of token losses
        return causal_lm_loss_parts(head(h_tile), label_tile, ignore_index=ignore_index)[0]

    total = sequence_tiled_compute(
        tile_loss,
        hidden_states,
        n,
        params=list(lm_head.parameters()),
        aux=(labels,),
        reduction="sum",
        preserve_rng_state=False,
    )
    count = (labels != ignore_index).sum().to(torch.float32)
    return sp_mean_loss(total, count, sp_group)


# The HF integration imports this module, so it is re-exported lazily (PEP 562) rather than
# imported here: ``from ulysses_sp.tiling import apply_tiled_mlp`` keeps working, with no cycle.
_HF_EXPORTS = ("TiledCausalLMLoss", "TiledMLPHandle", "apply_tiled_mlp")


def __getattr__(name: str) -> Any:
    if name in _HF_EXPORTS:
        return getattr(importlib.import_module(".tiling_hf", __package__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_HF_EXPORTS])
