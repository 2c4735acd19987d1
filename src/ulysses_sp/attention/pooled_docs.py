"""Where DeepSeek-V4's pooled entries come from on one rank, per packed document: host ints and small index
tensors, the same counts and shapes on every rank of the SP group.

Run alone, a document ``[s, e)`` pools ``n = (e - s) // r`` windows ``[s + w r, s + (w+1) r)`` (rotary at
``w r``; CSA's entry ``w`` also reads window ``w - 1``'s ``Ca`` half, none for ``w = 0``); its queries see
only its own entries, HCA's ``w < (p+1)//r`` and CSA's indexer picks among them. A row of one sequence is
one document ``[0, S)``. Each entry is made on the rank where its window *ends* (``attention/pooled_kv.py``
runs the model's own compressor once per document piece there, on ``[halo | local]`` tokens); a rank
emits at most ``ceil(S_l / r)`` entries (windows are ``r`` tokens apart), so every rank pads its entries to
that many — a count every rank knows, however the documents fall — and one all-gather of
``[B, P ceil(S_l/r), D]`` brings them all; ``slots`` then picks each row's entries in document order
(``[B|1, T]``, ``T`` the most entries of a row; a row's padding points at slot 0 and is never seen). The
halo before a rank reaches back at most to the first window touching it (CSA: one window earlier), never
before its document's first token: ``r - 1`` tokens (CSA ``2 r - 1``), the fixed width every rank gathers.

Per query (packed rows only; ``None`` for one sequence): its document's first token (the sliding window
stops there, ``attention/pooled_core.py``) and its document's first entry (HCA's visible range starts
there), ``[B|1, S_l]`` each.

Shape legend: ``B`` batch, ``S`` full sequence, ``S_l`` tokens per rank, ``P`` sp size, ``r`` compress
rate, ``T`` pooled entries of the fullest row, ``D`` entry dim.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Piece:
    """The tokens ``[start, end)`` (global, whole windows) one compressor call pools for one document."""

    start: int
    end: int
    first: int
    """``start``'s position in its document: the rotary position of the first window."""
    drop: bool
    """CSA: the first window only lends its ``Ca`` half to the next entry; its own entry is dropped."""


@dataclass(frozen=True)
class Span:
    """This rank's queries ``[q0, q1)`` (global) of the document from token ``doc``, whose entries are
    ``[e0, e1)`` of its row."""

    doc: int
    q0: int
    q1: int
    e0: int
    e1: int


@dataclass
class RowPlan:
    """One group of rows sharing a document layout: ``rows`` (a slice of the batch) and this rank's work."""

    rows: slice
    pieces: list[Piece] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    slots: torch.Tensor | None = None
    """``[n]`` int64 on the host: where each of the row's entries lies in the gathered ``[B, P most, D]``, in document order."""


@dataclass
class PoolPlan:
    """One rank's pooling plan for one layer kind (``rate``, ``overlap``) and one forward's layout."""

    groups: list[RowPlan]
    most: int
    """Entries each rank contributes, padded: ``ceil(S_l / r)``."""
    width: int
    """Halo tokens any rank may take (the same on every rank)."""
    halo: int
    """This rank's halo: the tokens before its shard its first piece starts at."""
    slots: torch.Tensor
    """``[G, T]`` int64 (``G`` 1 or ``B``): each row's entries in the gathered tensor, in document order."""
    doc_first: torch.Tensor | None
    """``[G, S_l]`` each local query's document's first token (global); ``None``: one sequence per row."""
    entry_first: torch.Tensor | None
    """``[G, S_l]`` each local query's document's first entry in its row; ``None``: one sequence per row."""


def _row(rows: slice, lengths: list[int], rate: int, overlap: bool, lo: int, s_local: int, most: int) -> RowPlan:
    plan, starts, seq_len = RowPlan(rows), [0], sum(lengths)
    for n in lengths:
        starts.append(starts[-1] + n)
    counts = [(e - s) // rate for s, e in zip(starts, starts[1:])]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    first_doc = bisect_right(starts, lo) - 1
    for d in range(first_doc, len(lengths)):
        s, e, n = starts[d], starts[d + 1], counts[d]
        if s >= min(lo + s_local, seq_len):
            break
        plan.spans.append(Span(s, max(s, lo), min(e, lo + s_local), offsets[d], offsets[d] + n))
        wa, wb = max(0, (lo - s) // rate), min(n, (lo + s_local - s) // rate)  # windows ending on this rank
        if wb > wa:
            drop = overlap and wa > 0
            start = s + (wa - drop) * rate
            plan.pieces.append(Piece(start, s + wb * rate, start - s, drop))
    # every entry of the row: the rank its window ends on, its index among that rank's entries
    ends = torch.cat([s + rate * torch.arange(1, c + 1) - 1 for s, c in zip(starts, counts)] + [torch.zeros(0, dtype=torch.long)])
    rank = ends // s_local
    plan.slots = rank * most + torch.arange(len(ends)) - torch.searchsorted(rank, rank)
    return plan


def pool_plan(lengths: list[list[int]], batch: int, rate: int, overlap: bool, lo: int, s_local: int, size: int,
              device: torch.device) -> PoolPlan:  # fmt: skip
    """The plan of rows with documents ``lengths`` (one list per row, or one for all): this rank (first token
    ``lo``) of ``size`` ranks of ``s_local`` tokens, windows of ``rate`` (CSA: ``overlap``)."""
    same = len(lengths) == 1 or all(row == lengths[0] for row in lengths)
    rows = [(slice(None), lengths[0])] if same else [(slice(b, b + 1), lengths[b]) for b in range(batch)]
    most = -(-s_local // rate)
    groups = [_row(r, row, rate, overlap, lo, s_local, most) for r, row in rows]
    width = min((size - 1) * s_local, rate - 1 + (rate if overlap else 0))
    halo = max([0] + [lo - p.start for g in groups for p in g.pieces])
    t = max(len(g.slots) for g in groups)
    slots = torch.stack([torch.cat([g.slots, g.slots.new_zeros(t - len(g.slots))]) for g in groups]).to(device)
    packed = any(len(row) > 1 for row in lengths)
    doc_first = entry_first = None
    if packed:
        firsts, entries = [], []
        for g in groups:
            n = torch.tensor([sp.q1 - sp.q0 for sp in g.spans])  # host ints: their sum is S_l
            firsts.append(torch.repeat_interleave(torch.tensor([sp.doc for sp in g.spans]), n, output_size=s_local))
            entries.append(torch.repeat_interleave(torch.tensor([sp.e0 for sp in g.spans]), n, output_size=s_local))
        doc_first = torch.stack(firsts).to(device)
        entry_first = torch.stack(entries).to(device)
    return PoolPlan(groups, most, width, halo, slots, doc_first, entry_first)
