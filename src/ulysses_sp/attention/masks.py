"""Full-sequence attention masks for sequence-parallel attention, built from position ids.

Transformers builds its mask for the *local* shard; under Ulysses the core attention runs over the
*full* sequence, so its mask must come from the full sequence's ``position_ids``. Through
``UlyssesSPDataLoaderAdapter`` they arrive as host values with the batch (``parallel/doc_layout.py``,
``SeqLayout.from_host``: no collective, no host read of a device value); a model called directly
with only its local ``position_ids`` falls back to gathering them over the SP group once per forward
(``gather_positions``: a collective and host reads, i.e. device syncs). Position ids that restart at 0 mark packed documents: attention
stays within a document. A model's sliding window is applied on top. The form depends on the core
attention: ``None`` where the kernel's own ``is_causal`` path suffices (sdpa/flash, plain causal),
an additive float mask for eager, a ``BlockMask`` for flex attention. For sdpa with documents or a
window the blockwise core runs instead (``attention/core.py``): it takes the ``O(S)`` document ids,
not an ``S x S`` mask; ``mask_for`` still builds the dense boolean form on request (tests, eager).

Shape legend: ``B`` batch, ``S`` full sequence.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ulysses_sp.attention.positions import GIVEN, positions_problem, split_at_chunks
from ulysses_sp.attention.segments import segment_lengths
from ulysses_sp.parallel.comm import all_gather_seq
from ulysses_sp.parallel.doc_layout import HostLayout, layout_of
from ulysses_sp.parallel.mesh_shape import sp_token_order


@dataclass(frozen=True)
class SeqLayout:
    """What one forward's full-sequence position ids imply (computed once per forward)."""

    seq_len: int
    """``S``: the full sequence length (``S_l * P``)."""
    positions: torch.Tensor
    """``[B or 1, S]`` full-sequence position ids."""
    doc_ids: torch.Tensor | None
    """``[B or 1, S]`` document index per token when documents are packed, else ``None``."""
    host: HostLayout | None = None
    """The same layout as host ints when it came from the data adapter (``None``: gathered)."""
    span_ids: torch.Tensor | None = None
    """``[B, S]`` bidirectional span index per token, ``-1`` outside (``span_mask.py``), or ``None``."""

    @classmethod
    def from_host(cls, host: HostLayout, device: torch.device) -> SeqLayout:
        """The layout the adapter computed: ids built on the host and copied over, nothing read back."""
        return cls(host.seq_len, host.positions(device), host.doc_ids(device), host, host.span_ids(device))

    def split_at_chunks(self, chunk: int) -> SeqLayout:
        """The layout of chunked attention's segments (``positions.split_at_chunks``)."""
        if self.host is not None:
            return SeqLayout.from_host(self.host.split_at_chunks(chunk), self.positions.device)
        return SeqLayout.from_positions(split_at_chunks(self.positions, chunk))

    def doc_lengths(self) -> list[list[int]]:
        """Per row of ``doc_ids``: its documents' lengths (host ints; read back only without ``host``)."""
        if self.host is not None:
            return self.host.doc_lengths()
        return segment_lengths(self.doc_ids.cpu())

    @classmethod
    def from_positions(cls, positions: torch.Tensor) -> SeqLayout:
        """Layout of ``[B|1, S]`` full-sequence position ids; a restart at 0 starts a document
        (one host read: whether any row restarts; the fallback path)."""
        restarts = positions[:, 1:] == 0
        doc_ids = None
        if bool(restarts.any()):
            # [B|1, S]: the document index of every token.
            doc_ids = torch.cat([torch.zeros_like(positions[:, :1]), restarts.long().cumsum(-1)], dim=-1)
        return cls(positions.shape[-1], positions, doc_ids)


@dataclass
class ForwardState:
    """What one forward derives from its ``position_ids``: the layout and its masks.

    Held only while that ``position_ids`` tensor lives (a weak reference, released by its
    callback): for the step's forward and, under activation checkpointing, its recompute in
    backward; then freed, so a dense mask never outlives its step. The tensor's version counter
    is in ``key`` so in-place edits invalidate. Hits depend only on the program, identically on
    every rank.
    """

    source: weakref.ref
    key: tuple[int, int, bool]
    layout: SeqLayout
    masks: dict[tuple[Any, ...], Any] = field(default_factory=dict)


def seq_layout(
    position_ids: torch.Tensor, source: int, *, group: dist.ProcessGroup | None, batch: int, s_local: int,
    expected_len: int | None, ring_size: int = 1,
) -> SeqLayout:
    """The forward's full-sequence layout for local ``position_ids [B|1, S_l]``: the data adapter's
    host layout attached to them (``doc_layout.layout_of``; no collective, no host read of a device
    value), else the fallback: ``full_positions`` (a gather over ``group`` and host reads)."""
    host = layout_of(position_ids)
    sp_size = 1 if group is None else dist.get_world_size(group)
    if host is not None and (group is not None or host.seq_len == s_local):
        check_host_layout(host, tuple(position_ids.shape), s_local * sp_size, batch, expected_len)
        return SeqLayout.from_host(host, position_ids.device)
    positions = full_positions(position_ids, source, group=group, batch=batch, s_local=s_local,
                               expected_len=expected_len, ring_size=ring_size)  # fmt: skip
    return SeqLayout.from_positions(positions)


def full_positions(
    position_ids: torch.Tensor, source: int, *, group: dist.ProcessGroup | None, batch: int, s_local: int,
    expected_len: int | None, ring_size: int,
) -> torch.Tensor:
    """``[B|1, S_l] -> [B|1, S]`` in global token order: checked, gathered over the SP ``group``
    (``None``: no SP, the ids as they are) and, for the ring's zigzag shards, put back in order."""
    if position_ids.dim() != 2 or position_ids.shape[-1] != s_local or position_ids.shape[0] not in (1, batch):
        raise ValueError(
            f"position_ids must be [B, S_l] = [{batch}, {s_local}] (or [1, {s_local}]), got {tuple(position_ids.shape)}"
        )
    if group is None:
        return position_ids
    # [B|1, S_l] -> [B|1, S] in SP-rank order
    positions = gather_positions(position_ids, group, batch=batch, expected_len=expected_len, source=source)
    order = sp_token_order(positions.shape[-1], dist.get_world_size(group), ring_size)
    if order is not None:  # zigzag shards (ring): back to global order
        positions = positions.new_empty(positions.shape).index_copy_(-1, order.to(positions.device), positions)
    return positions


def check_host_layout(
    host: HostLayout, shape: tuple[int, ...], seq_len: int, batch: int, expected_len: int | None
) -> None:
    """Raise ``ValueError`` unless the adapter's layout ``host`` covers ``position_ids`` of ``shape``
    (``[B, S_l]``), ``S = seq_len`` and q's batch ``batch``. Local: every SP rank holds the same
    layout and ``S_l`` (the adapter agreed them per round), so every rank reaches the same verdict."""
    if shape != (batch, shape[-1]) or host.batch != batch or host.seq_len != seq_len:
        raise ValueError(
            f"the data adapter's layout (batch {host.batch}, S {host.seq_len}) does not match position_ids "
            f"{shape} of q's batch {batch} and S {seq_len}: pass the adapter's batches unchanged"
        )
    if expected_len is not None and seq_len != expected_len:
        raise ValueError(
            f"S ({seq_len}) != max_length ({expected_len}) with seq_length_is_variable=False; pad batches "
            "to that length or pass seq_length_is_variable=True"
        )


def gather_positions(
    position_ids: torch.Tensor,
    sp_group: dist.ProcessGroup,
    *,
    batch: int,
    expected_len: int | None,
    source: int = GIVEN,
) -> torch.Tensor:
    """``[B|1, S_l] -> [B|1, S]``: every rank's position ids of one sequence, checked.

    Every shape the exchanges need (``S_l``, the batch ``B`` of q/k/v, the position ids' batch) and
    how each rank's ids arrived (``source``, a ``positions`` code) are agreed first in one small
    gather: the position-id gather and the all-to-alls would abort inside the backend on a mismatch.
    Raises ``ValueError`` on every rank when the SP ranks' local lengths or batch sizes differ, when
    ``S`` is not ``expected_len`` (fixed-length runs), or when a rank's model was called without
    ``position_ids`` (``positions.positions_problem``).
    """
    s_local, sp_size = position_ids.shape[-1], dist.get_world_size(sp_group)
    # [1, 4] per rank -> [P, 4]: (S_l, B, position_ids batch, source)
    mine = torch.tensor([[s_local, batch, position_ids.shape[0], source]], device=position_ids.device)
    shapes = all_gather_seq(mine, sp_group, dim=0)
    problem = positions_problem(shapes[:, 3].tolist(), sp_size)
    if problem is not None:
        raise ValueError(problem)
    lengths = shapes[:, 0]
    if bool((lengths != s_local).any()):
        raise ValueError(
            f"local sequence lengths differ between SP ranks: {lengths.tolist()}; every rank of an SP "
            "group must hold S/P tokens of the same sequence (use UlyssesSPDataLoaderAdapter)"
        )
    if bool((shapes[:, 1:3] != shapes[0, 1:3]).any()):
        raise ValueError(
            f"batch sizes differ between SP ranks: {shapes[:, 1].tolist()} (position_ids batch "
            f"{shapes[:, 2].tolist()}); every rank of an SP group must hold the same samples' shards "
            "(use UlyssesSPDataLoaderAdapter, or give every rank of the group the same batch size)"
        )
    total = s_local * sp_size
    if expected_len is not None and total != expected_len:
        raise ValueError(
            f"S_l ({s_local}) * sp_size ({sp_size}) = {total} != max_length ({expected_len}) "
            "with seq_length_is_variable=False; pad batches to that length or pass seq_length_is_variable=True"
        )
    return all_gather_seq(position_ids, sp_group, dim=-1)  # [B|1, S_l] -> [B|1, S]


def mask_for(layout: SeqLayout, core: str, dtype: torch.dtype, sliding_window: int | None):
    """The attention mask the full sequence needs, in the form ``core`` expects.

    Returns ``None`` for plain causal attention where the kernel has an ``is_causal`` path (sdpa,
    flash), a boolean ``[B|1, 1, S, S]`` (True = attend) for sdpa, an additive float mask for eager.
    Bidirectional spans (``layout.span_ids``) as transformers' Gemma 3 composes them:
    ``(causal | same span) & window & same document``.
    """
    s = layout.seq_len
    device = layout.positions.device
    windowed = sliding_window is not None and s > sliding_window
    if core == "flex_attention":
        return flex_block_mask(layout, sliding_window if windowed else None)
    if layout.doc_ids is None and layout.span_ids is None and not windowed and core != "eager":
        return None
    idx = torch.arange(s, device=device)
    allowed = (idx[None, :] <= idx[:, None])[None]  # [1, S, S] causal: key <= query
    if layout.span_ids is not None:  # [B, S, 1] == [B, 1, S] -> [B, S, S]: or within one span
        span = layout.span_ids
        allowed = allowed | ((span[:, :, None] == span[:, None, :]) & (span[:, :, None] >= 0))
    if windowed:  # keys before the query: at most window - 1 back (later keys of a span stay visible)
        allowed = allowed & (idx[:, None] - idx[None, :] < sliding_window)
    allowed = allowed[:, None]  # [B|1, 1, S, S]
    if layout.doc_ids is not None:
        # [B|1, S] -> [B|1, 1, S, S]: attend only within the same document.
        allowed = allowed & (layout.doc_ids[:, None, :, None] == layout.doc_ids[:, None, None, :])
    if core == "eager":
        zero = torch.zeros((), dtype=dtype, device=device)
        return torch.where(allowed, zero, torch.finfo(dtype).min)
    return allowed


def flex_block_mask(layout: SeqLayout, window: int | None):
    """A flex-attention ``BlockMask`` for the full sequence: causal, within documents, windowed."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc, span = layout.doc_ids, layout.span_ids

    def mask_mod(b, h, q, k):
        keep = k <= q
        if span is not None:
            row = span[b if span.shape[0] > 1 else 0]
            keep = keep | ((row[q] == row[k]) & (row[q] >= 0))
        if window is not None:
            keep = keep & (q - k < window)
        if doc is not None:
            d = doc[b if doc.shape[0] > 1 else 0]
            keep = keep & (d[q] == d[k])
        return keep

    rows = max(1 if t is None else t.shape[0] for t in (doc, span))
    batch = rows if rows > 1 else None
    s = layout.seq_len
    return create_block_mask(mask_mod, batch, None, s, s, device=layout.positions.device)
