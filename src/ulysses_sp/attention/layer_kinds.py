"""Which kinds of attention layer the Ulysses attention makes exact, and the refusal for the others.

A model's ``config.layer_types`` names each layer's attention. The SP attention runs the model's
own softmax attention over the full sequence after the all-to-all, so it is exact for kinds whose
keys are the layer's own full-sequence keys: full, sliding-window and chunked attention (with
per-head sinks). **Sparse and compressed attention** pick or build their keys from the sequence
*before* the attention function is called: an indexer scores every earlier token and keeps each
query's top-k (``indexed_attention``), or a compressor pools K/V along the sequence (DeepSeek-V4
``compressed_sparse_attention`` / ``heavily_compressed_attention``). On a sequence shard those see only
the rank's own tokens: where no handler below runs them, refused before the first step
(``check_layer_kinds``, called by ``register_with_transformers``), naming the layer and why.

DeepSeek-V4's pooled kinds (``POOLED_KINDS``) run exactly: the model's compressor on ``[halo | local]``
tokens, the entries gathered, CSA's indexer over all of them (``attention/pooled_kv.py``), each rank's
queries over their window and the entries (``attention/pooled_core.py``); without a ring. Packed rows too:
windows restart at each document, whose queries see its own entries only (``attention/pooled_docs.py``).

Except DeepSeek Sparse Attention's ``indexed_attention`` (``dsa_indexed``: a config with ``index_topk``,
``index_n_heads`` and ``index_head_dim`` — DeepSeek-V3.2, GLM-5, Hunyuan-V4, A.X-K2, dots3-note): its
indexer scores each query against the whole sequence's index keys (``attention/indexer.py``) and the
blockwise core attends to the picked keys (``attention/indexed.py``), on cores ``sdpa``/``eager`` without
a ring (``check_indexed_options``). Qwen4-Exp's block top-k indexer (QSA: ``indexer_budget``,
``indexer_compress_ratio``; ``attention/block_indexer.py``) likewise: its key blocks picked over the whole
sequence, the attention over the picks in the same blockwise core.

Judged from the config's layer types and the numbers that make the structure matter, not from the
model's name.
"""

from __future__ import annotations

from typing import Any

REASONS = {
    "indexed_attention": (
        "an indexer scores every earlier token and keeps each query's top {index_topk} keys before the "
        "attention runs; on a sequence shard the indexer sees only the rank's own tokens (and builds its "
        "mask for them), so the keys it picks are not the ones the model picks without sequence parallelism"
    ),
}
"""Attention layer kinds that mix tokens before the attention function, and why SP does not shard them."""


POOLED_KINDS = ("compressed_sparse_attention", "heavily_compressed_attention")
"""DeepSeek-V4's kinds that pool K/V along the sequence (``attention/pooled_kv.py``): exact under SP, packed
rows included (each document pooled and attended as if alone, ``attention/pooled_docs.py``)."""


def packed_refusal(config: Any, kind: str) -> str | None:
    """Why layers of ``kind`` cannot keep packed documents apart (at any sp size), or ``None``."""
    return "attention picks its keys from the whole row" if refused_kind(config, kind) else None


DSA_CONFIG = ("index_topk", "index_n_heads", "index_head_dim")
"""Config fields of DeepSeek Sparse Attention's per-token top-k indexer."""


QSA_CONFIG = ("indexer_budget", "indexer_compress_ratio", "indexer_n_heads", "indexer_head_dim")
"""Config fields of Qwen4-Exp's block top-k (QSA) indexer."""


def dsa_indexed(config: Any) -> bool:
    """Whether ``config``'s ``indexed_attention`` layers are DSA's or QSA's, which sequence parallelism makes
    exact."""
    return any(all(hasattr(config, name) for name in fields) for fields in (DSA_CONFIG, QSA_CONFIG))


def _picked(config: Any) -> str:
    """What each query keeps, for messages: DSA's top-k keys or QSA's token budget."""
    topk = getattr(config, "index_topk", None)
    return f"top {topk} keys" if topk is not None else f"best key blocks ({config.indexer_budget} tokens)"


def refused_kind(config: Any, kind: str) -> bool:
    """Whether layers of ``kind`` in ``config``'s model are refused under sequence parallelism."""
    return kind in REASONS and not (kind == "indexed_attention" and dsa_indexed(config))


def check_indexed_options(config: Any, core: str, ring_size: int) -> None:
    """Raise ``ValueError`` when DSA layers meet a core or a ring the picked keys do not run on, or
    DeepSeek-V4's pooled layers a ring (their local queries need the sequence's contiguous shards)."""
    types = getattr(config, "layer_types", None) or ()
    pooled = sorted(set(types) & set(POOLED_KINDS))
    if pooled and ring_size > 1:
        raise ValueError(
            f"{type(config).__name__}'s {pooled} layers attend each rank's own queries to a window of keys before "
            f"its shard (attention/pooled_core.py), which needs contiguous shards; got ring_size {ring_size} "
            "(zigzag shards). Use ring_size 1 (Ulysses alone)"
        )
    if "indexed_attention" in types and dsa_indexed(config) and (core not in ("sdpa", "eager") or ring_size > 1):
        raise ValueError(
            f"{type(config).__name__}'s 'indexed_attention' layers attend to each query's "
            f"{_picked(config)}, which run in the blockwise core for cores 'sdpa'/'eager' without a "
            f"ring; got core {core!r}, ring_size {ring_size}. Use core 'sdpa' and ring_size 1 (the heads must "
            "split over the sp size)"
        )


def plain_attention_layers(config: Any) -> bool:
    """Whether every attention layer of ``config`` is one the SP attention runs exactly (no sparse or
    compressed kind): then ``train`` routes sp 1 through it too (no ``[S, S]`` mask, documents kept
    apart by their positions, the same path as sp > 1)."""
    return not any(refused_kind(config, kind) for kind in getattr(config, "layer_types", None) or ())


def check_layer_kinds(config: Any, sp_size: int) -> None:
    """Raise ``ValueError`` naming the first layer whose attention kind sequence parallelism cannot
    make exact (``REASONS``), when ``sp_size > 1``."""
    types = getattr(config, "layer_types", None) or ()
    if sp_size <= 1:
        return
    for i, kind in enumerate(types):
        if not refused_kind(config, kind):
            continue
        rates = getattr(config, "compress_rates", None) or {}
        why = REASONS[kind].format(index_topk=getattr(config, "index_topk", "k"), rate=rates.get(kind, "n"))
        raise ValueError(
            f"layer {i}: {kind!r} ({type(config).__name__}) is sparse/compressed attention: {why}. Sequence "
            f"parallelism (sp_size {sp_size}) does not shard it in this version; train this model with "
            "sp_size 1 (tiled MLP/loss and activation offload still apply)"
        )
