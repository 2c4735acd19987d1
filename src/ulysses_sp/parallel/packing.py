"""Byte packing for the packed all-to-all: several tensors' per-rank chunks in one buffer row per rank.

``comm`` exchanges q, k and v (or a mixer's tensors, or their gradients) in **one** collective: each
tensor is cut into ``P`` chunks along its scatter dim, chunk ``j`` of every tensor goes into row ``j``
of a ``[P, bytes]`` buffer (``pack``), and what arrives is cut back into tensors and glued along the
gather dim (``unpack``). Pure tensor layout, no communication; dtypes may differ (each keeps its own
bytes, segments aligned to the largest element size).

Shape legend: ``P`` the group size; ``n`` a tensor's scatter-dim length.
"""

from __future__ import annotations

import torch


def rank_parts(xs: tuple[torch.Tensor, ...], scatter_dim: int, p: int) -> list[torch.Tensor]:
    """Each tensor as ``[P, ..., n/P, ...]`` (a view: chunk ``j``, for rank ``j``, first)."""
    for x in xs:
        if x.shape[scatter_dim] % p:
            raise ValueError(f"dim {scatter_dim} of shape {tuple(x.shape)} is not divisible by sp_size {p}")
    # [..., n, ...] -> [P, ..., n/P, ...] per tensor
    return [x.unflatten(scatter_dim % x.dim(), (p, x.shape[scatter_dim] // p)).movedim(scatter_dim % x.dim(), 0)
            for x in xs]  # fmt: skip


def segment_sizes(parts: list[torch.Tensor]) -> list[int]:
    """Bytes of one rank's chunk of each tensor, rounded up to the largest element size (every
    segment stays aligned for its dtype; no padding when the dtypes agree)."""
    align = max(part.element_size() for part in parts)
    return [-(-part[0].numel() * part.element_size() // align) * align for part in parts]


def pack(parts: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
    """``[P, bytes per rank]`` uint8: row ``j`` holds chunk ``j`` of every part, in order (one copy each)."""
    send = torch.empty((parts[0].shape[0], sum(sizes)), dtype=torch.uint8, device=parts[0].device)
    offset = 0
    for part, n in zip(parts, sizes):
        segment(send, offset, part.shape, part.dtype).copy_(part)
        offset += n
    return send


def unpack(recv: torch.Tensor, layouts: list[tuple[torch.Size, torch.dtype]], sizes: list[int],
           gather_dims: list[int | None]) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """The received rows back as tensors, each source rank's block glued along its gather dim (a copy),
    or for ``None`` the ``[P(src), ...]`` view. ``layouts``: each part's ``[P, ...]`` shape and dtype."""
    outs, offset = [], 0
    for (shape, dtype), n, g in zip(layouts, sizes, gather_dims):
        piece = segment(recv, offset, shape, dtype)  # [P(src), ...]
        if g is not None:  # [P(src), ..., g, ...] -> [..., P*g, ...]: the source rank's block goes first
            g %= len(shape) - 1
            piece = piece.movedim(0, g).flatten(g, g + 1)
        outs.append(piece)
        offset += n
    return tuple(outs)


def layout_of(parts: list[torch.Tensor]) -> list[tuple[torch.Size, torch.dtype]]:
    """Each part's shape and dtype: what ``unpack`` needs, without keeping the parts alive."""
    return [(part.shape, part.dtype) for part in parts]


def segment(buf: torch.Tensor, offset: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The bytes ``[offset, offset + size)`` of every row of ``buf [P, bytes]`` as ``dtype`` and ``shape``
    ``[P, ...]`` (a view)."""
    nbytes = shape[1:].numel() * dtype.itemsize
    return buf[:, offset : offset + nbytes].view(dtype).view(shape)


def release(*bufs: torch.Tensor) -> None:
    """Free buffers of a finished collective now, in this thread. The process group's work may hold them a
    while longer (gloo's worker thread drops its references when it next runs and, their Python objects
    gone, only once it holds the GIL), so they would otherwise outlive the call into the next allocations.
    Detaches each buffer's own tensor from its storage (what else shares the storage keeps it); views are
    skipped (detaching one would bump its base's version counter; its base is the caller's)."""
    with torch.no_grad():
        for buf in bufs:
            if buf._base is None:
                buf.set_()
