"""Ring attention over the ring axis: exact attention whose key/value chunks live on other ranks.

The same algorithm as ``attention/blockwise.py``'s core, with the key chunks arriving over the network: each
of the ``R`` ring ranks holds ``S_r = S/R`` tokens of q, k and v; its K/V (packed in one buffer)
travel once around the ring, and every rank merges each visiting chunk into its running output
with the online softmax (``attend_chunk`` at the chunk's **global** offsets, so the causal mask,
packed documents and sliding windows need nothing ring-specific). Backward recomputes from the
saved final LSE (``attend_chunk_backward``): the K/V go around again, each together with the dK/dV
accumulator of the chunk it carries, so every rank's dK/dV arrive home complete after the ring.
Where it sits in the step (DESIGN.md step 4): inside the attention layer, after the Ulysses
all-to-all (ring x ulysses hybrid) or in place of it.

**Zigzag layout** (causal load balance): the sequence is cut into ``2R`` chunks of ``c = S/(2R)``
tokens; ring rank ``i`` holds chunk ``i`` followed by chunk ``2R-1-i``, so under the causal mask
every rank computes the same number of blocks (a contiguous layout leaves rank ``R-1`` ~``2R-1``
times the work of rank 0). ``zigzag=False`` takes contiguous ``S_r`` pieces (for comparison).

**Communication per rank and layer call** (``RingStats``), ``KV = 2 B Hkv S_r D`` elements:
forward ``R-1`` hops of K/V; backward ``R-1`` hops of K/V plus ``R`` hops of the dK/dV accumulator
(fp32; the last hop takes each finished accumulator home). Bytes sent per rank:
``2 (R-1) KV itemsize(input) + R KV itemsize(fp32)``, in ``3R - 2`` messages (one per hop, each one
``comm.ring_exchange``: send to the next ring rank, receive from the previous; ``2R`` steps). **Overlap**: a step's K/V hop is posted before the step's compute and
waited after it (double buffering); the dK/dV hop of step ``t`` is posted after its compute and
waited after step ``t+1``'s compute, whose contribution is built in a third buffer meanwhile.

Numerics: fp32 accumulation (fp64 for fp64 inputs) as in ``attention/blockwise.py``; output in q's dtype.

Shape legend: ``B`` batch, ``S`` global sequence, ``R`` ring size, ``S_r = S/R`` local tokens,
``c = S/(2R)`` zigzag chunk, ``H`` query heads, ``Hkv`` kv heads, ``D`` head dim.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from ulysses_sp.attention.blockwise import (
    AttnStructure,
    BlockCounts,
    attend_chunk,
    attend_chunk_backward,
    check_gqa,
    default_scale,
    resolve_chunk,
)
from ulysses_sp.parallel.comm import ring_exchange
from ulysses_sp.parallel.mesh_shape import contiguous_spans, zigzag_spans

KV_TAG, DKV_TAG = 0, 1
"""Tags of the two kinds of hop (gloo keeps a K/V hop and a dK/dV hop in flight apart)."""


@dataclass
class RingStats:
    """What ring attention sent from this rank (summed over calls, forward and backward)."""

    bytes_sent: int = 0
    """Bytes this rank sent to its next ring rank."""
    messages: int = 0
    """Point-to-point sends (one per hop: K/V packed in one buffer, dK/dV in another)."""
    steps: int = 0
    """Ring steps run (``R`` per forward and ``R`` per backward)."""
    wait_s: float = 0.0
    """Host seconds blocked waiting for hops: the communication left exposed. Meaningful where the
    wait blocks the host (gloo/CPU); under NCCL a wait only orders streams and this stays ~0."""


class _Piece(NamedTuple):
    """A run of tokens in a rank's buffer: local ``[local, local + stop - start)`` is global
    ``[start, stop)``."""

    local: int
    start: int
    stop: int


def _pieces(spans: list[tuple[int, int]]) -> list[_Piece]:
    out, local = [], 0
    for a, b in spans:
        out.append(_Piece(local, a, b))
        local += b - a
    return out


@dataclass(frozen=True)
class _Ring:
    """One call's ring: the group, this rank, every rank's pieces, the overlap switch, the stats."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    pieces: tuple[list[_Piece], ...]
    """``pieces[r]``: ring rank ``r``'s pieces (where the K/V chunk of rank ``r`` sits globally)."""
    overlap: bool
    stats: RingStats | None

    def post(self, send: torch.Tensor, recv: torch.Tensor, tag: int) -> list[dist.Work]:
        """Start a hop (send to next, receive from previous); without overlap, finish it now."""
        works = ring_exchange(send, recv, self.group, tag=tag)
        if self.stats is not None:
            self.stats.bytes_sent += send.numel() * send.element_size()
            self.stats.messages += 1
        if not self.overlap:
            self.wait(works)
            return []  # waited: a gloo p2p work must not be waited twice (it blocks)
        return works

    def wait(self, works: list[dist.Work]) -> None:
        t0 = time.perf_counter()
        for w in works:
            w.wait()
        if self.stats is not None and works:
            self.stats.wait_s += time.perf_counter() - t0

    def step(self, t: int) -> int:
        """The ring rank whose K/V chunk is here at step ``t`` (own at 0, then one further back)."""
        if self.stats is not None:
            self.stats.steps += 1
        return (self.rank - t) % self.size


def _pairs(
    qp: list[_Piece], kp: list[_Piece], structure: AttnStructure, block: int, counts: BlockCounts | None
):
    """The (query piece, key piece) pairs with a visible key; fully masked pairs are never
    computed (their blocks count as skipped)."""
    for q in qp:
        for k in kp:
            if structure.block_kind(q.start, q.stop, k.start, k.stop) != "empty":
                yield q, k
            elif counts is not None:
                counts.skipped += math.ceil((q.stop - q.start) / block) * math.ceil(
                    (k.stop - k.start) / block
                )


def _sl(x: torch.Tensor, p: _Piece) -> torch.Tensor:
    """The piece's tokens of ``[B, H*, S_r, D]`` or ``[B, H, S_r]`` (a view; tokens are dim 2)."""
    return x.narrow(2, p.local, p.stop - p.start)


class _RingAttention(torch.autograd.Function):
    """Ring attention forward (K/V around the ring, online-softmax merge); backward recomputes from
    the saved LSE, K/V around again with the dK/dV accumulators following them home."""

    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring, structure, scale, block, counts):
        b, h, s_r, d = q.shape
        acc = torch.promote_types(q.dtype, torch.float32)
        out = q.new_zeros((b, h, s_r, d), dtype=acc)
        lse = q.new_full((b, h, s_r), float("-inf"), dtype=acc)
        kv = torch.stack((k, v))  # 2 x [B, Hkv, S_r, D] -> [2, B, Hkv, S_r, D]: one buffer per hop
        spare = torch.empty_like(kv) if ring.size > 1 else None
        for t in range(ring.size):
            src = ring.step(t)
            works = ring.post(kv, spare, KV_TAG) if t < ring.size - 1 else []
            for qp, kp in _pairs(ring.pieces[ring.rank], ring.pieces[src], structure, block, counts):
                attend_chunk(_sl(q, qp), _sl(kv[0], kp), _sl(kv[1], kp), _sl(out, qp), _sl(lse, qp),
                             q_offset=qp.start, k_offset=kp.start, scale=scale, structure=structure,
                             block=block, counts=counts)  # fmt: skip
            ring.wait(works)
            if t < ring.size - 1:  # the chunk just received is the next step's
                kv, spare = spare, kv
        out = out.to(q.dtype)
        ctx.meta = (ring, structure, scale, block, counts)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        ring, structure, scale, block, counts = ctx.meta
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # [B, H, S_r]
        dq = torch.zeros_like(q, dtype=lse.dtype)
        kv = torch.stack((k, v))  # [2, B, Hkv, S_r, D]
        spare = torch.empty_like(kv) if ring.size > 1 else None
        # dK/dV accumulators [2, B, Hkv, S_r, D] fp32: the one travelling out, the one arriving,
        # and this step's own contribution (built while the previous hop is still in flight)
        send = kv.new_zeros(kv.shape, dtype=lse.dtype)
        recv, mine = torch.empty_like(send), torch.empty_like(send)
        d_works: list[dist.Work] = []
        for t in range(ring.size):
            src = ring.step(t)
            works = ring.post(kv, spare, KV_TAG) if t < ring.size - 1 else []
            target = send if t == 0 else mine.zero_()
            for qp, kp in _pairs(ring.pieces[ring.rank], ring.pieces[src], structure, block, counts):
                attend_chunk_backward(_sl(q, qp), _sl(kv[0], kp), _sl(kv[1], kp), _sl(dout, qp), _sl(lse, qp),
                                      _sl(delta, qp), _sl(dq, qp), _sl(target[0], kp), _sl(target[1], kp),
                                      q_offset=qp.start, k_offset=kp.start, scale=scale,
                                      structure=structure, block=block, counts=counts)  # fmt: skip
            if t > 0:  # the accumulator of chunk `src` from the previous ring rank, plus ours
                ring.wait(d_works)
                recv.add_(mine)
                send, recv = recv, send
            ring.wait(works)
            if t < ring.size - 1:  # the chunk just received is the next step's
                kv, spare = spare, kv
            if ring.size > 1:  # after the last step this hop takes the finished accumulator home
                d_works = ring.post(send, recv, DKV_TAG)
        ring.wait(d_works)
        dkv = recv if ring.size > 1 else send  # [2, B, Hkv, S_r, D]: this rank's own dK, dV
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    ring_rank: int | None = None,
    structure: AttnStructure | None = None,
    scale: float | None = None,
    chunk: int | None = None,
    counts: BlockCounts | None = None,
    zigzag: bool = True,
    overlap: bool = True,
    stats: RingStats | None = None,
) -> torch.Tensor:
    """Exact causal attention of this ring rank's queries over the keys of the whole ring.

    Equals, on this rank's tokens, ``blockwise_attention`` (or sdpa with the structure's dense mask)
    over the full gathered sequence, without any rank holding more than its own ``S_r`` tokens of
    K/V plus one chunk in flight. Differentiable (custom backward, recompute from the saved LSE):
    the gradients of ``q, k, v`` are this rank's pieces of the full-sequence gradients.

    Args:
        q: ``[B, H, S_r, D]`` this rank's queries; k, v: ``[B, Hkv, S_r, D]`` (``Hkv`` divides
            ``H``; K/V are never expanded), in the layout ``zigzag`` names (``zigzag_spans`` or
            ``contiguous_spans`` of ``S = R * S_r``).
        group: the ring process group (``R`` = its size; the ring order is its rank order); ``None``
            = a ring of one (no communication; equals ``blockwise_attention``).
        ring_rank: this rank's position in the ring, checked against ``group`` (``None``: the
            group rank).
        structure: documents (``doc_ids [B|1, S]`` in **global** order) and window; ``None``: causal.
        scale: score scale (``None``: ``1/sqrt(D)``); chunk: tokens per block (``None``:
            ``resolve_chunk``'s choice for ``S_r``); counts: where to count blocks and FLOPs.
        zigzag: load-balanced layout (chunks ``i`` and ``2R-1-i``); False: contiguous pieces.
        overlap: post each hop before the step's compute and wait after it; False: wait at once.
        stats: where to count bytes, messages, steps and exposed wait time.

    Returns:
        ``[B, H, S_r, D]`` in ``q``'s dtype.
    """
    check_gqa(q, k, v)
    if k.shape[2] != q.shape[2]:
        raise ValueError(
            f"ring attention needs as many local keys as queries: q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    size = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    if ring_rank is not None and ring_rank != rank:
        raise ValueError(
            f"ring_rank {ring_rank} is not this process's rank in the ring group ({rank} of {size})"
        )
    seq_len = q.shape[2] * size
    structure = structure or AttnStructure()
    if structure.doc_ids is not None and structure.doc_ids.shape[-1] != seq_len:
        raise ValueError(
            f"structure.doc_ids covers {structure.doc_ids.shape[-1]} tokens but the ring's sequence is "
            f"R * S_r = {size} * {q.shape[2]} = {seq_len}: pass doc ids of the full sequence in global order"
        )
    spans_of = zigzag_spans if zigzag else contiguous_spans
    pieces = tuple(_pieces(spans_of(seq_len, size, r)) for r in range(size))
    ring = _Ring(group, size, rank, pieces, overlap, stats)
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    block = resolve_chunk(chunk, q.shape[2], q.shape[-1])
    return _RingAttention.apply(q, k, v, ring, structure, scale, block, counts)
