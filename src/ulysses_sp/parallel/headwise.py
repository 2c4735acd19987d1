"""The attention layer's two all-to-alls, head by head: q/k/v seq->heads in, the output heads->seq out.

Exchanging whole tensors (pack every piece into one send buffer, receive into another, unpack into the
outputs) keeps the inputs, both buffers and the outputs alive together: three to four times the
exchanged bytes, the peak of a causal attention layer (in forward and, for the gradients, in
backward). Here each batch row and local head goes on its own: for seq->heads, rank ``r``'s head
``r H_l + j`` of ``x [B, H, S_l, D]`` is the ``[S_l, D]`` piece it sends to rank ``r``, and what
arrives from rank ``r`` is the contiguous slice ``[r S_l, (r+1) S_l)`` of head ``j`` of
``out [B, H_l, S, D]``, received in place; heads->seq is the same with the roles swapped. Alive: the
inputs and the outputs plus at most a staging piece each way (``comm.exchange_pieces``). The same
bytes cross the group as one packed exchange; ``B (H_l + 2 Hkv_l)`` collectives in instead of one
(latency, not bytes). Pure data movement: exact.

Layouts: gradients come out laid out in memory like the forward's inputs (``dim_order``): the core's
output is a transposed view of what it saved (``[B, H_l, S, D]`` memory), so its gradient arrives in the
layout its backward reads without a copy; v's gradient in v's projection layout.

Where it sits in the step (DESIGN.md): twice per attention layer (step 4), called by
``attention/ulysses.py``.

Shape legend: ``B`` batch, ``S`` global sequence, ``S_l = S/P``, ``H`` heads (query, or kv after
replication), ``H_l = H/P``, ``D`` head dim, ``P`` the Ulysses group size.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ulysses_sp.parallel.comm import exchange_pieces
from ulysses_sp.parallel.comm_timing import CommTimes, active_comm_times
from ulysses_sp.parallel.comm_timing import timed as _timed


def dim_order(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s dims from the outermost in memory to the innermost (``(0, 1, 2, 3)``: contiguous)."""
    return tuple(sorted(range(t.dim()), key=lambda d: -t.stride(d)))


def empty_in_order(like: torch.Tensor, shape: list[int], order: tuple[int, ...] | None) -> torch.Tensor:
    """A new ``shape`` tensor of ``like``'s dtype and device whose memory runs in ``order`` (``None``:
    contiguous)."""
    if order is None:
        return like.new_empty(shape)
    # [shape in memory order] -> the logical dims (a permuted view)
    return like.new_empty([shape[d] for d in order]).permute(sorted(range(len(order)), key=order.__getitem__))


def head_pieces(
    x: torch.Tensor, out: torch.Tensor, p: int, dims: tuple[int, int], to_heads: bool
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The ``(src, dest)`` view pairs, each ``[P, S_l, D]``, of one exchange between 4-D tensors with
    the heads at ``dims[0]`` and the sequence at ``dims[1]`` (batch first, ``D`` last): one pair per
    batch row and local head ``j``. ``to_heads``: ``x`` holds the heads, ``out`` the sequence."""
    heads, seqs = (x, out) if to_heads else (out, x)
    # -> [B, H, S_l, D] and [B, H_l, S, D] (views)
    heads, seqs = (t.movedim(dims, (1, 2)) for t in (heads, seqs))
    h_l, s_l = seqs.shape[1], heads.shape[2]
    for i in range(heads.shape[0]):
        for j in range(h_l):
            by_head = heads[i].unflatten(0, (p, h_l))[:, j]  # [P, S_l, D]: head r H_l + j of every rank r
            by_seq = seqs[i, j].unflatten(0, (p, s_l))  # [P, S_l, D]: rank r's tokens of head j
            yield (by_head, by_seq) if to_heads else (by_seq, by_head)


def _exchange(xs: Sequence[torch.Tensor], orders: Sequence[tuple[int, ...] | None], group: dist.ProcessGroup,
              dims: tuple[int, int], to_heads: bool, times: CommTimes | None) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Each ``x`` into a new tensor laid out in its ``order``: seq->heads divides the heads by ``P`` and
    multiplies the sequence, heads->seq the reverse."""
    p, outs = dist.get_world_size(group), []
    with _timed("sp", times):
        for x, order in zip(xs, orders):
            shape = list(x.shape)
            h, s = shape[dims[0]], shape[dims[1]]
            shape[dims[0]], shape[dims[1]] = (h // p, s * p) if to_heads else (h * p, s // p)
            outs.append(empty_in_order(x, shape, order))
            exchange_pieces(head_pieces(x, outs[-1], p, dims, to_heads), group)
    return tuple(outs)


class _HeadwiseAllToAll(torch.autograd.Function):
    """Several 4-D tensors seq->heads (``to_heads``) or heads->seq forward, head by head; the inverse
    exchange of the gradients backward, each laid out like its input (a missing gradient gives none)."""

    @staticmethod
    def forward(ctx: Any, group: dist.ProcessGroup, dims: tuple[int, int], to_heads: bool, *xs: torch.Tensor):
        ctx.group, ctx.dims, ctx.to_heads = group, dims, to_heads
        ctx.times = active_comm_times()  # backward may run on an autograd device thread
        ctx.orders = [dim_order(x) for x in xs]
        return _exchange(xs, [None] * len(xs), group, dims, to_heads, ctx.times)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None):
        got = [(g, order) for g, order in zip(grads, ctx.orders) if g is not None]
        outs = iter(_exchange([g for g, _ in got], [o for _, o in got], ctx.group, ctx.dims, not ctx.to_heads,
                              ctx.times))  # fmt: skip
        return None, None, None, *(None if g is None else next(outs) for g in grads)


def qkv_seq_to_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[B, H, S_l, D] -> [B, H_l, S, D]`` for q and ``[B, Hkv|P, S_l, D] -> [B, Hkv_l, S, D]`` for k
    and v, head by head (module docstring). Differentiable: the backward sends the gradients home the
    same way."""
    if dist.get_world_size(group) == 1:
        return q.view_as(q), k.view_as(k), v.view_as(v)
    # [B, H*, S_l, D] -> [B, H*/P, P*S_l, D] for each
    return _HeadwiseAllToAll.apply(group, (1, 2), True, q, k, v)


def out_heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The attention output home, head by head: ``[B, S, H_l, D] -> [B, S_l, H, D]`` (contiguous; ``x``
    in any layout). Differentiable: the inverse backward, the gradient laid out like ``x``."""
    if dist.get_world_size(group) == 1:
        return x.view_as(x)
    # [B, S, H_l, D] -> [B, S_l, P*H_l, D]
    return _HeadwiseAllToAll.apply(group, (2, 1), False, x)[0]
