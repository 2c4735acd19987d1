"""Packed documents in one fused call on CUDA: torch's varlen flash kernel (``torch.nn.attention.varlen``).

**Not run on a GPU here**: the development machines have none. The decision (``varlen_refusal``), the
``cu_seqlens`` construction and the packing around the kernel are tested on CPU (``tests/test_varlen.py``,
with a reference kernel written from ``varlen_attn``'s documented contract); the kernel call itself is
checked by ``python -m bench.gpu_check --only packed`` on a CUDA machine.

After the q/k/v all-to-all each rank holds the full sequence for its heads (DESIGN.md step 4), so each
packed document is one contiguous run of tokens ``[a, b)`` of a batch row. ``varlen_attn`` takes every
document of every row at once: tokens flattened to ``[B*S, H, D]`` and the boundaries as cumulative
offsets ``cu_seqlens [N+1]`` (int32, on the device), causal inside each document
(``window_size=(-1, 0)``), GQA native (``Hkv_l`` divides ``H_l``; K/V never expanded), the backward the
flash kernel's own. It replaces ``attention/segments.py``'s Python loop of one sdpa call per document
where the kernel exists: a CUDA tensor in fp16/bf16 whose shapes torch's flash check accepts (head dim
<= 256 and a multiple of 8, an sm80+ device, flash enabled); anything else keeps the per-document sdpa,
which is exact everywhere. Numerics: the flash kernel's (fp32 accumulation), as sdpa's flash backend.

Shape legend: ``B`` batch, ``S`` full sequence, ``H_l`` query heads here, ``Hkv_l`` kv heads here,
``D`` head dim, ``T = B*S`` tokens of the batch, ``N`` documents of the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate

import torch

VARLEN_DTYPES = (torch.float16, torch.bfloat16)
"""What the flash varlen kernel computes in; fp32 (the CPU tests' dtype) keeps the per-document sdpa."""
MAX_HEAD_DIM = 256
"""The flash kernel's largest head dim (a multiple of 8 at most this)."""


def varlen_refusal(
    device_type: str, dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int, *, kernel_ok: bool = True
) -> str | None:
    """Why the varlen kernel cannot run this call (``None``: it can). ``kernel_ok``: torch's own flash
    check for these tensors (``torch.backends.cuda.can_use_flash_attention``), asked only on CUDA."""
    if device_type != "cuda":
        return f"device {device_type!r}: the varlen kernel is CUDA-only"
    if dtype not in VARLEN_DTYPES:
        return f"dtype {dtype}: the varlen kernel computes in float16/bfloat16"
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return f"head dim {head_dim}: the varlen kernel needs a multiple of 8 up to {MAX_HEAD_DIM}"
    if heads % kv_heads:
        return f"{heads} query heads are not a multiple of {kv_heads} kv heads"
    if not kernel_ok:
        return "torch's flash check refuses these tensors (device capability, flash disabled or not built)"
    return None


def _flash_accepts(q: torch.Tensor, k: torch.Tensor) -> bool:
    """torch's flash-attention check for causal ``q [B, H_l, S, D]``, ``k [B, Hkv_l, S, D]`` (CUDA only)."""
    cuda = torch.backends.cuda
    if not (cuda.is_flash_attention_available() and cuda.flash_sdp_enabled()):
        return False
    return cuda.can_use_flash_attention(cuda.SDPAParams(q, k, k, None, 0.0, True, q.shape[1] != k.shape[1]))


def use_varlen(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether this call runs the varlen kernel (decided per call from the tensors: device, dtype, shapes)."""
    args = (q.device.type, q.dtype, q.shape[-1], q.shape[1], k.shape[1])
    return varlen_refusal(*args) is None and varlen_refusal(*args, kernel_ok=_flash_accepts(q, k)) is None


def cu_seqlens(lengths: list[list[int]], batch: int, seq_len: int) -> tuple[torch.Tensor, int]:
    """Cumulative document offsets in the flattened ``[B*S]`` tokens: ``(cu [N+1] int32 on the host, the
    longest document)``. ``lengths``: one list per batch row, or one list shared by every row
    (``segments.segment_lengths``); each row's lengths sum to ``seq_len``."""
    if len(lengths) not in (1, batch) or any(sum(row) != seq_len or min(row) < 1 for row in lengths):
        raise ValueError(
            f"document lengths with row sums {[sum(r) for r in lengths]} (over {len(lengths)} rows) do not cover "
            f"{batch} rows of {seq_len} tokens: pass one list of positive lengths per batch row (or one for all)"
        )
    rows = lengths * batch if len(lengths) == 1 else lengths
    flat = [n for row in rows for n in row]
    return torch.tensor([0, *accumulate(flat)], dtype=torch.int32), max(flat)


def varlen_segment_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: list[list[int]],
    *,
    scale: float | None = None,
    kernel: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention within each packed document, one kernel call: ``[B, H_l, S, D] -> [B, S, H_l, D]``.

    Args:
        q: ``[B, H_l, S, D]``; k, v: ``[B, Hkv_l, S, D]``.
        lengths: ``segments.segment_lengths(doc_ids)``: one list per batch row, or one for every row.
        scale: score scale (``None``: ``1/sqrt(D)``).
        kernel: ``varlen_attn``'s signature; ``None``: ``torch.nn.attention.varlen.varlen_attn`` (CUDA).

    Returns:
        ``[B, S, H_l, D]`` (the layout the Ulysses output all-to-all takes); differentiable.
    """
    b, h, s, d = q.shape
    cu, longest = cu_seqlens(lengths, b, s)
    cu = cu.to(q.device, non_blocking=True)
    if kernel is None:
        from torch.nn.attention.varlen import varlen_attn as kernel  # CUDA kernels; importing is cheap
    # [B, H*, S, D] -> [B, S, H*, D] -> [B*S, H*, D]: tokens of all rows back to back; a strided view when B = 1
    # (the kernel takes row and head strides; only the last dim must be contiguous), one copy when B > 1
    qt, kt, vt = (t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (q, k, v))
    out = kernel(qt, kt, vt, cu, cu, longest, longest, scale=scale, window_size=(-1, 0), enable_gqa=h != k.shape[1])
    return out.view(b, s, h, d)  # [B*S, H_l, D] -> [B, S, H_l, D]
