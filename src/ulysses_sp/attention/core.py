"""The core attention run over the full sequence: which path runs, and running it.

``UlyssesSPAttentionHF`` hands the core attention ``q [B, H_l, S, D]`` and ``k, v [B, Hkv_l, S, D]``
(after the all-to-all; DESIGN.md step 4). The user's ``core_attn_implementation`` stays their
choice; what runs for it, per forward, depends on the sequence's structure (``masks.SeqLayout``):

==================  ======================  =====================================================
core                plain causal            packed documents / sliding window
==================  ======================  =====================================================
``sdpa``            sdpa ``is_causal``      documents: one sdpa ``is_causal`` call per document
                                            (``attention/segments.py``), on CUDA fp16/bf16 one varlen
                                            flash call (``attention/varlen.py``, untested on a GPU
                                            here); windows, sinks, an explicit
                                            ``attn_chunk``: the **blockwise** core
                                            (``attention/blockwise.py``), no mask tensor, no score
                                            tensor larger than one block
``flash_*``         flash causal            flash varlen (``position_ids``); windows by flash
``flex_attention``  flex ``BlockMask``      flex ``BlockMask`` (sparse)
``eager``           dense ``[S, S]`` mask   dense ``[S, S]`` mask (eager is dense by definition)
==================  ======================  =====================================================

Bidirectional spans (Gemma 3's image blocks, ``attention/span_mask.py``): sdpa through the blockwise core,
eager and flex in their masks; flash and the ring refuse them.

With ``offload_attention`` (sdpa only) every sequence goes through the blockwise core, whose K/V
then live on the host between forward and backward (``attention/kv_offload.py``). No ``S x S`` tensor is
built on any path but ``eager``.

In the hybrid Ulysses x Ring layout (``ring_size > 1``) the full attention is ring attention
(``attention/ring.py``): the blockwise core's per-block math with K/V chunks passed around the ring, for
``sdpa`` and ``eager`` alike (no dense mask then); flash/flex and ``offload_attention`` are refused.

Shape legend: ``B`` batch, ``S`` full sequence, ``H_l`` query heads here, ``Hkv_l`` kv heads here,
``D`` head dim.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ulysses_sp.attention.blockwise import AUTO_CHUNK, AttnStructure, BlockCounts, blockwise_attention
from ulysses_sp.attention.heads import apply_sinks
from ulysses_sp.attention.kv_offload import KVOffload
from ulysses_sp.attention.masks import SeqLayout, mask_for
from ulysses_sp.attention.ring import RingStats, ring_attention
from ulysses_sp.attention.segments import segment_attention
from ulysses_sp.attention.span_mask import SpanStructure, check_span_core, span_structure
from ulysses_sp.attention.varlen import use_varlen, varlen_segment_attention

logger = logging.getLogger(__name__)

CORE_ATTENTIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
DENSE_WARN_TOKENS = 16384
"""``eager`` at or above this many tokens logs a warning: its ``[B, H_l, S, S]`` scores grow as S^2."""


def check_core(core: str) -> None:
    """Raise ``ValueError`` naming the choices unless ``core`` is a core attention this library runs."""
    if core not in CORE_ATTENTIONS:
        raise ValueError(f"unknown core_attn_implementation {core!r}; choose one of {list(CORE_ATTENTIONS)}")


def check_blockwise_options(core: str, attn_chunk: int | None, offload_attention: bool) -> None:
    """Raise ``ValueError`` for blockwise options the core cannot use (same check on every rank)."""
    if attn_chunk is not None and (
        isinstance(attn_chunk, bool) or not isinstance(attn_chunk, int) or attn_chunk < 1
    ):
        raise ValueError(f"attn_chunk must be a positive number of tokens or None (auto), got {attn_chunk!r}")
    if core != "sdpa" and (attn_chunk is not None or offload_attention):
        raise ValueError(
            f"attn_chunk ({attn_chunk}) / offload_attention ({offload_attention}) configure the blockwise "
            f"core, which runs in place of sdpa's masked path; core_attn_implementation is {core!r}. "
            "Use core 'sdpa' (flash and flex bring their own chunking; eager is dense by definition)"
        )


def check_ring_options(core: str, ring_size: int, offload_attention: bool) -> None:
    """Raise ``ValueError`` when the core or offload cannot run as ring attention (``ring_size > 1``)."""
    if ring_size > 1 and (core not in ("sdpa", "eager") or offload_attention):
        raise ValueError(
            f"ring attention (ring_size {ring_size}) runs the blockwise core's math for cores 'sdpa' and "
            f"'eager'; core_attn_implementation is {core!r}, offload_attention {offload_attention}. Use "
            "core 'sdpa' without offload_attention, or ring_size 1 (Ulysses alone, needs the heads to split)"
        )


def attention_path(
    core: str, layout: SeqLayout, sliding_window: int | None, offload: bool, *, sinks: bool = False,
    attn_chunk: int | None = None, indexed: bool = False,
) -> str:
    """The path that runs for ``core`` on this layout: ``"segments"`` (sdpa per document),
    ``"blockwise"``, ``"blockwise+offload"``, ``"sdpa"`` (is_causal), ``"eager"`` (dense), ``"flash"``
    or ``"flex"``. Attention sinks on sdpa (which has no sink input) run through the blockwise core,
    which applies them exactly; so do windows and an explicit ``attn_chunk`` (the blockwise core's
    block size: asking for it asks for that core); so do DSA's picked keys (``indexed``, sdpa or eager)
    and bidirectional spans (``attention/span_mask.py``; refused for flash)."""
    if layout.span_ids is not None:
        check_span_core(core)
    if core in ("sdpa", "eager") and indexed:
        return "blockwise+offload" if offload else "blockwise"
    if core == "sdpa":
        windowed = _windowed(layout, sliding_window)
        if offload:
            return "blockwise+offload"
        if sinks or windowed or layout.span_ids is not None or (layout.doc_ids is not None and attn_chunk is not None):
            return "blockwise"
        return "sdpa" if layout.doc_ids is None else "segments"
    if core.startswith("flash"):
        return "flash"
    return "flex" if core == "flex_attention" else "eager"


def describe_paths(core: str, *, attn_chunk: int | None, offload_attention: bool) -> str:
    """One line for the startup summary: what runs for plain causal and for structured sequences."""
    chunk = f"chunk {attn_chunk}" if attn_chunk else f"chunk auto (64..{AUTO_CHUNK} tokens, ~sqrt(S*D))"
    if core == "sdpa" and offload_attention:
        return f"blockwise core with K/V offloaded to host for every sequence ({chunk})"
    if core == "sdpa":
        if attn_chunk:
            return f"sdpa is_causal for plain causal; blockwise core for packed documents / windows ({chunk})"
        return (f"sdpa is_causal for plain causal, per document for packed documents (one varlen call on CUDA "
                f"fp16/bf16); blockwise core for windows ({chunk})")
    if core.startswith("flash"):
        return "flash causal; varlen for packed documents"
    if core == "flex_attention":
        return "flex BlockMask (sparse) for causal, documents and windows"
    return f"eager: dense [S, S] mask and scores (quadratic memory; warns at S >= {DENSE_WARN_TOKENS})"


def _windowed(layout: SeqLayout, sliding_window: int | None) -> bool:
    return sliding_window is not None and layout.seq_len > sliding_window


def structure_for(layout: SeqLayout, sliding_window: int | None) -> AttnStructure:
    """The blockwise core's structure (documents, window, bidirectional spans) of one forward: ``O(S)`` memory."""
    window = sliding_window if _windowed(layout, sliding_window) else None
    starts = None if layout.host is None or layout.doc_ids is None else layout.host.doc_starts()
    spans = None if layout.host is None else layout.host.spans
    return span_structure(AttnStructure.build(layout.doc_ids, window, starts), layout.span_ids, spans)


def core_function(name: str, module: torch.nn.Module) -> Callable[..., Any]:
    """The unmodified core attention for ``name``; ``eager`` is the model's own eager function."""
    if name == "eager":
        own = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        return own if own is not None else generic_eager
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[name]


def generic_eager(module, query, key, value, attention_mask, scaling, dropout=0.0, s_aux=None, **kwargs):
    """Plain softmax attention for models whose modeling file has no ``eager_attention_forward``
    (with per-head sinks ``s_aux [H_l]`` when given: one extra logit in every softmax, no value)."""
    n_rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(n_rep, 1), value.repeat_interleave(n_rep, 1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # [B, H_l, S, S]
    if attention_mask is not None:
        scores = scores + attention_mask
    if s_aux is not None:  # [B, H_l, S, S] + [B, H_l, S, 1] sink column, dropped after the softmax
        sink = s_aux.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), dim=-1, dtype=torch.float32)[..., :-1].to(query.dtype)
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs  # [B, S, H_l, D]


def run_blockwise(
    module: torch.nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    structure: AttnStructure,
    kwargs: dict[str, Any],
    *,
    chunk: int | None,
    offload: KVOffload | None,
    counts: BlockCounts | None,
) -> torch.Tensor:
    """The blockwise core with transformers' sdpa keyword arguments: ``[B, H_l, S, D] -> [B, S, H_l, D]``."""
    _check_kwargs(module, kwargs, ring=False)
    sinks = kwargs.get("s_aux")
    out = blockwise_attention(q, k, v, structure=structure, scale=kwargs.get("scaling"), chunk=chunk,
                              offload=offload, counts=counts, return_lse=sinks is not None)  # fmt: skip
    if sinks is not None:  # [B, H_l, S, D] rescaled by each head's sink
        out = apply_sinks(*out, sinks)
    # [B, H_l, S, D] -> [B, S, H_l, D]: a view (the exchange reads it head by head; no copy of what
    # the core saved), whose gradient comes back in the same layout (no copy in the core's backward)
    return out.transpose(1, 2)


def run_segments(
    module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[list[int]],
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """Packed documents: one varlen kernel call on CUDA where it applies (``attention/varlen.py``), else one
    sdpa call per document: ``[B, H_l, S, D] -> [B, S, H_l, D]``."""
    _check_kwargs(module, kwargs, ring=False)
    if use_varlen(q, k):  # decided per call: CUDA, fp16/bf16, shapes torch's flash check accepts
        return varlen_segment_attention(q, k, v, lengths, scale=kwargs.get("scaling"))
    out = segment_attention(q, k, v, lengths, scale=kwargs.get("scaling"))
    return out.transpose(1, 2).contiguous()  # [B, H_l, S, D] -> [B, S, H_l, D]


def _check_kwargs(module: torch.nn.Module, kwargs: dict[str, Any], *, ring: bool) -> None:
    """Refuse what the blockwise math (blockwise core, ring) does not implement."""
    dropout = kwargs.get("dropout") or 0.0
    if dropout and module.training:
        raise ValueError(
            f"attention dropout ({dropout}) is not supported by the blockwise core (packed documents, "
            "windows or offload_attention on sdpa, ring attention); set the model's attention_dropout to 0"
        )
    if kwargs.get("softcap") is not None:
        raise ValueError(
            f"this model caps its attention logits (softcap {kwargs['softcap']}), which the blockwise core "
            "(sdpa with packed documents, windows or offload_attention) and ring attention do not implement; "
            "use core 'eager' (or 'flex_attention') with ring_size 1"
        )
    if ring and kwargs.get("s_aux") is not None:
        raise ValueError(
            "this model has attention sinks (a learned logit per head in every softmax, s_aux); ring "
            "attention merges K/V chunks without them. Use ring_size 1 (Ulysses alone: sinks are exact on "
            "cores 'sdpa' and 'eager'), which needs num_attention_heads divisible by the sp size"
        )


def run_ring(
    module: torch.nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    structure: AttnStructure,
    kwargs: dict[str, Any],
    *,
    group: Any,
    chunk: int | None,
    counts: BlockCounts | None,
    stats: RingStats | None = None,
) -> torch.Tensor:
    """Ring attention over the ring group with transformers' keyword arguments:
    ``[B, H_l, S/R, D]`` (this ring rank's zigzag tokens) ``-> [B, S/R, H_l, D]``."""
    _check_kwargs(module, kwargs, ring=True)
    if isinstance(structure, SpanStructure):  # the ring skips key chunks after the queries
        check_span_core("sdpa", ring_size=dist.get_world_size(group))
    out = ring_attention(q, k, v, group=group, structure=structure, scale=kwargs.get("scaling"), chunk=chunk,
                         counts=counts, stats=stats)  # fmt: skip
    return out.transpose(1, 2).contiguous()


def warn_dense(seq_len: int) -> None:
    """Log once per forward that eager materialises ``S x S`` at this length."""
    if seq_len >= DENSE_WARN_TOKENS:
        logger.warning(
            "core attention 'eager' builds a dense [S, S] mask and [B, H_l, S, S] scores at S = %d "
            "(quadratic memory); use 'sdpa' (blockwise for packed documents), flash or flex",
            seq_len,
        )


def core_mask(core: str, layout: SeqLayout, dtype: torch.dtype, window: int | None) -> Any:
    """The mask ``core`` takes for ``layout`` (dense for eager, warned about at long ``S``; ``mask_for``)."""
    if core == "eager":
        warn_dense(layout.seq_len)
    return mask_for(layout, core, dtype, window)
