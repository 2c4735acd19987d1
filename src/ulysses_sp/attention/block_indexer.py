"""Qwen4-Exp's block top-k indexer (QSA), exact under sequence parallelism: each query's key blocks picked
over the whole sequence, the attention restricted to them in the blockwise core.

A QSA layer's indexer projects each token to index queries (``H_idx`` heads, q-norm, rotary) and one raw
index key. For a query at offset ``i`` of its document it cuts the visible keys ``0..i`` into blocks of
``r = compress_ratio`` tokens **from the document's first token**; each complete block (``n = (i+1)//r``
of them) is pooled: ``k_norm(mean of its raw keys)`` with the rotary of its first token. The query keeps
its ``block_topk`` best blocks by ``sum_h relu(q_h . k_block) / sqrt(D_idx)`` plus the incomplete tail
``n*r..i``, and the model folds that into a dense ``[B, 1, S, S]`` mask (a Python loop over every query,
reading the device per query). Here each indexer — claimed by its shape (``index_qk_proj``,
``q_layernorm``, ``k_layernorm``, ``compress_ratio``, ``block_topk``, ``token_budget``), not its name — is
replaced, and a pre-hook on its attention module

1. projects the local tokens' index queries and raw keys with the module's own layers and the model's
   own rotary function, and all-gathers the raw keys and the rotary cos/sin over the SP group
   (``[B, S, D_idx]``, ``[B, S, rot]``: blocks straddling a shard edge pool the same tokens as without SP);
2. per document (global positions: blocks start at the document's first token, as for it alone) pools
   its complete blocks once, and scores the local queries group by group of equal ``n``: one
   ``topk(block_topk)`` over exactly the ``n`` blocks the model scores (so ties — blocks whose heads all
   score ``<= 0`` — break as in the model's own call on CPU); ``n <= block_topk`` keeps every visible key;
3. hands the attention function the picks as ``indices [B, S_l, token_budget + r - 1]`` (global token
   indices, ``-1`` unused) and a ``[1, 1, 1, 1]`` all-True stand-in for the mask, which the module ANDs
   with the indexer's (equally tiny) answer. The SP attention gathers the picks and attends to them in
   the blockwise core (``attention/indexed.py``): no ``S x S`` tensor, no host read of a device value.

Cost per rank and layer: the gathered raw keys and cos/sin ``B*S*(D_idx + 2 rot)`` (no gradient: the
model's selection is a boolean mask, its indexer gets no gradient with or without SP), one document's
pooled keys ``[B, S/r, D_idx]``, the scores of ``r`` queries at a time ``[B, r, n, H_idx]`` fp32, and
about ``S/(P r)`` small ``topk`` calls (the model: ``S`` calls, each after a device read). The picks
``[B, S, budget + r - 1]`` int32 are gathered by the SP attention as DSA's are. On CUDA the tie order of
``topk`` over equal scores is the kernel's; on CPU it is the model's.

Shape legend: ``B`` batch, ``S`` full sequence, ``S_l = S/P``, ``D_idx`` index head dim, ``H_idx`` index
heads, ``r`` block length, ``n`` complete blocks before a query, ``k`` ``block_topk``.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch import nn

from ulysses_sp.attention.indexer import IndexerHandle, call_layout, documents
from ulysses_sp.parallel.comm import all_gather_seq

BLOCK_INDEXER_ATTRS = ("index_qk_proj", "q_layernorm", "k_layernorm", "compress_ratio", "block_topk",
                       "token_budget", "index_n_heads", "index_head_dim", "layer_idx")  # fmt: skip
BLOCK_INDEXER_ARGS = ("hidden_states", "position_embeddings", "attention_mask", "cache")


def is_block_indexer(module: nn.Module) -> bool:
    """Whether ``module`` is a block top-k (QSA) indexer this module runs exactly under SP (by its shape)."""
    if not all(hasattr(module, a) for a in BLOCK_INDEXER_ATTRS):
        return False
    params = inspect.signature(type(module).forward).parameters
    return all(a in params for a in BLOCK_INDEXER_ARGS)


def _rotary(module: nn.Module) -> Any:
    """The model's own ``apply_rotary_pos_emb`` (partial rotary: the first ``cos.shape[-1]`` dims)."""
    rope = getattr(inspect.getmodule(type(module)), "apply_rotary_pos_emb", None)
    if rope is None:
        raise ValueError(f"{type(module).__name__}'s modeling module has no apply_rotary_pos_emb; its block "
                         "indexer is not the QSA indexer this version shards: train it with sp_size 1")  # fmt: skip
    return rope


def index_queries_and_keys(module: nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The indexer's own projections (as its ``forward``): queries ``[B, S_l, H_idx, D_idx]`` (normed,
    rotary) and raw keys ``[B, S_l, D_idx]``."""
    b, s, d = *hidden.shape[:2], module.index_head_dim
    if getattr(module, "index_kv_heads", 1) != 1:
        raise ValueError(f"{type(module).__name__}: index_kv_heads {module.index_kv_heads}; the QSA indexer "
                         "scores one index key per token (index_kv_heads 1)")  # fmt: skip
    q, k = torch.split(module.index_qk_proj(hidden), [module.index_n_heads * d, d], dim=-1)
    q = module.q_layernorm(q.reshape(b, s, -1, d))
    return _rotary(module)(q, cos=cos, sin=sin, unsqueeze_dim=2), k.reshape(b, s, d)


def pooled_keys(module: nn.Module, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n: int) -> torch.Tensor:
    """``[B', L, D_idx] -> [B', n, D_idx]``: a document's first ``n`` complete blocks, each the mean of its
    ``r`` raw keys (fp32, back to the keys' dtype), normed, with the rotary of its first token."""
    r = module.compress_ratio
    pooled = keys[:, : n * r].unflatten(1, (n, r)).float().mean(dim=2).to(keys.dtype)  # [B', n, r, D] -> [B', n, D]
    pooled = module.k_layernorm(pooled)
    starts = slice(0, n * r, r)  # each block's first token
    return _rotary(module)(pooled.unsqueeze(2), cos=cos[:, starts], sin=sin[:, starts], unsqueeze_dim=2).squeeze(2)


def block_picks(module: nn.Module, q: torch.Tensor, blocks: torch.Tensor, n: int, offsets: torch.Tensor) -> torch.Tensor:
    """Token picks ``[B', nq, k*r + r - 1]`` (document offsets, ``-1`` unused) of queries ``q [B', nq, H, D]``
    at document ``offsets [nq]`` that all see ``n > k`` complete blocks ``blocks [B', >=n, D]``: the top
    ``k`` blocks by the model's score, then the tail ``n*r..i``."""
    r, k = module.compress_ratio, module.block_topk
    # [B', nq, H, D] @ [B', 1, D, n] -> [B', nq, H, n] -> [B', nq, n, H] -> [B', nq, n]
    scores = torch.matmul(q.float(), blocks[:, None, :n].float().transpose(-1, -2)).transpose(-1, -2)
    scores = torch.relu(scores).sum(dim=-1) / math.sqrt(module.index_head_dim)
    top = scores.topk(k, dim=-1).indices  # [B', nq, k]
    tokens = (top[..., None] * r + torch.arange(r, device=q.device)).flatten(-2)  # [B', nq, k*r]
    tail = n * r + torch.arange(r - 1, device=q.device)  # [r-1]: visible where <= the query's offset
    tail = torch.where(tail[None] <= offsets[:, None], tail[None], -1).expand(*tokens.shape[:2], -1)
    return torch.cat([tokens, tail], dim=-1)


def qsa_picks(module: nn.Module, attention: Any, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              position_ids: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The picks of this rank's queries over the whole sequence, ``[B, S_l, token_budget + r - 1]`` int32
    global token indices (``-1`` unused): the keys the model's indexer keeps without SP."""
    (b, s_local), device = hidden.shape[:2], hidden.device
    seq, lo, group = call_layout(attention, module, position_ids, s_local, b, device)
    q, keys = index_queries_and_keys(module, hidden, cos, sin)
    if group is not None:  # [B, S_l, D_idx] -> [B, S, D_idx]; cos/sin [B|1, S_l, rot] -> [B|1, S, rot]
        keys, cos, sin = (all_gather_seq(t.contiguous(), group, dim=1) for t in (keys, cos, sin))
    r, k = module.compress_ratio, module.block_topk
    width = module.token_budget + r - 1
    out = torch.full((b, s_local, width), -1, dtype=torch.int32, device=device)
    for rows, docs in documents(seq, b):
        for start, end in docs:  # each document as if alone: blocks from its first token
            q0, q1 = max(start, lo), min(end, lo + s_local)
            if q0 >= q1:
                continue
            full = min(q1, start + (k + 1) * r - 1)  # offsets < (k+1)r - 1 see <= k blocks: every visible key
            if q0 < full:
                cols = torch.arange(start, start + width, device=device)
                causal = cols[None] <= torch.arange(q0, full, device=device)[:, None]  # [bq, width]
                out[rows, q0 - lo : full - lo] = torch.where(causal, cols[None], -1).to(torch.int32)
            first = max(q0, full)
            if first >= q1:
                continue
            n_hi = (q1 - start) // r  # the last local query's complete blocks
            rows_c, rows_s = (cos, sin) if cos.shape[0] == 1 else (cos[rows], sin[rows])
            blocks = pooled_keys(module, keys[rows, start:end], rows_c[:, start:end], rows_s[:, start:end], n_hi)
            for n in range((first - start + 1) // r, n_hi + 1):  # queries seeing n complete blocks
                a, e = max(first, start + n * r - 1), min(q1, start + n * r + r - 1)
                if a >= e:
                    continue
                offsets = torch.arange(a - start, e - start, device=device)
                picks = block_picks(module, q[rows, a - lo : e - lo], blocks, n, offsets)
                out[rows, a - lo : e - lo, : picks.shape[-1]] = torch.where(picks >= 0, picks + start, -1).to(torch.int32)
    return out


def _tiny_true(device: torch.device) -> torch.Tensor:
    """A ``[1, 1, 1, 1]`` all-True mask: ANDed with another, it stays one element."""
    return torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)


def _qsa_pre_hook(indexer: nn.Module, attention: Any):
    """The attention module's pre-hook: the picks as ``indices``, a stand-in for the mask."""

    @torch.no_grad()
    def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        hidden = args[0] if args else kwargs["hidden_states"]
        cos, sin = args[1] if len(args) > 1 else kwargs["position_embeddings"]
        if kwargs.get("cache", kwargs.get("past_key_values")) is not None:
            raise ValueError(f"{type(module).__name__} was called with a cache; sequence-parallel QSA attention "
                             "runs whole sequences only: pass use_cache=False")  # fmt: skip
        kwargs["indices"] = qsa_picks(indexer, attention, hidden, cos, sin, kwargs.get("position_ids"))
        args = args[:2] if len(args) > 2 else args  # the mask goes by keyword
        kwargs["attention_mask"] = _tiny_true(hidden.device)
        return args, kwargs

    return hook


def install_block_indexers(model: nn.Module, attention: Any, handle: IndexerHandle | None = None) -> IndexerHandle | None:
    """Replace every QSA indexer of ``model`` by a stand-in returning the tiny all-True mask and give its
    attention module the picks (``_qsa_pre_hook``); adds to ``handle``; ``None`` when the model has none."""
    handle = handle if handle is not None else IndexerHandle()
    for name, module in model.named_modules():
        if is_block_indexer(module):
            module.forward = lambda hidden_states, *a, **k: _tiny_true(hidden_states.device)
            handle.wrapped.append(module)
            parent = model.get_submodule(name.rpartition(".")[0])  # the attention module that calls it
            handle.hooks.append(parent.register_forward_pre_hook(_qsa_pre_hook(module, attention), with_kwargs=True))
    return handle if handle.wrapped else None
