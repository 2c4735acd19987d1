"""The document layout of one batch as host values: what the attention needs of the positions, sync-free.

The SP attention and the sequence mixers need the **full** sequence's structure (where packed
documents start, what the position ids are) while each rank holds only ``S_l`` tokens. Gathered from
the device per forward (``attention/masks.py``'s fallback) that costs a collective and host reads of
device values (``.tolist()``, ``bool(tensor)``): GPU syncs in the hot path, and a step that cannot
run under ``FakeTensorMode`` (DESIGN.md, "Scale without a GPU"). Instead the data adapter, which
holds the whole batch on the host before sharding it, computes a ``HostLayout`` once per batch
(``host_layout``), ships it to the SP group in the metadata exchange it already makes per round, and
attaches it to the yielded shard's ``position_ids`` tensor (``attach_layout``). Whoever receives that
tensor (the attention, the mixers' position tracker) reads it back with ``layout_of``: no extra
keyword for the model, nothing for a model without SP attention to trip over, and the layout is
dropped (the fallback runs) if the tensor is edited in place.

A row's position ids are stored as *runs*: maximal spans where the id goes up by one, each as
``(first token, its position id)``; a position id 0 after the first token starts a new document
(the packed-document convention, ``masks.SeqLayout``) and always starts a run. Typical batches have
one run per document, so the layout is ``O(documents)`` Python ints, not ``O(S)``.

A layout may also carry **bidirectional spans** (``spans``): per row, ``[start, end)`` token ranges whose
tokens see each other fully (Gemma 3's image tokens: runs of ``token_type_ids == 1``, found on the host by
``bidirectional_spans``); the attention ORs them into its causal mask (``attention/span_mask.py``).

Shape legend: ``B`` batch, ``S`` full (padded) sequence.
"""

from __future__ import annotations

import weakref
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

import torch

_ATTR = "_ulysses_sp_layout"
"""The attribute of a ``position_ids`` tensor holding ``(HostLayout, tensor version)``."""


@dataclass(frozen=True)
class HostLayout:
    """The full sequence's position ids of one batch, as host ints (see the module doc)."""

    seq_len: int
    """``S``: tokens per row of the full (padded) sequence."""
    runs: tuple[tuple[tuple[int, int], ...], ...]
    """Per batch row: ``(first token, its position id)`` of every run of ids going up by one."""
    dtype: torch.dtype = torch.int64
    """The position ids' dtype."""
    spans: tuple[tuple[tuple[int, int], ...], ...] | None = None
    """Per batch row: sorted, disjoint ``[start, end)`` bidirectional spans; ``None``: none (causal only)."""

    def __post_init__(self) -> None:
        if self.spans is not None:
            check_spans(self.spans, len(self.runs), self.seq_len)

    def span_ids(self, device: torch.device | str) -> torch.Tensor | None:
        """``[B, S]`` int64: the index of each token's span, ``-1`` outside spans (``None``: no spans)."""
        if self.spans is None or not any(self.spans):
            return None
        ids = torch.full((self.batch, self.seq_len), -1, dtype=torch.int64)
        for row, spans in zip(ids, self.spans):
            for i, (a, b) in enumerate(spans):
                row[a:b] = i
        return ids.to(device)

    @property
    def batch(self) -> int:
        return len(self.runs)

    def doc_starts(self) -> list[list[int]]:
        """Per row: the first token of every document (``0`` first; a later id 0 starts one)."""
        return [[0] + [t for t, p in row if t > 0 and p == 0] for row in self.runs]

    @property
    def packed(self) -> bool:
        """Whether any row holds more than one document (``SeqLayout.doc_ids`` is not ``None``)."""
        return any(t > 0 and p == 0 for row in self.runs for t, p in row)

    def doc_lengths(self) -> list[list[int]]:
        """Per row: its documents' lengths in order (``segments.segment_lengths`` of the doc ids)."""
        return [[e - s for s, e in zip(st, [*st[1:], self.seq_len])] for st in self.doc_starts()]

    def positions(self, device: torch.device | str) -> torch.Tensor:
        """``[B, S]`` position ids, built from the runs (sizes known on the host: nothing data-dependent)
        and copied to ``device``."""
        rows = []
        for row in self.runs:
            ends = [t for t, _ in row[1:]] + [self.seq_len]
            rows.append(torch.cat([torch.arange(p, p + e - t) for (t, p), e in zip(row, ends)]))  # [S]
        return torch.stack(rows).to(self.dtype).to(device)

    def doc_ids(self, device: torch.device | str) -> torch.Tensor | None:
        """``[B, S]`` int64 document index per token (``SeqLayout.doc_ids``), or ``None`` unpacked."""
        if not self.packed:
            return None
        rows = [torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in self.doc_lengths()]
        return torch.stack(rows).to(device)

    def split_at_chunks(self, chunk: int) -> HostLayout:
        """The layout of ``positions.split_at_chunks(positions, chunk)``: every token whose id is a
        multiple of ``chunk`` (document starts included) and the first token start a segment
        numbered from 0 (chunked attention)."""
        if self.spans is not None and any(self.spans):
            raise ValueError(
                f"bidirectional spans {self.spans} with chunked attention (chunk {chunk}): no model combines "
                "them and the chunked mask would drop the spans; pass the batch without token_type_ids spans"
            )
        out = []
        for row in self.runs:
            ends = [t for t, _ in row[1:]] + [self.seq_len]
            starts = {0}
            for (t, p), e in zip(row, ends):
                first = -(-p // chunk) * chunk  # the first multiple of chunk at or after p
                starts.update(range(t + first - p, e, chunk))
            out.append(tuple((s, 0) for s in sorted(starts)))
        return HostLayout(self.seq_len, tuple(out))  # int64, as positions.split_at_chunks makes them


def check_spans(spans: Any, batch: int, seq_len: int) -> None:
    """Raise ``ValueError`` unless ``spans`` holds, for each of ``batch`` rows, sorted disjoint non-empty
    ``(start, end)`` int pairs within ``[0, seq_len]``."""
    ok = isinstance(spans, (tuple, list)) and len(spans) == batch
    for row in spans if ok else ():
        ends = [0]
        for span in row:
            ok = ok and len(span) == 2 and all(isinstance(x, int) for x in span)
            ok = ok and ends[-1] <= span[0] < span[1]
            ends.append(span[1] if ok else 0)
        ok = ok and ends[-1] <= seq_len
    if not ok:
        raise ValueError(
            f"bidirectional spans must be, per batch row ({batch} rows), sorted disjoint [start, end) int "
            f"pairs with 0 <= start < end <= S ({seq_len}); got {spans!r}"
        )


def bidirectional_spans(token_type_ids: torch.Tensor, kind: int = 1) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per row of ``[B, S]`` ``token_type_ids`` (host data, once per step): the ``[start, end)`` maximal
    runs of ``kind`` — Gemma 3's image blocks (``get_block_sequence_ids_for_mask``: adjacent image tokens
    form one)."""
    is_kind = (token_type_ids.detach().cpu() == kind).to(torch.int8)
    edges = torch.nn.functional.pad(is_kind, (1, 1)).diff(dim=-1)  # [B, S+1]: +1 at a start, -1 at an end
    out = []
    for row in edges:
        starts, ends = (row == 1).nonzero().flatten().tolist(), (row == -1).nonzero().flatten().tolist()
        out.append(tuple(zip(starts, ends)))
    return tuple(out)


def host_layout(position_ids: torch.Tensor, *, spans: tuple | None = None) -> HostLayout:
    """The ``HostLayout`` of ``[B, S]`` full-sequence position ids (read on the host: data path only), with
    the rows' bidirectional ``spans`` (``bidirectional_spans``) when given."""
    pos = position_ids.detach().to("cpu", torch.int64)
    brk = torch.ones_like(pos, dtype=torch.bool)  # [B, S]: a run starts here
    brk[:, 1:] = (pos[:, 1:] != pos[:, :-1] + 1) | (pos[:, 1:] == 0)
    runs = []
    for row, starts in zip(pos, brk):
        idx = starts.nonzero().flatten()
        runs.append(tuple(zip(idx.tolist(), row[idx].tolist())))
    return HostLayout(pos.shape[-1], tuple(runs), position_ids.dtype, spans)


_ATTACHED: dict[int, weakref.ref] = {}
"""Storage key -> the tensor a layout is attached to: a model that hands its attention a view of
the same elements (Qwen3.5: ``position_ids[None].expand(4, ...)[0]``) finds the layout through it."""


def attach_layout(position_ids: torch.Tensor, layout: HostLayout) -> torch.Tensor:
    """Attach ``layout`` to the shard's ``position_ids`` (returned); valid while the tensor is unedited."""
    setattr(position_ids, _ATTR, (layout, position_ids._version))
    for key in [k for k, ref in _ATTACHED.items() if ref() is None]:
        del _ATTACHED[key]
    _ATTACHED[position_ids.untyped_storage()._cdata] = weakref.ref(position_ids)
    return position_ids


def layout_of(position_ids: Any) -> HostLayout | None:
    """The ``HostLayout`` attached to ``position_ids`` — or to the tensor it is an identical view of
    (same storage, shape, strides and offset) — or ``None`` (none attached, or edited since)."""
    found = getattr(position_ids, _ATTR, None)
    if found is None and isinstance(position_ids, torch.Tensor):
        ref = _ATTACHED.get(position_ids.untyped_storage()._cdata)
        base = ref() if ref is not None else None
        same = base is not None and (base.shape, base.stride(), base.storage_offset()) == (
            position_ids.shape, position_ids.stride(), position_ids.storage_offset())  # fmt: skip
        found = getattr(base, _ATTR, None) if same else None
        if found is not None:
            return found[0] if found[1] == base._version else None
    if found is None or found[1] != position_ids._version:
        return None
    return found[0]


def doc_boundaries_between(starts: list[int], lo: int, hi: int) -> int:
    """How many of the sorted document ``starts`` lie in ``(lo, hi]`` (0 when ``hi <= lo``)."""
    return max(0, bisect_right(starts, hi) - bisect_right(starts, lo))
