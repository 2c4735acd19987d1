"""Every collective of the library: the attention all-to-all, ring attention's K/V hops, the data
adapter's shard exchange, the gradient reduction's arithmetic, gathers, metric reductions, and
error agreement.

Every function takes its process group explicitly (from the ``SPMesh``'s named views). Where each
sits in the step (DESIGN.md): the shard exchange once per round of the data adapter (step 2); the
all-to-all twice per attention layer, q/k/v in and the output out (step 4; ``headwise``: head by head);
under ring attention, point-to-point hops around the ring axis inside each layer (step 4, overlapped
with compute, counted by ``ring.RingStats``, not timed by ``record_comm_times``); the gather of
position ids once per forward; the loss reduction once per micro-step (step 5); the gradient
reduction at the accumulation boundary (step 7); metric reductions once per optimizer step.

Shape legend: ``B`` batch, ``S`` global sequence, ``S_l = S/P`` local sequence, ``H`` heads,
``H_l = H/P``, ``D`` head dim, ``P`` sp size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from ulysses_sp.parallel.comm_timing import CommTimes, active_comm_times
from ulysses_sp.parallel.comm_timing import timed as _timed
from ulysses_sp.parallel.packing import layout_of, pack, rank_parts, release, segment_sizes, unpack


def _all_to_all(
    x: torch.Tensor,
    scatter_dim: int,
    gather_dim: int,
    group: dist.ProcessGroup,
    times: CommTimes | None = None,
) -> torch.Tensor:
    """Split ``x`` into ``P`` chunks along ``scatter_dim``, send chunk ``j`` to rank ``j``, and
    concatenate what arrives along ``gather_dim`` in rank order."""
    p = dist.get_world_size(group)
    if p == 1:
        return x
    gather_dim %= x.dim()
    # [..., n, ...] -> [P, ..., n/P, ...]: chunk j (for rank j) first, contiguous for the collective.
    send = rank_parts((x,), scatter_dim, p)[0].contiguous()
    recv = torch.empty_like(send)
    with _timed("sp", times):
        dist.all_to_all_single(recv, send, group=group)
    release(send)  # freed before the unpacking copy: the send buffer, recv and the output never coexist
    # [P(src), ..., g, ...] -> [..., P*g, ...]: the source rank's block goes before its elements.
    out = recv.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)
    release(recv)  # (a view keeps it)
    return out


class _AllToAll(torch.autograd.Function):
    """All-to-all scattering ``scatter_dim`` and gathering ``gather_dim`` forward; the inverse
    all-to-all (gather_dim scattered, scatter_dim gathered) backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup):
        ctx.dims = (scatter_dim, gather_dim)
        ctx.group = group
        # backward may run on an autograd device thread that does not see the context variable
        ctx.times = active_comm_times()
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group, ctx.times), None, None, None


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[B, H, S_l, D] -> [B, H_l, S, D]``: every rank gets the full sequence for its heads.

    Differentiable; the backward is ``heads_to_seq`` of the gradient.
    """
    # [B, H, S_l, D] -> [B, H/P, P*S_l, D]
    return _AllToAll.apply(x, 1, 2, group)


def heads_to_seq(
    x: torch.Tensor, group: dist.ProcessGroup, *, head_dim: int = 1, seq_dim: int = 2
) -> torch.Tensor:
    """``[B, H_l, S, D] -> [B, H, S_l, D]`` (or any layout, naming the two dims): the inverse of
    ``seq_to_heads``. Differentiable."""
    # [.., H_l, .., S, ..] -> [.., H, .., S_l, ..]
    return _AllToAll.apply(x, seq_dim, head_dim, group)


def _all_to_all_packed(
    xs: tuple[torch.Tensor, ...],
    scatter_dim: int,
    gather_dim: int,
    group: dist.ProcessGroup,
    times: CommTimes | None = None,
) -> tuple[torch.Tensor, ...]:
    """``_all_to_all`` of several tensors in **one** collective: each tensor's chunk for rank ``j`` is
    packed into row ``j`` of one byte buffer (one copy in, one copy out per tensor; ``packing``). Dtypes
    may differ (under autocast, rotary leaves q/k in fp32 while v is bf16): each keeps its own bytes."""
    if (p := dist.get_world_size(group)) == 1:
        return xs
    # [P, ..., n/P, ...] per tensor
    return start_exchange(rank_parts(xs, scatter_dim, p), [gather_dim] * len(xs), group, times, async_op=False)()


def start_exchange(
    parts: list[torch.Tensor],
    gather_dims: list[int | None],
    group: dist.ProcessGroup,
    times: CommTimes | None = None,
    *,
    async_op: bool = True,
) -> Callable[[], tuple[torch.Tensor, ...]]:
    """Post one all-to-all of several tensors' per-rank pieces and return the function that waits for
    it and unpacks what arrived. ``parts[i]``: ``[P, ...]``, row ``j`` for rank ``j`` (any view);
    arriving, row ``j`` came from rank ``j``: glued along ``gather_dims[i]`` of the piece (a copy), or
    for ``None`` returned as ``[P(src), ...]`` (a view of the receive buffer).

    With ``async_op`` the collective runs while the caller computes (head-chunked attention posts the
    next head group's exchange before attending the current one); the wait is what ``times`` counts.
    Not differentiable: the caller's autograd function owns the backward.
    """
    sizes, layouts = segment_sizes(parts), layout_of(parts)
    send = pack(parts, sizes)  # [P, bytes per rank]; the inputs are not kept alive by the exchange
    del parts
    if dist.get_world_size(group) == 1:
        return lambda: unpack(send, layouts, sizes, gather_dims)
    recv = torch.empty_like(send)
    with _timed("sp", times) if not async_op else contextlib.nullcontext():
        work = dist.all_to_all_single(recv, send, group=group, async_op=async_op)

    def finish() -> tuple[torch.Tensor, ...]:
        nonlocal send, work, recv
        if work is not None:
            with _timed("sp", times):
                work.wait()
        release(send)  # peak: inputs + recv + outputs, not + send
        outs = unpack(recv, layouts, sizes, gather_dims)
        release(recv)  # (kept by the outputs that are views of it)
        send = work = recv = None
        return outs

    return finish


class _AllToAllPacked(torch.autograd.Function):
    """Several tensors through one all-to-all (scatter ``scatter_dim``, gather ``gather_dim``)
    forward; one inverse all-to-all of their gradients backward (a missing gradient is zeros)."""

    @staticmethod
    def forward(ctx: Any, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup, *xs: torch.Tensor):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        ctx.meta = [(x.shape, x.dtype, x.device) for x in xs]
        ctx.times = active_comm_times()  # as _AllToAll: backward may run on another thread
        outs = _all_to_all_packed(xs, scatter_dim, gather_dim, group, ctx.times)
        return tuple(o if o is not x else o.view_as(o) for o, x in zip(outs, xs))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None):
        scatter_dim, gather_dim = ctx.dims
        p = dist.get_world_size(ctx.group)
        full = []
        for g, (shape, dtype, device) in zip(grads, ctx.meta):
            if g is None:  # the output's shape: scatter dim / P, gather dim * P
                out_shape = list(shape)
                out_shape[scatter_dim] //= p
                out_shape[gather_dim] *= p
                g = torch.zeros(out_shape, dtype=dtype, device=device)
            full.append(g)
        return None, None, None, *_all_to_all_packed(tuple(full), gather_dim, scatter_dim, ctx.group, ctx.times)


def exchange_pieces(pieces: Iterable[tuple[torch.Tensor, torch.Tensor]], group: dist.ProcessGroup) -> None:
    """One all-to-all per ``(src, dest)`` pair of ``[P, ...]`` views (``headwise``, not differentiable): ``src``
    row ``r`` to rank ``r``, rank ``r``'s row into ``dest`` row ``r``; staged where not contiguous. ``n < P``
    rows (un-replicated GQA kv): ``src`` row ``i`` goes to ranks ``[i P/n, (i+1) P/n)``, ``dest`` sums theirs."""
    p = dist.get_world_size(group)
    for src, dest in pieces:  # send: the piece itself, or a copy ([n, ...] -> [P, ...]: rows replicated)
        send = src.contiguous() if src.shape[0] == p else src.repeat_interleave(p // src.shape[0], 0)
        recv = dest if dest.is_contiguous() and dest.shape[0] == p else torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        if recv is not dest:  # [P, ...] -> [n, P/n, ...] -> [n, ...]: the replicas summed (n = P: a copy)
            dest.copy_(recv.unflatten(0, (dest.shape[0], -1)).sum(1) if dest.shape[0] < p else recv)
        release(*(t for t, own in ((send, src), (recv, dest)) if t is not own))  # our copies only


def seq_to_heads_packed(
    xs: tuple[torch.Tensor, ...], group: dist.ProcessGroup, *, seq_dim: int = 1, head_dim: int = 2
) -> tuple[torch.Tensor, ...]:
    """``[B, S_l, H*, ...] -> [B, S, H*/P, ...]`` for several tensors in **one** all-to-all (the
    sequence-mixer exchange: a Mamba-2 scan's x, dt, B, C; a short convolution's channels).

    Forward: scatter ``head_dim`` (every tensor's own head-like dim, divisible by ``P``), gather
    ``seq_dim``; backward: one inverse all-to-all of the gradients (``heads_to_seq`` of each).
    """
    # [B, S_l, H*, ...] -> [B, P*S_l, H*/P, ...] for each, packed per destination rank
    return _AllToAllPacked.apply(head_dim, seq_dim, group, *xs)


def ring_exchange(
    send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup, *, tag: int = 0
) -> list[dist.Work]:
    """Start one ring hop: ``send`` goes to the next rank of ``group`` (group rank + 1 mod R),
    ``recv`` is filled from the previous one (group rank - 1 mod R). Asynchronous.

    The send and the receive go in one ``batch_isend_irecv`` (one NCCL group: every rank sends and
    receives at once, no ordering deadlock; with R = 2 next and previous are the same peer). Peers
    are addressed by global rank, so ``group`` may be any sub-group of the world (a ring axis).
    Hops posted in the same order on every rank match in that order; ``tag`` (gloo) keeps two
    kinds of hop in flight at once apart.

    Returns:
        The works to wait on (each once: a gloo p2p work waited twice blocks) before reading
        ``recv`` or writing ``send``; empty when R = 1.
    """
    ring_size = dist.get_world_size(group)
    if send.shape != recv.shape or send.dtype != recv.dtype:
        raise ValueError(f"ring exchange needs matching buffers: send {tuple(send.shape)} {send.dtype}, "
                         f"recv {tuple(recv.shape)} {recv.dtype}")  # fmt: skip
    if not (send.is_contiguous() and recv.is_contiguous()):
        raise ValueError("ring exchange needs contiguous send and recv buffers")
    if ring_size == 1:
        return []
    ring_rank = dist.get_rank(group)
    nxt = dist.get_global_rank(group, (ring_rank + 1) % ring_size)
    prev = dist.get_global_rank(group, (ring_rank - 1) % ring_size)
    # [...] to the next ring rank, the same shape from the previous one
    ops = [dist.P2POp(dist.isend, send, nxt, group, tag), dist.P2POp(dist.irecv, recv, prev, group, tag)]
    return dist.batch_isend_irecv(ops)


def all_gather_seq(x: torch.Tensor, group: dist.ProcessGroup, *, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order (not differentiable).

    Used for small per-token metadata such as position ids: ``[B, S_l] -> [B, S]``.
    """
    p = dist.get_world_size(group)
    if p == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(p)]
    with _timed("sp"):
        dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup, *, timed: str | None = None) -> torch.Tensor:
    """Sum of a detached tensor over ``group`` (a new tensor; the input is not modified).

    ``timed="sp"``: counted as sequence-parallel time under ``record_comm_times`` (the loss
    reduce); metric reductions pass nothing and are not counted."""
    out = x.detach().clone()
    if dist.get_world_size(group) > 1:
        with _timed(timed) if timed else contextlib.nullcontext():
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def comm_device(group: dist.ProcessGroup, device: torch.device) -> torch.device:
    """The device whose tensors ``group``'s backend exchanges: ``device`` for NCCL-like backends,
    the CPU for gloo (which has no all-to-all of accelerator tensors)."""
    if device.type == "cpu" or dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    return device


def exchange_bytes(
    pieces: list[list[torch.Tensor]], recv_nbytes: list[int], group: dist.ProcessGroup, device: torch.device
) -> torch.Tensor:
    """One ``all_to_all`` of raw bytes: ``pieces[k]`` (any dtypes and shapes) goes to rank ``k``.

    Every tensor is sent as its bytes, packed into one buffer, so there is one collective whatever
    the number of tensors and dtypes, and uneven sizes need no padding. ``recv_nbytes[r]`` is what
    rank ``r`` sends here (the caller knows it from metadata agreed beforehand).

    Returns:
        ``[sum(recv_nbytes)]`` uint8, on ``comm_device(group, device)``: rank 0's bytes first.
    """
    where = comm_device(group, device)
    send_parts, in_splits = [], []
    for piece in pieces:
        # each tensor -> [numel * itemsize] uint8, in the caller's order
        parts = [t.contiguous().reshape(-1).view(torch.uint8) for t in piece]
        send_parts += parts
        in_splits.append(sum(t.numel() for t in parts))
    send = torch.cat(send_parts).to(where) if send_parts else torch.empty(0, dtype=torch.uint8, device=where)
    del send_parts
    recv = torch.empty(sum(recv_nbytes), dtype=torch.uint8, device=where)
    dist.all_to_all_single(recv, send, list(recv_nbytes), in_splits, group=group)
    return recv


def sum_over_sp_mean_over_dp_(grad: torch.Tensor, group: dist.ProcessGroup, dp_size: int) -> dist.Work:
    """Start the gradient reduction in place: ``grad <- sum over group / dp_size`` (async).

    ``group`` spans all ``dp * sp`` ranks (``SPMesh.reduce_group``): summing there sums a sample's
    gradient shares over its SP group and, divided by ``dp_size``, averages the replicas over the
    DP axis — one collective. Divides first: the same rounding as FSDP2's path, and no fp16
    overflow. Returns the collective's ``Work``.
    """
    grad.div_(dp_size)
    if active_comm_times() is None:
        return dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group, async_op=True)
    with _timed("dp"):  # timed: wait here, hand DDP an already-completed Work
        work = dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group, async_op=True)
        work.wait()
    return work


def broadcast_from_first_(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Overwrite every tensor in place with the group's first rank's (one broadcast each, in order)."""
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t.data, group_src=0, group=group)


def barrier(group: dist.ProcessGroup) -> None:
    """Wait until every rank of ``group`` got here (file-system ordering: written before renamed)."""
    dist.barrier(group=group)


def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj`` in rank order (for small metadata: lengths, shapes, error messages)."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def raise_if_any_rank_failed(
    error: str | None, group: dist.ProcessGroup | None = None, exc_type: type[Exception] = ValueError
) -> None:
    """Collective error agreement: if any rank passes a message, **every** rank raises.

    A check that only some ranks can fail (their own batch, their own shard) must go through this
    before the next collective, or the healthy ranks would block in it until the timeout. The
    raised message names the failing ranks and their messages.
    """
    if not dist.is_initialized():
        if error is not None:
            raise exc_type(error)
        return
    errors = all_gather_object(error, group)
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if bad:
        if len({e for _, e in bad}) == 1:
            ranks = ", ".join(str(r) for r, _ in bad)
            raise exc_type(f"{bad[0][1]} (on rank(s) {ranks} of the group)")
        raise exc_type("; ".join(f"rank {r}: {e}" for r, e in bad))


# --- run metrics
def all_reduce_max(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Element-wise maximum of a detached tensor over ``group`` (a new tensor; the input is not
    modified). For run metrics such as the busiest rank's peak memory; ``group=None`` is the
    default (world) group."""
    out = x.detach().clone()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out
