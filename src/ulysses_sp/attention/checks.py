"""What the SP attention refuses for a model, without a process group: the checks
``UlyssesSPAttentionHF.register_with_transformers`` runs before it builds anything, and that the
launching process runs (``run.model_checks``) on the model built on the meta device.

- ``check_sp_attention(config, core, sp_size, ...)``: the core attention, the attention kinds
  sequence parallelism cannot shard (``layer_kinds``), every layer's heads over ``sp_size`` (with
  the ring size that makes them split), the blockwise and ring options, the head groups of
  ``head_chunks``; returns the ring size;
- ``check_head_chunk_sinks(model, head_chunks)``: the function-level head groups recompute each group's
  attention with gradients for q/k/v only, so an attention module with per-head sinks that the whole
  block per group cannot cut (``head_blocks.head_block_layout``; that one cuts the sinks too) is refused
  (the check the SP attention runs at its first call, ``head_chunks.check_no_sinks``).

Pure: reads the config and the modules' attributes; every check raises ``ValueError``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ulysses_sp.attention.core import check_blockwise_options, check_core, check_ring_options
from ulysses_sp.attention.head_blocks import head_block_layout
from ulysses_sp.attention.head_chunks import check_no_sinks, plan_head_chunks
from ulysses_sp.attention.layer_kinds import check_indexed_options, check_layer_kinds
from ulysses_sp.parallel.mesh_shape import head_counts, resolve_ring_size_for_layers


def check_sp_attention(
    config: Any,
    core: str,
    sp_size: int,
    *,
    ring_size: int | str | None = None,
    attn_chunk: int | None = None,
    offload_attention: bool = False,
    head_chunks: int = 1,
) -> int:
    """Raise ``ValueError`` for what the SP attention cannot run on ``config``'s model at ``sp_size``;
    return the ring size (``ring_size``, or for ``None``/``"auto"`` the smallest that splits the heads)."""
    check_core(core)
    check_layer_kinds(config, sp_size)
    heads = head_counts(config)  # every layer's (query, kv) heads: per-layer configs may differ
    ring = resolve_ring_size_for_layers(sp_size, heads, ring_size)
    check_blockwise_options(core, attn_chunk, offload_attention)
    check_ring_options(core, ring, offload_attention)
    check_indexed_options(config, core, ring)
    for num_heads, num_kv in heads:  # every layer's heads split into the head groups
        plan_head_chunks(num_heads, num_kv, head_chunks, sp_size // ring)
    return ring


def check_head_chunk_sinks(model: nn.Module, head_chunks: int) -> None:
    """Raise ``ValueError`` when ``head_chunks > 1`` and some attention module of ``model`` that the
    whole block per head group cannot cut has per-head sinks (``head_chunks.check_no_sinks``)."""
    if head_chunks <= 1:
        return
    for module in model.modules():
        if not (hasattr(module, "layer_idx") and not isinstance(head_block_layout(module), str)):
            check_no_sinks(module, {}, head_chunks)
