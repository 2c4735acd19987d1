"""DeepSeek Sparse Attention's indexer, exact under sequence parallelism: each query's top-k over the
whole sequence.

DSA layers (DeepSeek-V3.2, GLM-5 ``glm_moe_dsa``, Hunyuan-V4, A.X-K2, dots3-note) run an *indexer*
before their attention: under ``no_grad`` it projects each token to index queries (``H_idx`` heads) and
**one** index key ``k = k_norm(wk(h))`` (rotary on part of it), scores
``sum_h w_h relu(q_h . k_t)`` for every earlier token ``t`` and keeps each query's top ``index_topk``
keys as ``[B, S, topk]`` int32 indices, which the attention module hands the attention function as
``indices=``. On a sequence shard the indexer would see only the shard's keys (and transformers gives
the SP attention no mask at all). Here each indexer module — claimed by its shape (``wq_b``, ``wk``,
``k_norm``, ``weights_proj``, ``index_topk`` and a ``forward(hidden_states, q_resid,
position_embeddings, attention_mask, ..., cache)``), not by its name — is wrapped so that it

1. runs the model's own ``forward`` on the local tokens until its index keys ``[B, S_l, D_idx]``
   exist (a stand-in ``cache`` receives them: every family's own projections, norm and rotary run
   unchanged), and all-gathers them over the SP group: ``[B, S, D_idx]``, no gradient;
2. runs the model's own ``forward`` again on blocks of local queries, its ``cache`` now returning the
   whole sequence's keys and its mask the **global** one (causal from global token indices, within
   the token's packed document): the model's own scores, dtypes and ``topk = min(index_topk, S)``,
   so the keys picked are the ones the model picks without SP (``[B, S_l, topk]``, global indices).

Layers that reuse an earlier layer's top-k (GLM-5's ``prev_topk_indices``) receive these global
indices. The attention then restricts each query to its picked keys (``attention/indexed.py``).

Cost per rank and layer (``S`` tokens, ``P`` ranks): the gathered index keys ``B*S*D_idx`` (bf16, 1M
tokens, ``D_idx`` 128: 256 MiB), the scores of one query block ``[B, bq, H_idx, S]`` fp32 (the block is
sized to ``INDEX_SCORE_BYTES``), the local indices ``[B, S/P, topk]`` int32. The indexer's FLOPs
``2 B (S/P) S H_idx D_idx`` shrink with ``P`` (without SP the model scores ``[B, S, H_idx, S]`` at once).

Shape legend: ``B`` batch, ``S`` full sequence, ``S_l = S/P``, ``D_idx`` index head dim, ``bq`` queries
per block.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ulysses_sp.parallel.comm import all_gather_seq

INDEX_SCORE_BYTES = 256 << 20
"""Bytes of fp32 index scores one query block may hold (``[B, bq, H_idx + 1, S]``)."""
INDEXER_ATTRS = ("wq_b", "wk", "k_norm", "weights_proj", "index_topk", "layer_idx")
INDEXER_ARGS = ("hidden_states", "q_resid", "position_embeddings", "attention_mask", "cache")


def is_indexer(module: nn.Module) -> bool:
    """Whether ``module`` is a DSA indexer this module runs exactly under SP (by its shape, not its name)."""
    if not all(hasattr(module, a) for a in INDEXER_ATTRS):
        return False
    params = inspect.signature(type(module).forward).parameters
    return all(a in params for a in INDEXER_ARGS)


class _KeysCaptured(Exception):
    """Raised by ``_CaptureKeys`` to stop the indexer's first run once its keys exist."""


class _CaptureKeys:
    """The ``cache`` of the indexer's first run: records its index keys ``[B, S_l, D_idx]`` and stops it.
    A real cache given to the layer (``use_cache=True`` in a training forward) is fed too and must hold
    no earlier tokens."""

    def __init__(self, real: Any) -> None:
        self.real, self.keys = real, None

    def update_indexer(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        self.keys = keys
        if self.real is not None and self.real.update_indexer(keys, layer_idx).shape[1] != keys.shape[1]:
            raise ValueError(
                "a DSA indexer was called with a cache holding earlier tokens (generation); sequence-parallel "
                "indexed attention runs whole sequences only: pass use_cache=False"
            )
        raise _KeysCaptured


class _AllKeys:
    """The ``cache`` of the indexer's scoring runs: hands back the whole sequence's index keys."""

    def __init__(self, keys: torch.Tensor) -> None:
        self.keys = keys

    def update_indexer(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        return self.keys


def documents(seq: Any, batch: int) -> list[tuple[slice, list[tuple[int, int]]]]:
    """``[(rows, [(start, end), ...]), ...]``: the documents of each group of rows sharing one layout, as
    host ints (the adapter's layout; without it, read from ``doc_ids`` like the blockwise core's fallback)."""
    if seq.doc_ids is None:
        return [(slice(None), [(0, seq.seq_len)])]
    if seq.host is not None:
        starts = seq.host.doc_starts()
    else:  # [B|1, S]: a new document where the id changes
        starts = [[0, *((r[1:] != r[:-1]).nonzero().flatten() + 1).tolist()] for r in seq.doc_ids.cpu()]
    spans = [list(zip(row, [*row[1:], seq.seq_len])) for row in starts]
    return [(slice(None), spans[0])] if len(spans) == 1 else [(slice(r, r + 1), spans[r]) for r in range(batch)]


def query_block(batch: int, heads: int, keys: int, queries: int) -> int:
    """Queries per scoring block: ``INDEX_SCORE_BYTES`` of fp32 ``[B, bq, H_idx + 1, keys]``, at least 1."""
    return max(1, min(queries, INDEX_SCORE_BYTES // (4 * batch * (heads + 1) * keys)))


def call_layout(attention: Any, module: nn.Module, position_ids: torch.Tensor | None, s_local: int, batch: int,
                device: torch.device) -> tuple[Any, int, Any]:  # fmt: skip
    """``(SeqLayout, first token, sp_group or None)`` of one indexer call: the SP attention's per-forward
    layout (the one its core uses next), this rank's first global token, and the group the keys are
    gathered over (``None`` where the SP attention runs without SP: sp 1, ``disable_in_eval``)."""
    sp = attention.sp_size > 1 and not (attention.disable_in_eval and not module.training)
    seq = attention._seq_layout(position_ids, s_local, batch, device, sp)
    return (seq, dist.get_rank(attention.sp_group) * s_local, attention.sp_group) if sp else (seq, 0, None)


def sp_indexer_forward(forward: Callable[..., torch.Tensor], module: nn.Module, attention: Any) -> Callable[..., torch.Tensor]:
    """``module``'s indexer ``forward`` computing its local queries' top-k over the whole sequence, with the
    layout of ``attention`` (the registered ``UlyssesSPAttentionHF``): ``[B, S_l, topk]`` global indices,
    ``-1`` past a short document's ``min(index_topk, document length)`` picks."""

    @torch.no_grad()
    def indexed(hidden_states, q_resid, position_embeddings, attention_mask=None, position_ids=None, cache=None,
                **kwargs):  # fmt: skip
        cache = kwargs.pop("past_key_values", cache)
        (b, s_local), device = hidden_states.shape[:2], hidden_states.device
        seq, lo, group = call_layout(attention, module, position_ids, s_local, b, device)
        capture = _CaptureKeys(cache)
        try:  # the model's own q/k projections, norm and rotary on the local tokens, stopped at its keys
            forward(hidden_states, q_resid, position_embeddings, attention_mask, position_ids, cache=capture)
        except _KeysCaptured:
            pass
        if capture.keys is None:
            raise ValueError(f"{type(module).__name__} never passed its index keys to its cache; its indexer is "
                             "not the DSA indexer this version shards: train it with sp_size 1")  # fmt: skip
        # [B, S_l, D_idx] -> [B, S, D_idx] (no gradient: the indexer runs under no_grad)
        keys = capture.keys if group is None else all_gather_seq(capture.keys, group, dim=1)
        out = torch.full((b, s_local, min(module.index_topk, seq.seq_len)), -1, dtype=torch.int32, device=device)
        for rows, docs in documents(seq, b):
            for start, end in docs:  # each document as if alone: its keys, its causal mask, min(topk, its length)
                q0, q1 = max(start, lo), min(end, lo + s_local)
                block = query_block(b, getattr(module, "n_heads", 1), end - start, q1 - q0)
                for a in range(q0, q1, block):  # [B, bq, L] scores at a time -> [B, bq, min(topk, L)]
                    e = min(a + block, q1)
                    here = slice(a - lo, e - lo)
                    keep = torch.arange(end - start, device=device)[None, :] <= torch.arange(
                        a - start, e - start, device=device)[:, None]  # [bq, L] causal within the document
                    pe = tuple(t[rows, here] if t.shape[0] > 1 else t[:, here] for t in position_embeddings)
                    h = hidden_states[rows, here]
                    picks = forward(h, q_resid[rows, here], pe, keep[None].expand(h.shape[0], -1, -1), None,
                                    cache=_AllKeys(keys[rows, start:end]))  # fmt: skip
                    out[rows, here, : picks.shape[-1]] = picks + start
        return out  # [B, S_l, topk]

    return indexed


class IndexerHandle:
    """The DSA indexers of one model, wrapped (``install_indexers``); ``remove()`` restores them."""

    def __init__(self) -> None:
        self.wrapped: list[nn.Module] = []
        self.hooks: list[Any] = []

    def remove(self) -> None:
        for module in self.wrapped:
            module.__dict__.pop("forward", None)
        for hook in self.hooks:
            hook.remove()
        self.wrapped, self.hooks = [], []


def _stand_in_mask(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
    """The attention module slices ``attention_mask[:, 0]`` for its indexer, but transformers builds no mask
    for the SP attention: a broadcast all-True ``[B, 1, S_l, S_l]`` (no memory), which neither the wrapped
    indexer nor the SP attention reads."""
    if kwargs.get("attention_mask", 0) is not None or "hidden_states" not in kwargs:
        return None
    b, s = kwargs["hidden_states"].shape[:2]
    kwargs["attention_mask"] = torch.ones((), dtype=torch.bool, device=kwargs["hidden_states"].device).expand(b, 1, s, s)
    return args, kwargs


def install_indexers(model: nn.Module, attention: Any) -> IndexerHandle | None:
    """Wrap every DSA indexer of ``model`` (``sp_indexer_forward``) and give its attention module a
    stand-in mask; ``None`` when the model has none."""
    handle = IndexerHandle()
    for name, module in model.named_modules():
        if is_indexer(module):
            module.forward = sp_indexer_forward(module.forward, module, attention)
            handle.wrapped.append(module)
            parent = model.get_submodule(name.rpartition(".")[0])  # the attention module that calls it
            handle.hooks.append(parent.register_forward_pre_hook(_stand_in_mask, with_kwargs=True))
    return handle if handle.wrapped else None
