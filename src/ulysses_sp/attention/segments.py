"""Packed documents through the fused kernel: one causal sdpa call per document segment.

After the q/k/v all-to-all each rank holds the **full** sequence for its heads (DESIGN.md step 4),
so every packed document is one contiguous run of tokens ``[a, b)``, and attention within it is
plain causal attention over that run. This path splits q/k/v at the document boundaries (views),
runs ``scaled_dot_product_attention(is_causal=True)`` on each segment — the fused kernel (flash on
CPU and CUDA: no ``S x S`` tensor, ``O(S)`` memory), GQA through ``enable_gqa`` so K/V are never
expanded — and concatenates the outputs. Autograd does the rest: the backward of the split is one
concatenation of the segment gradients, so nothing of size ``S`` is allocated per document.

It replaces the blockwise core's Python loop over key/value blocks (``attention/blockwise.py``) for
sdpa with packed documents (``core.attention_path`` picks it): measured on CPU, about an order of
magnitude faster at S 4096-8192 (``bench/packed_path.py``). The blockwise core stays for what this
path cannot express: sliding windows, attention sinks, Ulysses-Offload and an explicit
``attn_chunk``. Numerics: the kernel's own (fp32 accumulation); no dropout (refused, as in the
blockwise core, so the two paths accept the same models).

Shape legend: ``B`` batch, ``S`` full sequence, ``H_l`` query heads here, ``Hkv_l`` kv heads here,
``D`` head dim, ``n`` one document's tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def segment_lengths(doc_ids_host: torch.Tensor) -> list[list[int]]:
    """Per row of ``doc_ids [B|1, S]`` (non-decreasing, on the host): its documents' lengths in order."""
    return [torch.unique_consecutive(row, return_counts=True)[1].tolist() for row in doc_ids_host]


def _one_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], scale: float | None):
    """``[b, H_l, S, D]`` rows sharing one document layout -> ``[b, H_l, S, D]``."""
    gqa = q.shape[1] != k.shape[1]
    parts = zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2))  # [b, H*, n, D] each
    outs = [F.scaled_dot_product_attention(a, b, c, is_causal=True, scale=scale, enable_gqa=gqa) for a, b, c in parts]
    return outs[0] if len(outs) == 1 else torch.cat(outs, 2)


def segment_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: list[list[int]],
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention within each packed document: ``[B, H_l, S, D] -> [B, H_l, S, D]``.

    Args:
        q: ``[B, H_l, S, D]``; k, v: ``[B, Hkv_l, S, D]`` (``Hkv_l`` divides ``H_l``).
        lengths: ``segment_lengths(doc_ids)``: one list per batch row, or one list for every row.
        scale: score scale (``None``: ``1/sqrt(D)``).

    Returns:
        ``[B, H_l, S, D]`` in ``q``'s dtype; differentiable.
    """
    if any(sum(row) != q.shape[2] for row in lengths) or len(lengths) not in (1, q.shape[0]):
        raise ValueError(
            f"document lengths {[sum(r) for r in lengths]} (over {len(lengths)} rows) do not cover q of shape "
            f"{tuple(q.shape)}: pass one list per batch row (or one for all) summing to S"
        )
    if len(lengths) == 1 or all(row == lengths[0] for row in lengths):
        return _one_row(q, k, v, lengths[0], scale)
    # rows with different documents: one row at a time ([1, H*, S, D] views), stacked back
    return torch.cat([_one_row(q[i : i + 1], k[i : i + 1], v[i : i + 1], row, scale) for i, row in enumerate(lengths)])
