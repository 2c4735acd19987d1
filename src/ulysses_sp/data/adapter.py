"""``UlyssesSPDataLoaderAdapter``: the round-robin exchange of batches inside an SP group.

Where it sits in the step (DESIGN.md, step 2): every rank's ``DataLoader`` yields a full-length
batch; per round the adapter prepares its own batch (``shard.prepare_batch``), agrees on errors
and metadata with the group, and exchanges shards with one ``all_to_all`` so that on micro-step
``i`` every rank holds its shard of the batch SP rank ``i`` loaded.

Shape legend: ``B`` batch, ``S`` global (padded) sequence, ``S_l = S/P`` local sequence, ``P`` sp size.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ulysses_sp.checks import check_seq_len_divisible, positive_int
from ulysses_sp.data.shard import _is_seq, prepare_batch, shard_batch
from ulysses_sp.parallel.comm import all_gather_object, exchange_bytes, raise_if_any_rank_failed
from ulysses_sp.parallel.doc_layout import attach_layout, bidirectional_spans, host_layout
from ulysses_sp.parallel.mesh import ring_size_of

logger = logging.getLogger(__name__)

_LAYOUT = "__ulysses_sp_layout__"
"""The prepared batch's ``HostLayout`` (exchanged with the round's metadata; never yielded as a key)."""
REAL_TOKENS = "__ulysses_sp_real_tokens__"
"""The loaded batch's ``real_tokens`` (a host int, exchanged with the round's metadata like ``_LAYOUT``;
never yielded as a key: ``last_real_tokens`` holds it)."""


def real_tokens(batch: Mapping[str, Any]) -> int:
    """The real (non-padding) tokens of one loaded batch, from host metadata: the ones of its
    ``attention_mask [B, S]`` (right padding marked ``0``, as collators and ``PackedDataset`` mark it),
    else all ``B * S`` tokens of ``input_ids``. The padding ``prepare_batch`` adds (``S`` to a
    multiple of ``P``) is never counted. Read in the data path, before the batch reaches the device."""
    mask = batch.get("attention_mask")
    if torch.is_tensor(mask):
        return int(mask.count_nonzero())
    return int(batch["input_ids"].numel())


def _describe(batch: Mapping[str, Any]) -> dict[str, tuple]:
    """Small metadata of a prepared batch for the exchange: tensors by shape/dtype, objects by value."""
    b, s = batch["input_ids"].shape
    return {
        k: ("tensor", tuple(v.shape), v.dtype, _is_seq(v, b, s)) if torch.is_tensor(v) else ("object", v)
        for k, v in batch.items()
    }


def _piece_nbytes(meta: tuple, sp_size: int) -> int:
    """Bytes of the piece one destination rank receives of a tensor described by ``meta``."""
    _, shape, dtype, is_seq = meta
    numel = math.prod(shape) // (sp_size if is_seq else 1)
    return numel * dtype.itemsize


class UlyssesSPDataLoaderAdapter:
    """Wrap a ``DataLoader`` so that the SP group works through its ranks' batches one by one.

    Every rank's loader yields its own batch (a dict with ``input_ids [B, S]``; optionally
    ``labels``, ``position_ids``, ``attention_mask``, other tensors, non-tensor values). Per round
    the group exchanges metadata (lengths, shapes, errors, non-tensor values) and then the token
    shards, after which micro-step ``i`` of the round yields, on SP rank ``k``, shard ``k`` of the
    batch SP rank ``i`` loaded::

        {"input_ids": [B, S_l], "position_ids": [B, S_l], "shift_labels": [B, S_l], **passthrough}

    ``S`` may differ between ranks and steps. The full sequence's document layout
    (``parallel/doc_layout.py``) travels with the round's metadata and is attached to the yielded
    ``position_ids``: the SP attention and the mixers take it from there, with no collective and no
    host read of a device value inside the model. ``last_real_tokens`` is the real (non-padding) token
    count of the batch the last yielded shard belongs to (``real_tokens``; the same on every rank of
    the group), for an honest tokens/s. Each yielded shard is moved to ``device`` when it is
    yielded; the other shards of the round wait on CPU. ``len(adapter) == len(dl) * sp_world_size``.

    Exchange: each rank prepares its own batch locally (shift, pad, positions: the full sequence
    is needed for the shift, and it is there), then one ``all_to_all`` sends shard ``k`` to rank
    ``k`` — every tensor of the batch packed into a single byte buffer, so there is one tensor
    collective per round whatever the keys and dtypes, and uneven lengths need no padding. This
    moves ``B*S`` tokens per rank instead of the ``P*B*S`` an all-gather of whole batches would,
    and never materialises the other ranks' full batches.

    Args:
        dl: any iterable of batches with ``len`` (a ``DataLoader``); every SP rank's must have the
            same length and batch size — see ``sp_data_sampler``.
        sp_rank: this rank's rank in ``sp_group``.
        sp_group: the sequence-parallel group (``None`` only with ``sp_world_size == 1``).
        sp_world_size: ``P``; must equal the size of ``sp_group``.
        device: where yielded shards go (``SPMesh.device``).
        pad_token_id: id used to pad a length not divisible by ``P``.
        strict: raise ``ValueError`` instead of padding such a length.
        ring_size: the hybrid Ulysses x Ring layout's ring size; ``None``: the ring size of the
            ``init_mesh`` layout whose ``sp_group`` this is (the one the attention was registered
            on), so the shards have the zigzag token order the ring attention expects.
        bidirectional_spans_key: the batch key (e.g. ``"token_type_ids"`` for Gemma 3) whose runs of 1
            mark tokens that attend to each other bidirectionally (image blocks): found on the host once
            per step and shipped in the layout (``doc_layout.bidirectional_spans``); ``None``: causal only.

    Raises:
        ValueError: on every rank of the group when any rank's input is bad (see ``prepare_batch``;
            also batch sizes or keys differing between SP ranks, loaders of different lengths,
            ``sp_rank``/``sp_world_size`` disagreeing with the group).
    """

    def __init__(
        self,
        dl: Iterable[Any],
        sp_rank: int,
        sp_group: dist.ProcessGroup | None,
        sp_world_size: int,
        device: torch.device | str,
        *,
        pad_token_id: int = 0,
        strict: bool = False,
        ring_size: int | None = None,
        bidirectional_spans_key: str | None = None,
    ) -> None:
        self.dl = dl
        self.spans_key = bidirectional_spans_key
        """The batch key whose runs of 1 are bidirectional spans (Gemma 3: ``"token_type_ids"``); ``None``: none."""
        self.sp_rank = sp_rank
        self.sp_group = sp_group
        self.sp_world_size = sp_world_size
        self.device = torch.device(device)
        self.pad_token_id = pad_token_id
        self.strict = strict
        self._default_pass: Iterator[dict[str, Any]] | None = None
        self._logged_padding = False
        self.last_real_tokens = 0
        """Real tokens of the whole batch whose shard was yielded last (``real_tokens``: host int)."""
        self._check_group()
        self.ring_size = ring_size_of(sp_group) if ring_size is None else positive_int("ring_size", ring_size)
        """Ring groups of the hybrid layout: ``> 1`` shards each sequence in zigzag order."""

    def _check_group(self) -> None:
        positive_int("sp_world_size", self.sp_world_size)
        if self.sp_group is None:
            if self.sp_world_size != 1 or self.sp_rank != 0:
                raise ValueError(
                    f"sp_group is None but sp_world_size={self.sp_world_size}, sp_rank={self.sp_rank}; "
                    "pass the sequence-parallel group (SPMesh.sp_group)"
                )
            return
        size, rank = dist.get_world_size(self.sp_group), dist.get_rank(self.sp_group)
        error = None
        if self.sp_world_size != size:
            error = f"sp_world_size ({self.sp_world_size}) != size of sp_group ({size})"
        elif self.sp_rank != rank:
            error = f"sp_rank ({self.sp_rank}) != this rank's rank in sp_group ({rank})"
        # Only some ranks may have passed a wrong value: agree before any batch collective.
        raise_if_any_rank_failed(error, self.sp_group)

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """A new pass over ``dl`` (one epoch): ``len(dl)`` rounds of ``P`` micro-steps."""
        return self._pass()

    def __next__(self) -> dict[str, Any]:
        """The reference system's style, ``next(adapter)``: continues one default pass."""
        if self._default_pass is None:
            self._default_pass = self._pass()
        return next(self._default_pass)

    def _pass(self) -> Iterator[dict[str, Any]]:
        it = iter(self.dl)
        while (shards := self._refill(it)) is not None:
            current = deque(shards)  # only this round is held, on CPU
            del shards
            while current:
                shard = current.popleft()
                layout = shard.pop(_LAYOUT, None)
                self.last_real_tokens = shard.pop(REAL_TOKENS, 0)
                host = getattr(layout, "host_keys", ())  # a VLM's pixels: each rank uploads only the rows it encodes
                out = {k: v.to(self.device) if torch.is_tensor(v) and k not in host else v for k, v in shard.items()}
                if layout is not None and hasattr(layout, "attach"):  # a VLM's (vlm.layout): on its input_ids
                    layout.attach(out)
                elif layout is not None:  # on the tensor the model gets (after the move)
                    attach_layout(out["position_ids"], layout)
                yield out

    def _refill(self, it: Iterator[Any]) -> list[dict[str, Any]] | None:
        """Load one batch per rank and exchange: this rank's ``P`` shards of the next round, or
        ``None`` when every rank's loader is exhausted."""
        prepared, error, exhausted = None, None, False
        try:
            batch = next(it)
        except StopIteration:
            exhausted = True
        if not exhausted:
            try:
                prepared = prepare_batch(batch, self.sp_world_size, pad_token_id=self.pad_token_id,
                                         strict=self.strict, ring_size=self.ring_size)  # fmt: skip
                types = prepared.get(self.spans_key) if self.spans_key else None  # [B, S] on the host
                spans = None if types is None else bidirectional_spans(types)  # image blocks: once per step
                prepared[_LAYOUT] = host_layout(prepared["position_ids"], spans=spans)  # shipped with the metadata
                prepared[REAL_TOKENS] = real_tokens(batch)  # so does the count (an object of the metadata)
            except ValueError as e:
                error = str(e)
        if self.sp_group is None:  # no sequence parallelism: nothing to exchange
            if error is not None:
                raise ValueError(error)
            if exhausted:
                return None
            self._log_padding(batch, prepared)
            return [prepared]
        raise_if_any_rank_failed(error, self.sp_group)
        metas = all_gather_object(None if exhausted else _describe(prepared), self.sp_group)
        if all(m is None for m in metas):
            return None
        self._check_round(metas)
        self._log_padding(batch, prepared)
        return self._exchange(prepared, metas)

    def _log_padding(self, batch: Mapping[str, Any], prepared: dict[str, Any]) -> None:
        s, padded = batch["input_ids"].shape[1], prepared["input_ids"].shape[1]
        if s != padded and not self._logged_padding:
            self._logged_padding = True
            try:
                check_seq_len_divisible(s, self.sp_world_size, fix="pad to")
            except ValueError as e:  # the rule's own words, as a warning: padding makes it hold
                logger.warning("%s: padded to %d (pad id %d, labels -100); logged once, strict=True raises instead",
                               e, padded, self.pad_token_id)  # fmt: skip

    def _check_round(self, metas: list[dict[str, tuple] | None]) -> None:
        """Cross-rank checks on the gathered metadata: the same verdict on every rank, no collective."""
        done = [r for r, m in enumerate(metas) if m is None]
        if done:
            raise ValueError(
                f"the SP group's loaders have different lengths: rank(s) {done} of the group ran out of "
                "batches while the others had one; give every SP rank the same number of batches "
                "(sp_data_sampler does)"
            )
        sizes = [m["input_ids"][1][0] for m in metas]
        if len(set(sizes)) > 1:
            raise ValueError(
                f"batch size differs between SP ranks: input_ids batch sizes {sizes} (by SP rank); every "
                "SP rank's loader must yield the same batch size"
            )
        keys = [sorted(m) for m in metas]
        if any(k != keys[0] for k in keys):
            raise ValueError(f"batch keys differ between SP ranks: {keys} (by SP rank)")

    def _exchange(self, prepared: dict[str, Any], metas: list[dict[str, tuple]]) -> list[dict[str, Any]]:
        """One byte all-to-all: shard ``k`` of this rank's batch to rank ``k``; the shards of every rank's
        batch (rank order) back, kept on CPU."""
        p = self.sp_world_size
        # For destination k: shard k of every per-token tensor and every other tensor whole, in the
        # batch's key order (every rank describes its batch in that order, see _describe).
        r = self.ring_size
        pieces = [[v for v in shard_batch(prepared, k, p, r).values() if torch.is_tensor(v)] for k in range(p)]
        tensor_metas = [[(k, m) for k, m in meta.items() if m[0] == "tensor"] for meta in metas]
        recv_nbytes = [sum(_piece_nbytes(m, p) for _, m in tm) for tm in tensor_metas]
        recv = exchange_bytes(pieces, recv_nbytes, self.sp_group, self.device)
        del pieces
        shards, offset = [], 0
        for meta in metas:
            shard: dict[str, Any] = {}
            for key, m in meta.items():
                if m[0] == "object":
                    shard[key] = m[1]
                    continue
                _, shape, dtype, is_seq = m
                n = _piece_nbytes(m, p)
                # copy to CPU (own storage, aligned) before reinterpreting the bytes
                data = recv[offset : offset + n].to("cpu", copy=True).view(dtype)
                offset += n
                # [numel] -> [B, S_l, ...] for per-token tensors, the original shape otherwise
                shard[key] = data.reshape((shape[0], shape[1] // p, *shape[2:]) if is_seq else shape)
            shards.append(shard)
        return shards
