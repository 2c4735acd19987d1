"""Head-chunked Ulysses attention (the idea behind UPipe): one group of heads through the exchange at a time.

Plain Ulysses moves all heads at once: the q/k/v all-to-all's send and receive buffers and their
unpacked full-sequence copies (``3 x [B, H_l, S, D]``-sized each), the core attention's saved tensors
and, in backward, the gradients' buffers are all alive together — the attention layer's peak. Here
the ``H`` query heads are cut into ``N`` contiguous groups (each with the kv heads its queries use);
for each group in turn: all-to-all the group's q/k/v (``[B, H/N, S_l, D] -> [B, H/(N P), S, D]``),
attend over the full sequence with the same core (sdpa, segments, blockwise, offload, ring), and
all-to-all the group's output back (``[B, S, H/(N P), D] -> [B, S_l, H/N, D]``). Attention is
independent per head, so this is the same math: exact.

**Backward** (``_HeadChunkedAttention``): forward runs every group without autograd and saves only
the layer's local q/k/v inputs (``[B, H*, S_l, D]``, the size of what plain Ulysses' core saves);
backward redoes each group's exchange and attention forward under autograd, takes its gradients and
sends them back, one group at a time. So in forward *and* backward only one group's exchange buffers
and attention activations are alive (two with ``overlap``: the next group's exchange is in flight),
for one extra all-to-all of q/k/v and one extra attention forward per layer (activation
checkpointing recomputes the layer anyway; this adds the attention part once more).

**Overlap** (``overlap=True``; off by default: it keeps two groups' buffers alive, and on CPU the
measured gain is noise): the next group's q/k/v exchange is posted (``comm.start_all_to_all_packed``, async)
before the current group's attention and waited after it; each group's output exchange is waited
after the next group's attention. On NCCL the collectives run beside compute; on gloo/CPU they run
on gloo's threads, which compete with compute for the same cores.

Groups: ``N`` divides ``H``; a group's ``H/N`` query heads use ``H/(N G)`` kv heads (``G = H/Hkv``),
or share one when ``H/N < G``; they are replicated to ``P`` before the exchange when fewer than
``P`` (as plain Ulysses does when ``Hkv < P``) and their gradients summed back. Per-head parameters
(attention sinks) are refused: recomputation returns gradients for q/k/v only.

Shape legend: ``B`` batch, ``S`` full sequence, ``S_l = S/P``, ``H`` query heads, ``Hkv`` kv heads,
``N`` head groups, ``H_c = H/N`` query heads per group, ``P`` Ulysses size, ``D`` head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ulysses_sp.parallel.comm import start_all_to_all_packed
from ulysses_sp.parallel.mesh_shape import check_heads

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``attend(group_index, q [B, H_c/P, S, D], k, v [B, Hkv_c/P, S, D]) -> [B, S, H_c/P, D]``."""


@dataclass(frozen=True)
class HeadChunk:
    """One group of heads: its query heads, the kv heads they use, and the kv replication."""

    q: slice
    """Query heads ``[a, b)`` of the model's ``H``."""
    kv: slice
    """The kv heads those queries use."""
    repeat: int
    """Copies of each kv head sent (``P / kv heads`` when the group has fewer than ``P``), else 1."""


def plan_head_chunks(num_heads: int, num_kv_heads: int, chunks: int, ulysses_size: int) -> list[HeadChunk]:
    """The ``chunks`` head groups of a layer; ``ValueError`` naming the numbers and the valid counts."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"head_chunks must be a positive number of head groups, got {chunks!r}")
    problem = _problem(num_heads, num_kv_heads, chunks, ulysses_size)
    if problem:
        valid = valid_head_chunks(num_heads, num_kv_heads, ulysses_size)
        raise ValueError(f"head_chunks {chunks}: {problem}; valid head_chunks for {num_heads} query / "
                         f"{num_kv_heads} kv heads over {ulysses_size} Ulysses ranks: {valid}")  # fmt: skip
    hc, g = num_heads // chunks, num_heads // num_kv_heads
    hk = max(1, hc // g)
    rep = ulysses_size // hk if hk < ulysses_size else 1
    return [HeadChunk(slice(i * hc, (i + 1) * hc), slice(i * hc // g, i * hc // g + hk), rep) for i in range(chunks)]


def _problem(h: int, hkv: int, n: int, p: int) -> str | None:
    if h % n:
        return f"num_attention_heads ({h}) is not divisible by it"
    hc, g = h // n, h // hkv
    if (hc % g if hc >= g else g % hc):
        return f"a group's {hc} query heads would split a group of {g} query heads sharing a kv head"
    try:
        check_heads(hc, max(1, hc // g), p)
    except ValueError:
        return f"a group's {hc} query heads ({max(1, hc // g)} kv heads) do not split over {p} Ulysses ranks"
    return None


def valid_head_chunks(num_heads: int, num_kv_heads: int, ulysses_size: int) -> list[int]:
    """Head group counts that split ``num_heads``/``num_kv_heads`` over ``ulysses_size`` ranks."""
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


def _inputs(c: HeadChunk, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One group's q ``[B, H_c, S_l, D]`` and k, v ``[B, Hkv_c * repeat, S_l, D]`` (views unless replicated)."""
    kc, vc = k[:, c.kv], v[:, c.kv]
    if c.repeat > 1:  # [B, Hkv_c, S_l, D] -> [B, P, S_l, D]: rank j receives the kv head its queries use
        kc, vc = kc.repeat_interleave(c.repeat, 1), vc.repeat_interleave(c.repeat, 1)
    return q[:, c.q], kc, vc


class _HeadChunkedAttention(torch.autograd.Function):
    """Forward: every head group exchanged, attended and exchanged back without autograd, saving the
    local q/k/v. Backward: per group, the exchange and attention again under autograd, its gradients
    back through the inverse exchange (kv replicas summed)."""

    @staticmethod
    def forward(ctx, attend: Attend, chunks: list[HeadChunk], group, overlap: bool, q, k, v):
        b, h, s_l, d = q.shape
        out = q.new_empty((b, s_l, h, d))  # [B, S_l, H, D]
        start = lambda i: start_all_to_all_packed(_inputs(chunks[i], q, k, v), 1, 2, group)  # noqa: E731
        back: Callable | None = None
        pending = start(0)
        for i, c in enumerate(chunks):
            qf, kf, vf = pending()  # [B, H*_c, S_l, D] -> [B, H*_c/P, S, D]
            pending = None
            pending = start(i + 1) if overlap and i + 1 < len(chunks) else None
            o = attend(i, qf, kf, vf)  # [B, S, H_c/P, D]
            del qf, kf, vf
            if back is not None:
                back = back()  # None: the finished exchange's buffers go before the next is allocated
            # [B, S, H_c/P, D] -> [B, S_l, H_c, D], written into the output's head slice
            back = _to_seq(start_all_to_all_packed((o,), 1, 2, group), out[:, :, c.q])
            del o
            if not overlap:
                back = back()
            if pending is None and i + 1 < len(chunks):
                pending = start(i + 1)
        if back is not None:
            back()
        ctx.attend, ctx.chunks, ctx.group, ctx.overlap = attend, chunks, group, overlap
        # backward writes dq into q's own storage (nothing reads q after this layer: the rotary's backward
        # needs cos/sin only; a second reader would fail autograd's version check, loudly); not for a leaf
        # (the caller's values) or a q sharing its storage with k/v (K/V may also sit in a KV cache)
        ctx.reuse = not q.is_leaf and q.untyped_storage().data_ptr() not in {
            t.untyped_storage().data_ptr() for t in (k, v)}  # fmt: skip
        ctx.save_for_backward(q, k, v)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        chunks, group = ctx.chunks, ctx.group
        # a group's query heads are free once its exchange is packed: q's storage takes their gradients
        dq, dk, dv = q if ctx.reuse else torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        # each group's inputs and its output gradient [B, S_l, H_c, D] -> [B, H_c, S_l, D] in one exchange
        start = lambda i: start_all_to_all_packed(  # noqa: E731
            (*_inputs(chunks[i], q, k, v), dout[:, :, chunks[i].q].transpose(1, 2)), 1, 2, group)  # fmt: skip
        back: Callable | None = None
        shared: dict = {}  # kv heads shared by consecutive groups: their partial gradients
        pending = start(0)
        for i, c in enumerate(chunks):
            qf, kf, vf, dof = pending()  # [B, H*_c/P, S, D]
            pending = None
            pending = start(i + 1) if ctx.overlap and i + 1 < len(chunks) else None
            qf, kf, vf = (t.detach().requires_grad_() for t in (qf, kf, vf))
            with torch.enable_grad():
                o = ctx.attend(i, qf, kf, vf)  # [B, S, H_c/P, D]
                grads = torch.autograd.grad(o, (qf, kf, vf), dof.transpose(1, 2))
            del o, qf, kf, vf, dof
            if back is not None:
                back = back()
            # [B, H*_c/P, S, D] -> [B, H*_c, S_l, D], into the gradients of the group's heads
            last = i + 1 == len(chunks) or chunks[i + 1].kv != c.kv
            back = _grads_home(start_all_to_all_packed(grads, 2, 1, group), c, (dq, dk, dv), shared, last)
            del grads
            if not ctx.overlap:
                back = back()
            if pending is None and i + 1 < len(chunks):
                pending = start(i + 1)
        if back is not None:
            back()
        return None, None, None, None, dq, dk, dv


def _to_seq(finish: Callable, dest: torch.Tensor) -> Callable[[], None]:
    """Wait for an output exchange and copy it into ``dest`` (``[B, S_l, H_c, D]``)."""
    def run() -> None:
        (o,) = finish()
        dest.copy_(o)
    return run


def _grads_home(finish: Callable, c: HeadChunk, dest: tuple, shared: dict, last: bool) -> Callable[[], None]:
    """Wait for a group's gradient exchange: its query heads' gradients into ``dq``; its kv heads'
    (replicas summed) into ``dk``/``dv`` once ``last`` (no later group uses them), else kept in ``shared``."""
    def run() -> None:
        gq, gk, gv = finish()  # [B, H_c, S_l, D], [B, Hkv_c * repeat, S_l, D] x 2
        dest[0][:, c.q] = gq
        # [B, Hkv_c * r, S_l, D] -> [B, Hkv_c, r, S_l, D] summed over the replicas r
        gk, gv = (g.unflatten(1, (-1, c.repeat)).sum(2) if c.repeat > 1 else g for g in (gk, gv))
        if (c.kv.start, c.kv.stop) in shared:
            pk, pv = shared.pop((c.kv.start, c.kv.stop))
            gk, gv = gk + pk, gv + pv
        if not last:
            shared[(c.kv.start, c.kv.stop)] = (gk, gv)
            return
        dest[1][:, c.kv] = gk
        dest[2][:, c.kv] = gv
    return run


def head_chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attend: Attend,
    chunks: list[HeadChunk],
    group: dist.ProcessGroup,
    overlap: bool = False,
) -> torch.Tensor:
    """Ulysses attention one head group at a time: ``[B, H, S_l, D]`` q and ``[B, Hkv, S_l, D]`` k, v
    -> ``[B, S_l, H, D]``, equal to the unchunked exchange-attend-exchange.

    Args:
        attend: the core over the full sequence for one group (``Attend``); called once per group in
            forward and again in backward, so it must be deterministic.
        chunks: ``plan_head_chunks(H, Hkv, N, P)``.
        group: the Ulysses all-to-all group (``P`` ranks).
        overlap: post the next group's exchange before attending the current one (double buffering:
            two groups' exchanges alive); False (default): one at a time, the least memory.
    """
    return _HeadChunkedAttention.apply(attend, chunks, group, overlap, q, k, v)
