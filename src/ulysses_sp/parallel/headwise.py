"""The attention layer's two all-to-alls: q/k/v seq->heads in, the output heads->seq out — packed or head by head.

**Head by head** (the capacity path): exchanging whole tensors (pack every piece into one send buffer,
receive into another, unpack into the outputs) keeps the inputs, both buffers and the outputs alive
together: three to four times the exchanged bytes, the peak of a causal attention layer (in forward and,
for the gradients, in backward). Here each batch row and local head goes on its own: for seq->heads, rank
``r``'s head ``r H_l + j`` of ``x [B, H, S_l, D]`` is the ``[S_l, D]`` piece it sends to rank ``r``, and
what arrives from rank ``r`` is the contiguous slice ``[r S_l, (r+1) S_l)`` of head ``j`` of
``out [B, H_l, S, D]``, received in place; heads->seq is the same with the roles swapped. Alive: the
inputs and the outputs plus at most a staging piece each way (``comm.exchange_pieces``). GQA with
``Hkv < P``: k and v are not replicated to ``P`` heads first; each piece is (``[Hkv, S_l, D] ->
[P, S_l, D]``, one piece-sized copy) and the replicas' gradients are summed piece by piece on the way home.

**Packed** (``packed=True``, the latency path): one collective for q, k and v and one for the output
(``comm.seq_to_heads_packed``, ``comm.heads_to_seq``): ``B (H_l + 2 Hkv_l) - 1`` fewer collectives in and
``B H_l - 1`` fewer out, for a transient send/receive buffer of the exchanged size (kv replicated first).
Which one a layer runs: ``parallel/exchange_cost.py`` (packed below a per-piece byte threshold). Both
send the same bytes; pure data movement: exact.

Layouts: head by head, gradients come out laid out in memory like the forward's inputs (``dim_order``):
the core's output is a transposed view of what it saved (``[B, H_l, S, D]`` memory), so its gradient
arrives in the layout its backward reads without a copy; v's gradient in v's projection layout.

Where it sits in the step (DESIGN.md): twice per attention layer (step 4), called by
``attention/ulysses.py``.

Shape legend: ``B`` batch, ``S`` global sequence, ``S_l = S/P``, ``H`` heads (query, or kv),
``H_l = H/P`` (kv: ``max(Hkv, P)/P``), ``D`` head dim, ``P`` the Ulysses group size.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ulysses_sp.parallel.comm import exchange_pieces, heads_to_seq, seq_to_heads_packed
from ulysses_sp.parallel.comm_timing import CommTimes, active_comm_times
from ulysses_sp.parallel.comm_timing import timed as _timed
from ulysses_sp.parallel.exchange_cost import link_for_backend, use_packed


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
    batch row and local head ``j``. ``to_heads``: ``x`` holds the heads, ``out`` the sequence. A heads
    side with ``Hkv < P`` heads (un-replicated kv, one local head) gives ``[Hkv, S_l, D]`` views: kv
    head ``h`` serves ranks ``[h P/Hkv, (h+1) P/Hkv)`` (``comm.exchange_pieces`` replicates and sums)."""
    heads, seqs = (x, out) if to_heads else (out, x)
    # -> [B, H, S_l, D] and [B, H_l, S, D] (views)
    heads, seqs = (t.movedim(dims, (1, 2)) for t in (heads, seqs))
    h_l, s_l = seqs.shape[1], heads.shape[2]
    for i in range(heads.shape[0]):
        for j in range(h_l):
            # [P, S_l, D]: head r H_l + j of every rank r (or the Hkv < P kv heads, h_l = 1)
            by_head = heads[i].unflatten(0, (p, h_l))[:, j] if heads.shape[1] >= p else heads[i]
            by_seq = seqs[i, j].unflatten(0, (p, s_l))  # [P, S_l, D]: rank r's tokens of head j
            yield (by_head, by_seq) if to_heads else (by_seq, by_head)


def _exchange(xs: Sequence[torch.Tensor], shapes: Sequence[list[int]], orders: Sequence[tuple[int, ...] | None],
              group: dist.ProcessGroup, dims: tuple[int, int], to_heads: bool,
              times: CommTimes | None) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Each ``x`` into a new tensor of its ``shape`` laid out in its ``order``."""
    p, outs = dist.get_world_size(group), []
    with _timed("sp", times):
        for x, shape, order in zip(xs, shapes, orders):
            outs.append(empty_in_order(x, list(shape), order))
            exchange_pieces(head_pieces(x, outs[-1], p, dims, to_heads), group)
    return tuple(outs)


class _HeadwiseAllToAll(torch.autograd.Function):
    """Several 4-D tensors seq->heads (``to_heads``) or heads->seq forward, head by head; the inverse
    exchange of the gradients backward, each shaped and laid out like its input (a missing gradient
    gives none). seq->heads divides the heads by ``P`` (``Hkv < P`` kv heads: to one) and multiplies
    the sequence; heads->seq the reverse."""

    @staticmethod
    def forward(ctx: Any, group: dist.ProcessGroup, dims: tuple[int, int], to_heads: bool, *xs: torch.Tensor):
        ctx.group, ctx.dims, ctx.to_heads = group, dims, to_heads
        ctx.times = active_comm_times()  # backward may run on an autograd device thread
        ctx.orders, ctx.shapes, p, shapes = [dim_order(x) for x in xs], [x.shape for x in xs], dist.get_world_size(group), []
        for x in xs:
            shape = list(x.shape)
            h, s = shape[dims[0]], shape[dims[1]]
            shape[dims[0]], shape[dims[1]] = (max(h, p) // p, s * p) if to_heads else (h * p, s // p)
            shapes.append(shape)
        return _exchange(xs, shapes, [None] * len(xs), group, dims, to_heads, ctx.times)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None):
        got = [(g, shape, order) for g, shape, order in zip(grads, ctx.shapes, ctx.orders) if g is not None]
        outs = iter(_exchange([g for g, _, _ in got], [s for _, s, _ in got], [o for _, _, o in got], ctx.group,
                              ctx.dims, not ctx.to_heads, ctx.times))  # fmt: skip
        return None, None, None, *(None if g is None else next(outs) for g in grads)


def qkv_seq_to_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, *, packed: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[B, H, S_l, D] -> [B, H_l, S, D]`` for q and ``[B, Hkv, S_l, D] -> [B, Hkv_l, S, D]`` for k and v
    (``Hkv < P``: rank ``j`` receives kv head ``j Hkv / P``, ``Hkv_l = 1``), head by head or ``packed``
    (module docstring). Differentiable: the backward sends the gradients home the same way."""
    p = dist.get_world_size(group)
    if p == 1:
        return q.view_as(q), k.view_as(k), v.view_as(v)
    if packed:
        if k.shape[1] < p:  # [B, Hkv, S_l, D] -> [B, P, S_l, D]: rank j will receive the kv head its queries use
            k, v = (t.repeat_interleave(p // t.shape[1], dim=1) for t in (k, v))
        # [B, H*, S_l, D] -> [B, H*/P, P*S_l, D] for each, in one collective
        return seq_to_heads_packed((q, k, v), group, seq_dim=2, head_dim=1)
    # [B, H*, S_l, D] -> [B, max(H*, P)/P, P*S_l, D] for each
    return _HeadwiseAllToAll.apply(group, (1, 2), True, q, k, v)


def out_heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup, *, packed: bool = False) -> torch.Tensor:
    """The attention output home, head by head or ``packed``: ``[B, S, H_l, D] -> [B, S_l, H, D]``
    (contiguous; ``x`` in any layout). Differentiable: the inverse backward (head by head: the gradient
    laid out like ``x``)."""
    if dist.get_world_size(group) == 1:
        return x.view_as(x)
    if packed:  # one collective
        return heads_to_seq(x, group, head_dim=2, seq_dim=1)
    # [B, S, H_l, D] -> [B, S_l, P*H_l, D]
    return _HeadwiseAllToAll.apply(group, (2, 1), False, x)[0]


def packed_exchange(exchange: str, group: dist.ProcessGroup, q: torch.Tensor, *kv: torch.Tensor) -> bool:
    """Whether the attention layer's q ``[B, H, S_l, D]`` (and k, v) cross ``group`` packed:
    ``exchange_cost.use_packed`` for ``[P, S_l, D]`` pieces of the widest dtype on the group backend's link."""
    p, s_l, d = dist.get_world_size(group), q.shape[2], q.shape[3]
    piece = p * s_l * d * max(t.element_size() for t in (q, *kv))
    return use_packed(exchange, piece, link_for_backend(dist.get_backend(group)))
