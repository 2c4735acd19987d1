"""Exact attention in query x key blocks with an online softmax: memory linear in the sequence.

The core that replaces a dense ``[B, H_l, S, S]`` score tensor (and the ``[B|1, 1, S, S]`` mask in front
of it) when the full-sequence attention has structure sdpa's ``is_causal`` cannot express: packed
documents (position ids restart), sliding windows, DSA's picked keys (``attention/indexed.py``). Where it
sits in the step: inside ``UlyssesSPAttentionHF`` (DESIGN.md step 4) between the q/k/v all-to-all and the
output all-to-all; ring attention reuses the per-chunk functions with each ring step's K/V chunk.

The scheme is FlashAttention's: keys are taken a chunk at a time; for every query block the chunk's
partial result (normalised output and log-sum-exp) is merged into the running one with ``merge_partials``;
backward recomputes each block's probabilities from the saved LSE, so nothing of size ``S x S`` is ever
saved or built. Blocks the structure masks out entirely (a key block after the query block, before its
document, or outside its window) are **never computed**; blocks the structure leaves entirely visible
run without a mask tensor. ``BlockCounts`` counts both. GQA: the ``G = H/Hkv`` query heads sharing a kv
head are folded into the query rows (``[B, Hkv, G*bq, D] @ [B, Hkv, D, bk]``), so K/V are never expanded.
Numerics: scores, softmax and accumulators in fp32 (fp64 for fp64 inputs; bf16/fp16 inputs are upcast
per block); outputs in the input dtype. No dropout.

Shape legend: ``B`` batch, ``S`` (full) query/key length, ``H`` query heads (``H_l`` under SP),
``Hkv`` kv heads, ``G = H/Hkv``, ``D`` head dim, ``bq``/``bk`` query/key block lengths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ulysses_sp.attention.kv_offload import KVOffload
from ulysses_sp.parallel.doc_layout import doc_boundaries_between

AUTO_CHUNK = 1024
"""The largest block ``chunk=None`` picks (``resolve_chunk``): a ``[B, H, 1024, 1024]`` fp32 score
block at most, independent of ``S``."""


@dataclass(frozen=True)
class AttnStructure:
    """Which keys each query may see: causal (``k <= q``), within its document, within a window.
    Indices are global sequence positions, so a chunk of keys (ring attention, offload) is described
    by its offset alone. ``saved``/``restored``: tensors the core saves for backward through autograd
    (activation checkpointing drops them; ``attention/indexed.py``'s picks), none here."""

    doc_ids: torch.Tensor | None = None
    """``[B|1, S]`` non-decreasing document index per token (packed documents), or ``None``."""
    window: int | None = None
    """Sliding window: query ``q`` sees keys ``q - window < k <= q``; ``None`` = unbounded."""
    doc_starts: tuple[tuple[int, ...], ...] | None = field(default=None, repr=False)
    """Per row of ``doc_ids``: its documents' first tokens as host ints (block skipping: no sync)."""

    @classmethod
    def build(cls, doc_ids: torch.Tensor | None, window: int | None, doc_starts: list | None = None) -> AttnStructure:
        """The structure with ``doc_starts`` as given (the adapter's layout), else read from ``doc_ids``."""
        if doc_ids is not None and doc_starts is None:  # [B|1, S]: a new document where the id changes
            doc_starts = [[0, *((r[1:] != r[:-1]).nonzero().flatten() + 1).tolist()] for r in doc_ids.cpu()]
        return cls(doc_ids, window, None if doc_ids is None else tuple(map(tuple, doc_starts)))

    def saved(self) -> tuple[tuple[torch.Tensor, ...], AttnStructure]:
        return (), self

    def restored(self, tensors: list[torch.Tensor]) -> AttnStructure:
        return self

    def block_kind(self, q0: int, q1: int, k0: int, k1: int) -> str:
        """``"empty"`` (no query of ``[q0, q1)`` sees a key of ``[k0, k1)``), ``"full"`` (every
        query sees every key) or ``"partial"``."""
        if k0 > q1 - 1 or (self.window is not None and q0 - (k1 - 1) >= self.window):
            return "empty"
        if (starts := self.doc_starts) is not None and all(doc_boundaries_between(r, k1 - 1, q0) for r in starts):
            return "empty"  # in every row a document starts after the last key, by the first query
        full = k1 - 1 <= q0 and (self.window is None or (q1 - 1) - k0 < self.window)
        if full and starts is not None:  # no document starts after the first key, by the last query
            full = not any(doc_boundaries_between(row, k0, q1 - 1) for row in starts)
        return "full" if full else "partial"

    def block_mask(self, q0: int, q1: int, k0: int, k1: int, device: torch.device) -> torch.Tensor:
        """``[B|1, 1, 1, bq, bk]`` boolean, True = attend (only for ``"partial"`` blocks)."""
        qi = torch.arange(q0, q1, device=device)[:, None]
        ki = torch.arange(k0, k1, device=device)[None, :]
        allowed = ki <= qi  # [bq, bk]
        if self.window is not None:
            allowed = allowed & (qi - ki < self.window)
        allowed = allowed[None]  # [1, bq, bk]
        if self.doc_ids is not None:
            # [B|1, bq, 1] == [B|1, 1, bk] -> [B|1, bq, bk]: same document only
            allowed = allowed & (self.doc_ids[:, q0:q1, None] == self.doc_ids[:, None, k0:k1])
        return allowed[:, None, None]  # [B|1, 1, 1, bq, bk]


@dataclass
class BlockCounts:
    """Blocks computed and skipped, and the matmul FLOPs spent (forward and backward)."""

    computed: int = 0
    """Query x key blocks computed (each pass counts)."""
    skipped: int = 0
    """Blocks skipped because the structure masks them entirely."""
    unmasked: int = 0
    """Computed blocks that needed no mask tensor."""
    flops: int = 0
    """Matmul FLOPs of the computed blocks: ``4 B H bq bk D`` forward, ``10 B H bq bk D`` backward
    (recompute of the scores included)."""

    def add(self, kind: str, flops: int) -> None:
        if kind == "empty":
            self.skipped += 1
            return
        self.computed += 1
        self.unmasked += kind == "full"
        self.flops += flops


def resolve_chunk(chunk: int | None, seq_len: int, head_dim: int) -> int:
    """Tokens per block, at most ``seq_len``: ``chunk``, or for ``None`` the largest power of two
    (at least 64, at most ``AUTO_CHUNK``) whose ``chunk x chunk`` score block is no larger than the
    ``S x D`` queries of a head: attention's temporaries then stay linear in ``S`` at every length."""
    if chunk is None:
        chunk = min(AUTO_CHUNK, max(64, 2 ** int(math.log2(math.sqrt(seq_len * head_dim)))))
    return max(1, min(chunk, seq_len))


def spans(start: int, stop: int, chunk: int) -> list[tuple[int, int]]:
    """``[(a, b), ...]`` covering ``[start, stop)`` in pieces of ``chunk`` (the last may be short)."""
    return [(a, min(a + chunk, stop)) for a in range(start, stop, chunk)]


def _acc(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the accumulation dtype: fp32, or fp64 for fp64 inputs."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _group(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """``[B, H, bq, D] -> [B, Hkv, G*bq, D]`` (the query heads of one kv head as extra rows)."""
    b, h, bq, d = q.shape
    return q.reshape(b, hkv, (h // hkv) * bq, d)


def _scores(qg, k, scale, mask, g):
    """``[B, Hkv, G*bq, D] x [B, Hkv, bk, D] -> [B, Hkv, G, bq, bk]`` fp32 scaled, masked to -inf."""
    b, hkv, rows, _ = qg.shape
    s = torch.matmul(_acc(qg), _acc(k).transpose(-1, -2)).mul_(scale)  # [B, Hkv, G*bq, bk]
    s = s.view(b, hkv, g, rows // g, k.shape[-2])  # [B, Hkv, G, bq, bk]
    if mask is not None:
        s.masked_fill_(~mask, float("-inf"))
    return s


def attend_block(q, k, v, *, scale: float, mask: torch.Tensor | None):
    """One query block against one key block.

    Args:
        q: ``[B, H, bq, D]``; k, v: ``[B, Hkv, bk, D]``; mask: ``[B|1, 1, 1, bq, bk]`` or ``None``.

    Returns:
        ``(out [B, H, bq, D] fp32 normalised over this block, lse [B, H, bq] fp32)``; rows that see
        no key have ``lse = -inf`` and ``out = 0``.
    """
    b, h, bq, d = q.shape
    hkv = k.shape[1]
    s = _scores(_group(q, hkv), k, scale, mask, h // hkv)  # [B, Hkv, G, bq, bk]
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = s.sub_(m).exp_()  # [B, Hkv, G, bq, bk], in place: one block-sized temporary
    denom = p.sum(-1)  # [B, Hkv, G, bq]
    # [B, Hkv, G*bq, bk] @ [B, Hkv, bk, D] -> [B, Hkv, G*bq, D]
    out = torch.matmul(p.view(b, hkv, -1, k.shape[-2]), _acc(v)).view(b, h, bq, d)
    denom = denom.reshape(b, h, bq)
    out = out / denom.clamp_min(torch.finfo(denom.dtype).tiny)[..., None]
    return out, m.reshape(b, h, bq) + torch.log(denom)


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Merge two partial attentions of the same queries over disjoint key sets (online softmax).

    ``out [..., D]`` normalised, ``lse [...]`` (``-inf`` for rows with no key). Exact:
    ``out = (e^lse_a out_a + e^lse_b out_b) / (e^lse_a + e^lse_b)``.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    wa, wb = torch.exp(lse_a - safe), torch.exp(lse_b - safe)
    return out_a * wa[..., None] + out_b * wb[..., None], lse


def attend_chunk(q, k, v, out, lse, *, q_offset: int, k_offset: int, scale: float,
                 structure: AttnStructure, block: int, counts: BlockCounts | None = None) -> None:  # fmt: skip
    """Attend all queries to one key chunk, merging into ``out``/``lse`` in place.

    Args:
        q: ``[B, H, Sq, D]`` queries at global positions ``q_offset + [0, Sq)``.
        k, v: ``[B, Hkv, Sk, D]`` one key/value chunk at ``k_offset + [0, Sk)``.
        out, lse: ``[B, H, Sq, D]`` / ``[B, H, Sq]`` fp32 running result (``lse = -inf`` initially).
        block: query (and key) block length; ``counts``: where to count blocks and FLOPs.
    """
    b, h, _, d = q.shape
    for qa, qb in spans(0, q.shape[2], block):
        for ka, kb in spans(0, k.shape[2], block):
            g0, g1, h0, h1 = q_offset + qa, q_offset + qb, k_offset + ka, k_offset + kb
            kind = structure.block_kind(g0, g1, h0, h1)
            if counts is not None:
                counts.add(kind, 4 * b * h * (qb - qa) * (kb - ka) * d)
            if kind == "empty":
                continue
            mask = None if kind == "full" else structure.block_mask(g0, g1, h0, h1, q.device)
            o, part_lse = attend_block(q[:, :, qa:qb], k[:, :, ka:kb], v[:, :, ka:kb], scale=scale, mask=mask)
            out[:, :, qa:qb], lse[:, :, qa:qb] = merge_partials(
                out[:, :, qa:qb], lse[:, :, qa:qb], o, part_lse
            )


def attend_chunk_backward(q, k, v, dout, lse, delta, dq, dk, dv, *, q_offset: int, k_offset: int,
                          scale: float, structure: AttnStructure, block: int,
                          counts: BlockCounts | None = None) -> None:  # fmt: skip
    """Gradients of one key chunk's share of the attention, accumulated in place (FlashAttention-2).

    Args:
        q, dout: ``[B, H, Sq, D]``; lse, delta: ``[B, H, Sq]`` fp32 (the *final* LSE of each query
            and ``rowsum(dout * out)``); k, v: ``[B, Hkv, Sk, D]`` the chunk.
        dq: ``[B, H, Sq, D]`` fp32; dk, dv: ``[B, Hkv, Sk, D]`` fp32 (this chunk's), accumulated.
    """
    b, h, _, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    for qa, qb in spans(0, q.shape[2], block):
        bq = qb - qa
        qg = _group(q[:, :, qa:qb], hkv)  # [B, Hkv, G*bq, D]
        dog = _acc(_group(dout[:, :, qa:qb], hkv))  # [B, Hkv, G*bq, D]
        lse_b = lse[:, :, qa:qb].reshape(b, hkv, g, bq, 1)
        delta_b = delta[:, :, qa:qb].reshape(b, hkv, g, bq, 1)
        for ka, kb in spans(0, k.shape[2], block):
            g0, g1, h0, h1 = q_offset + qa, q_offset + qb, k_offset + ka, k_offset + kb
            kind = structure.block_kind(g0, g1, h0, h1)
            if counts is not None:
                counts.add(kind, 10 * b * h * bq * (kb - ka) * d)
            if kind == "empty":
                continue
            mask = None if kind == "full" else structure.block_mask(g0, g1, h0, h1, q.device)
            kc, vc = _acc(k[:, :, ka:kb]), _acc(v[:, :, ka:kb])
            # two block-sized temporaries, updated in place: p, then dp -> ds
            p = _scores(qg, kc, scale, mask, g).sub_(lse_b).exp_()  # [B, Hkv, G, bq, bk]
            p2 = p.view(b, hkv, g * bq, kb - ka)  # [B, Hkv, G*bq, bk]
            dv[:, :, ka:kb] += torch.matmul(p2.transpose(-1, -2), dog)  # sums the G heads
            dp = torch.matmul(dog, vc.transpose(-1, -2)).view_as(p)  # [B, Hkv, G, bq, bk]
            ds = dp.sub_(delta_b).mul_(p).view_as(p2).mul_(scale)  # [B, Hkv, G*bq, bk]
            dq[:, :, qa:qb] += torch.matmul(ds, kc).view(b, h, bq, d)
            dk[:, :, ka:kb] += torch.matmul(ds.transpose(-1, -2), _acc(qg))


def check_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ``ValueError`` naming the shapes unless q/k/v fit ``[B, H, S, D]``/``[B, Hkv, S, D]``."""
    bad = q.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[-1] != q.shape[-1]
    if bad or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"blockwise attention needs q [B, H, S, D] and k, v [B, Hkv, S, D] with Hkv dividing H; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )


def default_scale(head_dim: int) -> float:
    """``1/sqrt(D)``, sdpa's default."""
    return 1.0 / math.sqrt(head_dim)


class _BlockwiseAttention(torch.autograd.Function):
    """Blockwise attention forward (online softmax over key chunks) returning ``(out, lse)``; backward
    recomputes each block from the saved LSE (a gradient of the LSE, when it was used, folds into
    ``delta``: ``dS = P * (dP - (delta - dlse))``). Saves ``q, out, lse`` and K/V (on the device, or
    q, out and K/V on the host)."""

    @staticmethod
    def forward(ctx, q, k, v, structure, scale, chunk, offload, counts):
        b, h, s, d = q.shape
        kv_spans = spans(0, k.shape[2], chunk)
        acc = torch.promote_types(q.dtype, torch.float32)
        out = q.new_zeros((b, h, s, d), dtype=acc)
        lse = q.new_full((b, h, s), float("-inf"), dtype=acc)
        for a, e in kv_spans:  # [B, Hkv, S, D] -> one chunk [B, Hkv, c, D] at a time
            attend_chunk(q, k[:, :, a:e], v[:, :, a:e], out, lse, q_offset=0, k_offset=a, scale=scale,
                         structure=structure, block=chunk, counts=counts)  # fmt: skip
        out, (extra, bare) = out.to(q.dtype), structure.saved()
        ctx.meta = (bare, scale, chunk, offload, counts, len(kv_spans), k.shape, len(extra))
        if offload is None:
            ctx.save_for_backward(q, out, lse, k, v, *extra)
        else:  # q and the output too (whole): nothing of the layer's S-long tensors stays on the device
            host = offload.stash(k, kv_spans) + offload.stash(v, kv_spans)
            q_out = [offload.stash_whole(t) for t in (q, out)]
            offload.settle(q.device)
            # Through save_for_backward, so activation checkpointing drops and recomputes them too.
            ctx.save_for_backward(*q_out, lse, *host, *extra)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        structure, scale, chunk, offload, counts, n, kv_shape, n_extra = ctx.meta
        q, out, lse, *kv = ctx.saved_tensors
        kv, structure = kv[: len(kv) - n_extra], structure.restored(kv[len(kv) - n_extra :])
        if offload is not None:
            q, out = (offload.restore(t, dout.device) for t in (q, out))
        dout = dout.contiguous()
        delta = (_acc(dout) * _acc(out)).sum(-1)  # [B, H, S]
        del out
        if dlse is not None:  # the LSE was used (attention sinks): d lse_i / d s_ij = p_ij
            delta = delta - dlse.to(delta.dtype)
        dq = torch.zeros_like(q, dtype=lse.dtype)
        dk = q.new_empty(kv_shape, dtype=lse.dtype)
        dv = torch.empty_like(dk)
        if offload is None:
            k, v = kv
            chunks = ((k[:, :, a:e], v[:, :, a:e]) for a, e in spans(0, kv_shape[2], chunk))
        else:
            chunks = offload.stream_in(kv[:n], kv[n:], q.device)
        for (a, e), (kc, vc) in zip(spans(0, kv_shape[2], chunk), chunks):
            dk_c, dv_c = dk[:, :, a:e].zero_(), dv[:, :, a:e].zero_()
            attend_chunk_backward(q, kc, vc, dout, lse, delta, dq, dk_c, dv_c, q_offset=0, k_offset=a,
                                  scale=scale, structure=structure, block=chunk, counts=counts)  # fmt: skip
        dtype = q.dtype
        return dq.to(dtype), dk.to(dtype), dv.to(dtype), None, None, None, None, None


def blockwise_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    structure: AttnStructure | None = None,
    scale: float | None = None,
    chunk: int | None = None,
    offload: KVOffload | None = None,
    counts: BlockCounts | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact causal attention of ``q [B, H, S, D]`` over ``k, v [B, Hkv, S, D]`` in blocks.

    Equals ``sdpa(q, repeat_kv(k), repeat_kv(v), attn_mask=<structure's dense mask>)`` without any
    ``S x S`` tensor: peak extra memory is ``O(B H S D)`` accumulators plus one
    ``[B, H, chunk, chunk]`` fp32 score block. Differentiable (custom backward, recompute from LSE).

    Args:
        structure: documents and window (``None``: plain causal).
        scale: score scale (``None``: ``1/sqrt(D)``).
        chunk: tokens per query/key block (``None``: ``resolve_chunk``'s choice; capped at ``S``).
        offload: keep K/V on the host in chunks between forward and backward (Ulysses-Offload).
        counts: count computed/skipped blocks and FLOPs here.
        return_lse: also return the differentiable ``[B, H, S]`` fp32 log-sum-exp (attention sinks).

    Returns:
        ``[B, H, S, D]`` in ``q``'s dtype (and the LSE with ``return_lse``).
    """
    check_gqa(q, k, v)
    if k.shape[2] != q.shape[2]:
        raise ValueError(
            f"blockwise attention needs as many keys as queries: q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    structure = structure or AttnStructure()
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    block = resolve_chunk(chunk, q.shape[2], q.shape[-1])
    out, lse = _BlockwiseAttention.apply(q, k, v, structure, scale, block, offload, counts)
    return (out, lse) if return_lse else out
