"""Global document boundaries for sequence mixers: the batch's position ids, gathered over the SP
group once per forward, and the model's own kernel run once per document.

A mixer's forward does not receive ``position_ids`` (decoder layers keep them for attention), so
``PositionTracker`` captures them where the batch enters the model: a forward pre-hook on the
model's root records its ``position_ids`` argument (a weak reference: nothing outlives the step's
batch; a checkpoint recompute in backward finds the same tensor). The first mixer of a forward asks
for the full-sequence layout (``masks.seq_layout``: the data adapter's host layout attached to the
ids, else a gather, one small all-gather per forward with host reads; cached on the tensor's identity
and version); later mixers and recomputes reuse it.

Packed documents (position ids restarting at 0): the models' torch kernels (``causal_conv1d_fn``,
``mamba2_chunk_scan``) cannot reset their state at a boundary — without SP they let one document
leak into the next. ``per_document`` runs the kernel on each document's span of the full sequence
instead, so each document sees exactly what it would see alone (zero conv padding, zero initial
state, its own chunk grid). No position ids: one document per row.

Shape legend: ``B`` batch, ``S`` global sequence, ``S_l = S/P``.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ulysses_sp.attention.masks import SeqLayout, seq_layout
from ulysses_sp.attention.positions import GIVEN

Segments = list[tuple[slice, list[tuple[int, int]]]]
"""``(rows, [(start, end), ...])``: a group of batch rows and the document spans they share."""


class PositionTracker:
    """The current forward's ``position_ids``, captured at the model's root (see the module doc)."""

    def __init__(self, mesh: Any) -> None:
        self.mesh = mesh
        self._source: weakref.ref | None = None
        self._cache: tuple[weakref.ref, tuple[int, int, int], SeqLayout] | None = None
        self._index: int | None = None

    def install(self, model: nn.Module) -> Callable[[], None]:
        """Record every forward's ``position_ids`` keyword on ``model``; returns the undo."""
        names = list(inspect.signature(model.forward).parameters)
        self._index = names.index("position_ids") if "position_ids" in names else None
        handle = model.register_forward_pre_hook(self._capture, with_kwargs=True)

        def undo() -> None:
            handle.remove()
            self._source = self._cache = None

        return undo

    def _capture(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        pos = kwargs.get("position_ids")
        if pos is None and self._index is not None and self._index < len(args):  # passed by position
            pos = args[self._index]
        self._source = weakref.ref(pos) if isinstance(pos, torch.Tensor) else None

    def current(self) -> torch.Tensor | None:
        """The current forward's ``position_ids`` as given to the model's root (``[B|1, S_l]``), or ``None``."""
        return self._source() if self._source is not None else None

    def layout(self, s_local: int, batch: int) -> SeqLayout | None:
        """The full-sequence layout of the current forward, or ``None`` without position ids
        (every row one document). A collective at ``sp_size > 1`` on a forward's first call."""
        pos = self._source() if self._source is not None else None
        if pos is None:
            return None
        if pos.dim() != 2 or pos.shape[-1] != s_local or pos.shape[0] not in (1, batch):
            raise ValueError(
                f"position_ids must be [B, S_l] = [{batch}, {s_local}] (or [1, {s_local}]) at the "
                f"sequence mixers, got {tuple(pos.shape)}"
            )
        key = (pos._version, s_local, batch)
        if self._cache is not None and self._cache[0]() is pos and self._cache[1] == key:
            return self._cache[2]
        # the adapter's host layout attached to pos, else the fallback: gathered, [B|1, S_l] -> [B|1, S]
        group = self.mesh.sp_group if self.mesh.sp_size > 1 else None
        layout = seq_layout(pos, GIVEN, group=group, batch=batch, s_local=s_local, expected_len=None)
        self._cache = (weakref.ref(pos), key, layout)
        return layout


def segments(layout: SeqLayout | None, batch: int, seq_len: int) -> Segments:
    """The document spans of each row of ``[B, S]``: all rows together when they share them."""
    if layout is None or layout.doc_ids is None:
        return [(slice(None), [(0, seq_len)])]
    out: Segments = []
    rows = [slice(None)] if layout.doc_ids.shape[0] == 1 else [slice(b, b + 1) for b in range(batch)]
    for i, row in enumerate(rows):
        if layout.host is not None:  # the adapter's: host ints
            starts = layout.host.doc_starts()[i]
        else:  # the fallback reads the device ids
            starts = [0] + (torch.nonzero(layout.positions[i, 1:] == 0).flatten() + 1).tolist()
        out.append((row, list(zip(starts, starts[1:] + [seq_len]))))
    return out


def per_document(
    fn: Callable[..., torch.Tensor],
    xs: Sequence[torch.Tensor],
    spans: Segments,
    *,
    seq_dim: int,
) -> torch.Tensor:
    """``fn(*xs)`` computed separately on every document span (``seq_dim`` of each ``x``), the
    results put back in place: ``[B, ..., S, ...]`` in, ``fn``'s ``[B, ..., S, ...]`` out."""
    if len(spans) == 1 and spans[0][1] == [(0, xs[0].shape[seq_dim])]:
        return fn(*xs)
    rows = []
    for row, docs in spans:
        parts = [fn(*(x[row].narrow(seq_dim, s, e - s) for x in xs)) for s, e in docs]
        rows.append(torch.cat(parts, dim=seq_dim))  # the row's documents back in sequence order
    return torch.cat(rows, dim=0)  # [B, ..., S, ...]


def window_cuts(layout: SeqLayout | None, first: int, end: int) -> list[list[int]] | None:
    """Where a document starts inside the window of global positions ``[first, end)`` (a rank's halo and
    shard; positions before 0 count as their own document), per row of the batch (or one list for all),
    relative to ``first``, as host ints; ``None`` without packed documents."""
    if layout is None or layout.doc_ids is None:
        return None
    if layout.host is not None:  # the adapter's layout: no read of the device ids
        return [[s - first for s in row if first < s < end] for row in layout.host.doc_starts()]
    docs = layout.doc_ids  # the fallback: [B|1, end-first] ids (-1 before the sequence), read back
    docs = torch.cat([docs.new_full((docs.shape[0], max(0, -first)), -1), docs[:, max(0, first) : end]], dim=-1)
    return [(torch.nonzero(row[1:] != row[:-1]).flatten() + 1).tolist() for row in docs]


def per_window_document(
    fn: Callable[..., Any], xs: Sequence[torch.Tensor], cuts: list[list[int]] | None, *, dim: int
) -> Any:
    """``fn(*xs)`` run on every document of the window (``cuts`` from ``window_cuts``, along ``dim`` of each
    ``[B, ..., L, ...]`` input), the outputs (a tensor or a tuple of them, ``L`` along ``dim``) concatenated
    back in order; one call when unpacked. Rows with different boundaries run one by one."""
    if cuts is None or not any(cuts):
        return fn(*xs)
    if len(cuts) > 1:
        rows = [per_window_document(fn, [x[b : b + 1] for x in xs], [cuts[b]], dim=dim) for b in range(xs[0].shape[0])]
        return _cat(rows, 0)
    edges = [0, *cuts[0], xs[0].shape[dim]]
    parts = [fn(*(x.narrow(dim, a, e - a) for x in xs)) for a, e in zip(edges[:-1], edges[1:])]
    return _cat(parts, dim)


def _cat(parts: list[Any], dim: int) -> Any:
    """Concatenate a list of tensors, or of equal-length tuples of tensors element by element."""
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts, dim=dim)
    return tuple(torch.cat(list(group), dim=dim) for group in zip(*parts))
