"""The attention of DeepSeek-V4's compressed layers under sequence parallelism: local queries, one softmax
over their sliding window, their pooled entries and the sinks.

A V4 layer with a compressor calls the attention function with ``q [B, H, S_l, D]``, ``k = v =
[B, 1, S_l + T, D]``: its own keys (one shared K=V head) followed by the ``T = S//r`` pooled entries of
the whole sequence (``attention/pooled_kv.py`` made them the no-SP model's and left the ``PooledCall`` as
the ``pooled`` keyword). Without SP the model's eager function puts into one softmax per query ``t``:
the keys ``t - W < j <= t`` (``W`` the sliding window), the entries it may see (HCA: ``w < (t+1)//r``;
CSA: the ``index_topk`` its indexer picked, ``-1`` none) and one sink logit per head. That is what runs
here, without an all-to-all: the queries stay on their rank (all ``H`` heads), the keys of the window
before the shard come from the previous ranks (``W - 1`` tokens, ``parallel/seq_gather.tokens_before``),
the entries are already whole. Packed rows: a query sees only its document's keys (from
``doc_first``) and entries (HCA from ``entry_first``; CSA's picks are its document's). Per block of ``bq`` local queries the scores are
``[B, H, bq, bq + W - 1 + E]`` (``E``: ``T`` for HCA, ``k`` for CSA, whose picked entries are gathered
``[B, bq, k, D]``), fp32; each block is recomputed in backward (activation checkpointing), so no block's
scores outlive it and nothing of size ``S x S`` (or ``S_l x T`` beyond one block) exists.

Cost per rank and layer: the window halo ``[B, W-1, D]`` (one all-gather of every rank's last ``W-1``
keys; an all-reduce in backward), no q/k/v exchange; FLOPs ``4 B H S_l (bq + W + E) D`` forward (the
model: ``4 B H S (S + T) D`` with its dense eager mask).

Shape legend: ``B`` batch, ``H`` query heads, ``S_l`` local queries, ``W`` sliding window, ``T`` pooled
entries, ``k`` picks per query, ``D`` head dim, ``bq`` queries per block.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from ulysses_sp.parallel.seq_gather import tokens_before

SCORE_BYTES = 128 << 20
"""Bytes one query block's fp32 temporaries may hold: its scores ``[B, H, bq, bq + W - 1 + E]`` and (CSA)
its picked entries ``[B, bq, k, D]`` (keys and values)."""


def _block(q, kw, vw, ent_k, ent_v, sel, sinks, q0: int, window: int, scale: float, kfirst=None, efirst=None):
    """One query block, ``q [B, H, bq, D]`` -> ``[B, H, bq, D]`` in ``q``'s dtype: its window keys ``kw, vw
    [B, 1, bk, D]`` (query ``i`` is key ``q0 + i``; it sees the keys ``q0 + i - W < j <= q0 + i``, packed:
    ``j >= kfirst [B|1, bq]``, its document's first key), the entries ``ent_k, ent_v [B, 1, T, D]`` it may
    see — HCA: ``sel [B|1, bq]`` = ``(p+1)//r``, entries ``efirst <= w < efirst + sel`` (``efirst [B|1, bq]``
    its document's first entry, 0 unpacked); CSA: ``sel [B, bq, k]`` the picks (``-1`` none) — and the sinks
    ``[H]``, in one softmax. Everything of the block's size is made here, so recomputing it in backward saves
    none of it."""
    dtype, acc = q.dtype, torch.promote_types(q.dtype, torch.float32)
    bq, dev = q.shape[2], q.device
    qi = torch.arange(q0, q0 + bq, device=dev)[:, None]
    ki = torch.arange(kw.shape[2], device=dev)[None, :]
    allowed = (ki <= qi) & (qi - ki < window)  # [bq, bk]
    allowed = allowed if kfirst is None else allowed & (ki >= kfirst[..., None])  # [B|1, bq, bk]: its document
    allowed = allowed if allowed.dim() == 3 else allowed[None]
    q, kw, vw = (t.to(acc) for t in (q, kw, vw))
    s_win = torch.matmul(q, kw.transpose(-1, -2)).mul_(scale).masked_fill_(~allowed[:, None], float("-inf"))  # [B, H, bq, bk]
    if sel.dim() == 3:  # CSA: the picked entries, [B, T, D][rows, picks] -> [B, bq, k, D]
        rows = torch.arange(sel.shape[0], device=dev)[:, None, None]
        ek, ev = (e[:, 0][rows, sel.clamp_min(0)].to(acc) for e in (ent_k, ent_v))
        s_ent = torch.einsum("bhqd,bqkd->bhqk", q, ek)  # [B, H, bq, k]
        seen = sel >= 0  # [B, bq, k]
    else:  # HCA: every entry, [B, H, bq, D] x [B, 1, T, D] -> [B, H, bq, T]
        ek, ev = ent_k.to(acc), ent_v.to(acc)
        s_ent = torch.matmul(q, ek.transpose(-1, -2))
        ent = torch.arange(ent_k.shape[2], device=dev)
        seen = ent < sel[..., None] if efirst is None else (ent >= efirst[..., None]) & (ent < (sel + efirst)[..., None])
    s_ent = s_ent.mul_(scale).masked_fill_(~seen[:, None], float("-inf"))
    sink = sinks.to(acc).view(1, -1, 1, 1).expand(*s_win.shape[:3], 1)  # [B, H, bq, 1]
    probs = torch.softmax(torch.cat([s_win, s_ent, sink], dim=-1), dim=-1)  # one softmax per query
    p_win, p_ent = probs[..., : s_win.shape[-1]], probs[..., s_win.shape[-1] : -1]
    out = torch.matmul(p_win, vw)  # [B, H, bq, D]
    out = out + (torch.einsum("bhqk,bqkd->bhqd", p_ent, ev) if sel.dim() == 3 else torch.matmul(p_ent, ev))
    return out.to(dtype)


def _rows_before(x: torch.Tensor, lo: int, window: int, group: Any) -> torch.Tensor:
    """``[B, 1, S_l, D] -> [B, 1, n + S_l, D]``: the ``n = min(lo, W - 1)`` keys before the shard prepended."""
    halo = tokens_before(x.transpose(1, 2), lo - min(lo, window - 1), window - 1, group)  # [B, n, 1, D]
    return torch.cat([halo.transpose(1, 2), x], dim=2)


def pooled_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """The attention of one pooled (V4 CSA/HCA) layer call: ``q [B, H, S_l, D]``, ``k, v [B, 1, S_l + T, D]``
    -> ``[B, S_l, H, D]``, equal to the model's eager attention over the full sequence at these queries."""
    call, scale, (b, h, s_l, _) = kwargs["pooled"], kwargs.get("scaling") or query.shape[-1] ** -0.5, query.shape
    if kwargs.get("dropout"):
        raise ValueError(f"attention dropout ({kwargs['dropout']}) in a pooled (DeepSeek-V4) layer is not supported "
                         "under sequence parallelism: set the model's attention_dropout to 0")  # fmt: skip
    window = kwargs.get("sliding_window") or s_l + call.lo  # no window: every earlier key
    sinks = kwargs.get("s_aux")
    sinks = sinks if sinks is not None else query.new_full((h,), float("-inf"))  # no sinks: e^-inf = 0
    if key.shape[1] != 1:
        raise ValueError(f"pooled attention expects one shared K/V head, got keys {tuple(key.shape)}")
    ent_k, ent_v = key[:, :, s_l:], value[:, :, s_l:]  # [B, 1, T, D]: the whole sequence's entries
    k_win = _rows_before(key[:, :, :s_l], call.lo, window, call.group)  # [B, 1, n + S_l, D]
    v_win = k_win if value is key else _rows_before(value[:, :, :s_l], call.lo, window, call.group)
    n = k_win.shape[2] - s_l
    picks = call.picks  # CSA [B, S_l, k]; HCA: None, query at position p sees entries w < (p + 1) // r
    sel = (call.positions + 1) // call.rate if picks is None else picks  # [B|1, S_l] / [B, S_l, k]
    per_query = 4 * b * (h * (2 * window + (ent_k.shape[2] if picks is None else picks.shape[-1]))
                         + (0 if picks is None else 2 * picks.shape[-1] * query.shape[-1]))  # fmt: skip
    block = max(1, min(s_l, SCORE_BYTES // per_query))
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, sinks))
    outs = []
    for a in range(0, s_l, block):  # queries [a, e): window keys from global lo + a - W + 1 (k_win index k0)
        e = min(a + block, s_l)
        k0 = max(0, a - window + 1 + n)
        kfirst = None if call.doc_first is None else call.doc_first[:, a:e] - (call.lo - n + k0)  # in k_win[k0:]
        efirst = None if call.entry_first is None or picks is not None else call.entry_first[:, a:e]
        args = (query[:, :, a:e], k_win[:, :, k0 : e + n], v_win[:, :, k0 : e + n], ent_k, ent_v, sel[:, a:e], sinks,
                a + n - k0, window, float(scale), kfirst, efirst)  # fmt: skip
        outs.append(checkpoint(_block, *args, use_reentrant=False) if grad else _block(*args))
    return torch.cat(outs, dim=2).transpose(1, 2)  # [B, H, S_l, D] -> [B, S_l, H, D]
