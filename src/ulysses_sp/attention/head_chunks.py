"""Head-chunked Ulysses attention (the idea behind UPipe): one group of heads through the exchange at a time.

Plain Ulysses attends all heads at once: the full-sequence q/k/v, the core's saved tensors and, in
backward, their gradients are alive together (its exchange, ``parallel/headwise.py``, goes head by
head and adds no buffers; a head group's exchange here packs the group: two buffers of its size).
Here each rank's ``H_l = H/P`` heads (the ones plain Ulysses gives it) are cut into ``N`` groups of
``H_c = H_l/N``; for group ``g`` in turn: the all-to-all brings every rank its ``g``-th ``H_c`` query heads over the full sequence
(``[B, P*H_c, S_l, D] -> [B, H_c, S, D]``), the same core attends (sdpa, segments, blockwise,
offload, ring), and the output goes back (``[B, S, H_c, D] -> [B, S_l, P*H_c, D]``). Attention is
independent per head: the same math, exact.

**K/V**: a group's queries use ``Hkv_c`` of the rank's kv heads. When groups are at least a kv
group wide (``H_c`` a multiple of ``G_l = H_l/Hkv_l``) the group's own kv heads travel with its
queries. When several groups share a kv head (GQA: ``H_c < G_l``), that kv head travels with the
first of them, stays for the ``G_l/H_c`` groups that use it, and its gradient goes home with the
last — no byte is sent twice in a pass; kv heads replicated to ``P`` (``Hkv < P``, as plain
Ulysses) form one set for all groups, their gradients summed over the replicas at the end.

**Backward** (``_HeadChunkedAttention``): forward runs the groups without autograd and saves only the
layer's local q/k/v inputs (``[B, H*, S_l, D]``); backward redoes each group's exchange and attention
forward under autograd, takes its gradients and sends them home (dq into q's own storage: a group's
query heads are free once packed), one group at a time. So in forward *and* backward one group's
exchange buffers and attention activations are alive (two with ``overlap``), for one more q/k/v
exchange and attention forward per layer (activation checkpointing recomputes the layer anyway).

**One rank** (``group=None``, ``P`` 1: sp 1, where no exchange exists): the same groups in turn, each
group's q/k/v views of the layer's own (nothing sent or copied), so that one group's attention
activations and kernel workspace (on CUDA FlashAttention-2's fp32 dq accumulator and GQA-expanded dk/dv,
``O(S H_c D)`` each) are alive instead of every head's.

**Overlap** (``overlap=True``; off by default: it keeps two groups' buffers alive, and on CPU gloo's
thread competes with compute for the same cores): the next group's exchange is posted asynchronously
(``comm.start_exchange``) before the current group's attention and waited after it; each group's
output exchange is waited after the next group's attention.

Per-head parameters (attention sinks) are refused: recomputation returns gradients for q/k/v only.

Shape legend: ``B`` batch, ``S`` full sequence, ``S_l = S/P``, ``H`` query heads, ``H_l = H/P``,
``Hkv`` kv heads, ``Hkv' = max(Hkv, P)`` after replication, ``Hkv_l = Hkv'/P``, ``N`` head groups,
``H_c = H_l/N``, ``Hkv_c`` kv heads of one group, ``P`` Ulysses size, ``D`` head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ulysses_sp.parallel.comm import start_exchange

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``attend(group, q [B, H_c, S, D], k, v [B, Hkv_c, S, D]) -> [B, S, H_c, D]``."""


@dataclass(frozen=True)
class HeadGroups:
    """How one layer's heads are cut: ``n`` groups of ``hc`` local query heads; kv heads in sets."""

    n: int
    p: int
    """The Ulysses size."""
    hc: int
    """``H_c``: query heads of one group on one rank."""
    span: int
    """Consecutive groups sharing one kv set (1: each group has its own kv heads)."""
    kvs: int
    """Local kv heads in one set."""
    repeat: int
    """kv replication before the exchange (``P / Hkv`` when ``Hkv < P``), else 1."""


def plan_head_chunks(num_heads: int, num_kv_heads: int, chunks: int, ulysses_size: int) -> HeadGroups:
    """The head groups of a layer; ``ValueError`` naming the numbers and the valid counts."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"head_chunks must be a positive number of head groups, got {chunks!r}")
    problem = _problem(num_heads, num_kv_heads, chunks, ulysses_size)
    if problem:
        valid = valid_head_chunks(num_heads, num_kv_heads, ulysses_size)
        raise ValueError(f"head_chunks {chunks}: {problem}; valid head_chunks for {num_heads} query / "
                         f"{num_kv_heads} kv heads over {ulysses_size} Ulysses ranks: {valid}")  # fmt: skip
    p = ulysses_size
    h_l, hkv_l = num_heads // p, max(num_kv_heads, p) // p
    hc, g_l, repeat = h_l // chunks, h_l // hkv_l, max(1, p // num_kv_heads)
    if repeat > 1:  # replicated kv heads: one set for every group
        return HeadGroups(chunks, p, hc, chunks, hkv_l, repeat)
    return HeadGroups(chunks, p, hc, max(1, g_l // hc), max(1, hc // g_l), 1)


def _problem(h: int, hkv: int, n: int, p: int) -> str | None:
    if h % p or (hkv % p and p % hkv) or h % hkv:
        return f"the heads do not split over the {p} Ulysses ranks"
    h_l, g_l = h // p, h // p // (max(hkv, p) // p)
    if h_l % n:
        return f"each rank's {h_l} query heads (num_attention_heads / {p}) are not divisible by it"
    hc = h_l // n
    if hc % g_l and g_l % hc:
        return f"a group's {hc} query heads would split a set of {g_l} query heads sharing a kv head"
    return None


def valid_head_chunks(num_heads: int, num_kv_heads: int, ulysses_size: int) -> list[int]:
    """Head group counts that work for ``num_heads``/``num_kv_heads`` over ``ulysses_size`` ranks."""
    return [n for n in range(1, num_heads + 1) if _problem(num_heads, num_kv_heads, n, ulysses_size) is None]


def check_no_sinks(module: torch.nn.Module, kwargs: dict, chunks: int) -> None:
    """Refuse per-head parameters in the attention (sinks): the backward's recomputation would drop
    their gradients."""
    if kwargs.get("s_aux") is not None or isinstance(getattr(module, "sinks", None), torch.Tensor):
        raise ValueError(
            f"head_chunks ({chunks}) recomputes each head group's attention in backward with gradients for "
            f"q/k/v only, and {type(module).__name__} has attention sinks (a learned logit per head): their "
            "gradient would be lost. Use head_chunks 1 for this model"
        )


def _rows(x: torch.Tensor, hg: HeadGroups, sets: int, per: int, i: int) -> torch.Tensor:
    """``[B, P*sets*per, S_l, D] -> [P, B, per, S_l, D]``: every rank's ``i``-th ``per`` heads (a view)."""
    b, _, s_l, d = x.shape
    return x.view(b, hg.p, sets, per, s_l, d)[:, :, i].movedim(1, 0)


def _replicated(k: torch.Tensor, hg: HeadGroups) -> torch.Tensor:
    # [B, Hkv, S_l, D] -> [B, Hkv', S_l, D]: rank j receives the kv head its queries use
    return k.repeat_interleave(hg.repeat, 1) if hg.repeat > 1 else k


def _exchange(parts: list[torch.Tensor], dims: list[int | None], group, overlap: bool = True) -> Callable:
    """``comm.start_exchange`` of ``parts`` (``[P, ...]`` each), or with no group (``P`` 1) the parts as
    they arrive from the one rank: views, nothing sent or copied."""
    if group is None:
        return lambda: tuple(t if d is None else t[0] for t, d in zip(parts, dims))
    return start_exchange(parts, dims, group, async_op=overlap)


def _group_in(q, k, v, dout, hg: HeadGroups, g: int, group, overlap: bool) -> Callable:
    """Group ``g``'s exchange: q ``-> [B, H_c, S, D]``; the kv set it opens, k, v ``-> [B, kvs, S,
    D]``; in backward the output gradient ``[B, S_l, H, D] -> [B, S, H_c, D]``. With ``overlap``: one
    collective, posted now; without: one per kind of tensor, run in turn when waited for, so that
    only one kind's buffers are alive at a time."""
    pieces = []
    if g % hg.span == 0:
        pieces.append(([_rows(t, hg, hg.n // hg.span, hg.kvs, g // hg.span) for t in (k, v)], [2, 2]))
    pieces.insert(0, ([_rows(q, hg, hg.n, hg.hc, g)], [2]))
    if dout is not None:  # [B, S_l, H, D] -> [P, B, S_l, H_c, D]
        b, s_l, _, d = dout.shape
        pieces.append(([dout.view(b, s_l, hg.p, hg.n, hg.hc, d)[:, :, :, g].movedim(2, 0)], [1]))
    if overlap:
        return _exchange([p for parts, _ in pieces for p in parts], [d for _, dims in pieces for d in dims], group)
    return lambda: tuple(t for parts, dims in pieces for t in _exchange(parts, dims, group, False)())


class _HeadChunkedAttention(torch.autograd.Function):
    """Forward: every head group exchanged, attended and exchanged back without autograd, saving the
    local q/k/v. Backward: per group, the exchange and attention again under autograd, its gradients
    back through the inverse exchange."""

    @staticmethod
    def forward(ctx, attend: Attend, hg: HeadGroups, group, overlap: bool, q, k, v):
        b, h, s_l, d = q.shape
        out = q.new_empty((b, s_l, h, d))  # [B, S_l, H, D]
        kr, vr = _replicated(k, hg), _replicated(v, hg)  # [B, Hkv', S_l, D]
        start = lambda g: _group_in(q, kr, vr, None, hg, g, group, overlap)  # noqa: E731
        back, pending, kv = None, start(0), ()
        for g in range(hg.n):
            qf, *new_kv = pending()  # [B, H_c, S, D] (+ a kv set's k, v [B, kvs, S, D])
            pending, kv = None, new_kv or kv
            pending = start(g + 1) if overlap and g + 1 < hg.n else None
            o = attend(g, qf, *kv)  # [B, S, H_c, D]
            del qf, new_kv
            if g % hg.span == hg.span - 1:
                kv = ()  # the set's last group: its K/V go
            if back is not None:
                back = back()  # None: the finished exchange's buffers go before the next is allocated
            # [B, S, H_c, D] -> [P, B, S_l, H_c, D] -> home; arriving [P(src), B, S_l, H_c, D]
            back = _out_home(_exchange([o.unflatten(1, (hg.p, -1)).movedim(1, 0)], [None], group), out, hg, g)
            del o
            if not overlap:
                back = back()
            if pending is None and g + 1 < hg.n:
                pending = start(g + 1)
        if back is not None:
            back()
        ctx.attend, ctx.hg, ctx.group, ctx.overlap = attend, hg, group, overlap
        # backward writes dq into q's own storage (nothing reads q after this layer: the rotary's backward
        # needs cos/sin only; a second reader would fail autograd's version check, loudly); not for a leaf
        # (the caller's values) or a q sharing its storage with k/v (K/V may also sit in a KV cache)
        # (storages compared by identity, not data_ptr: a fake tensor's is 0, and the rehearsal must see the reuse)
        ctx.reuse = not q.is_leaf and q.untyped_storage()._cdata not in {t.untyped_storage()._cdata for t in (k, v)}
        ctx.save_for_backward(q, k, v)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        hg, group = ctx.hg, ctx.group
        kr, vr = _replicated(k, hg), _replicated(v, hg)  # [B, Hkv', S_l, D]
        dq = q if ctx.reuse else torch.empty_like(q)
        dkr, dvr = torch.empty_like(kr), torch.empty_like(vr)
        start = lambda g: _group_in(q, kr, vr, dout, hg, g, group, ctx.overlap)  # noqa: E731
        back, pending, kv, dkv = None, start(0), (), ()
        for g in range(hg.n):
            qf, *got = pending()
            pending = None
            pending = start(g + 1) if ctx.overlap and g + 1 < hg.n else None
            if len(got) == 3:  # the first group of a kv set: its K/V, and fp32 gradient accumulators
                kv = tuple(t.detach().requires_grad_() for t in got[:2])
                dkv = tuple(torch.zeros_like(t, dtype=torch.promote_types(t.dtype, torch.float32)) for t in kv)
            dof = got[-1]  # [B, S, H_c, D]
            qf = qf.detach().requires_grad_()
            with torch.enable_grad():
                o = ctx.attend(g, qf, *kv)  # [B, S, H_c, D]
                gq, gk, gv = torch.autograd.grad(o, (qf, *kv), dof)
            del o, qf, dof, got
            dkv[0].add_(gk)
            dkv[1].add_(gv)
            # [B, H*_c, S, D] -> [P, B, H*_c, S_l, D] -> home; arriving [P(src), B, H*_c, S_l, D]
            closing = g % hg.span == hg.span - 1
            # the set's fp32 sums sent in k/v's dtype (they land in dkr/dvr of that dtype anyway: the same
            # bits) and freed before the exchange, not held beside its buffers
            sending = [gq] + ([t.to(kr.dtype) for t in dkv] if closing else [])
            del gq, gk, gv
            if closing:
                kv = dkv = ()
            if back is not None:
                back = back()
            parts = [t.unflatten(2, (hg.p, -1)).movedim(2, 0) for t in sending]
            back = _grads_home(_exchange(parts, [None] * len(parts), group), (dq, dkr, dvr), hg, g)
            del sending, parts
            if not ctx.overlap:
                back = back()
            if pending is None and g + 1 < hg.n:
                pending = start(g + 1)
        if back is not None:
            back()
        # [B, Hkv', S_l, D] -> [B, Hkv, S_l, D]: the replicas' gradients summed
        dk, dv = (t.unflatten(1, (-1, hg.repeat)).sum(2) if hg.repeat > 1 else t for t in (dkr, dvr))
        return None, None, None, None, dq, dk, dv


def _out_home(finish: Callable, out: torch.Tensor, hg: HeadGroups, g: int) -> Callable[[], None]:
    """Wait for a group's output exchange; ``[P(src), B, S_l, H_c, D]`` into ``out [B, S_l, H, D]``."""
    def run() -> None:
        (o,) = finish()
        b, s_l, _, d = out.shape
        out.view(b, s_l, hg.p, hg.n, hg.hc, d)[:, :, :, g].copy_(o.movedim(0, 2))
    return run


def _grads_home(finish: Callable, dest: tuple, hg: HeadGroups, g: int) -> Callable[[], None]:
    """Wait for a group's gradient exchange: rank ``j``'s pieces to its heads of dq (and of the kv
    set's dk, dv when the group closed one)."""
    def run() -> None:
        got = finish()  # [P(src), B, H*_c, S_l, D] each
        _rows(dest[0], hg, hg.n, hg.hc, g).copy_(got[0])
        for t, piece in zip(dest[1:], got[1:]):
            _rows(t, hg, hg.n // hg.span, hg.kvs, g // hg.span).copy_(piece)
    return run


def head_chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attend: Attend,
    groups: HeadGroups,
    group: dist.ProcessGroup | None,
    overlap: bool = False,
) -> torch.Tensor:
    """Ulysses attention one head group at a time: ``[B, H, S_l, D]`` q and ``[B, Hkv, S_l, D]`` k, v
    -> ``[B, S_l, H, D]``, equal to the unchunked exchange-attend-exchange.

    Args:
        attend: the core over the full sequence for one group (``Attend``); called once per group in
            forward and again in backward, so it must be deterministic.
        groups: ``plan_head_chunks(H, Hkv, N, P)``.
        group: the Ulysses all-to-all group (``P`` ranks); ``None`` for one rank (``groups.p`` 1, sp 1):
            no exchange, each group's q/k/v are views of the inputs.
        overlap: post the next group's exchange before attending the current one (double buffering:
            two groups' exchanges alive); False (default): one at a time, the least memory.
    """
    if group is None and groups.p != 1:
        raise ValueError(f"head_chunked_attention: no group for {groups.p} Ulysses ranks (None is one rank)")
    return _HeadChunkedAttention.apply(attend, groups, group, overlap, q, k, v)
