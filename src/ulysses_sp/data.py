"""Feeding a sequence-parallel group: the round-robin loader adapter, document packing, sampler order.

Where it sits in the step (DESIGN.md, step 2): an ordinary ``DataLoader`` yields full-length
batches ``[B, S]`` on every rank. ``UlyssesSPDataLoaderAdapter`` turns the ``P`` batches that the
``P`` ranks of one SP group loaded into ``P`` micro-steps: on micro-step ``i`` of a round every rank
of the group works on the batch SP rank ``i mod P`` loaded, rank ``k`` holding its tokens
``[k*S/P, (k+1)*S/P)``. Labels are shifted over the *full* sequence before sharding, so the loss
(``loss.sp_causal_lm_loss``) needs no communication beyond its ``(sum, count)`` reduction.

The pure helpers (``make_shift_labels``, ``prepare_batch``, ``shard_batch``) hold all the per-token
logic and run without a process group; the adapter adds only the exchange between ranks.
``PackingCollator`` builds packed batches (documents marked by restarting ``position_ids``) and
``sp_data_sampler`` the sampler whose order makes an ``sp = P`` run see the same global batches as
an ``sp = 1`` run.

Shape legend: ``B`` batch, ``S`` global (padded) sequence, ``S_l = S/P`` local sequence,
``P`` sp size, ``D`` dp size.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import Dataset, DistributedSampler

from .comm import all_gather_object, raise_if_any_rank_failed
from .loss import IGNORE_INDEX
from .mesh import mesh_info

__all__ = [
    "PackingCollator",
    "SPDistributedSampler",
    "UlyssesSPDataLoaderAdapter",
    "make_shift_labels",
    "prepare_batch",
    "shard_batch",
    "sp_data_sampler",
]

logger = logging.getLogger(__name__)

# Keys the adapter consumes; everything else is passed on (sharded or whole).
_CONSUMED = ("input_ids", "labels", "position_ids", "attention_mask")
_SAME_SHAPE_AS_INPUT = ("labels", "position_ids", "attention_mask")


# ----------------------------------------------------------------------------- pure per-token logic


def make_shift_labels(
    labels: torch.Tensor, position_ids: torch.Tensor | None = None, *, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Causal-LM targets over the full sequence: position ``t`` is labelled with ``labels[t+1]``.

    The last position gets ``ignore_index``; existing ``ignore_index`` labels stay. With
    ``position_ids``, a position followed by a document start (a ``0`` at ``t+1``) also gets
    ``ignore_index``, so no token is trained to predict the next document.

    Args:
        labels: ``[B, S]`` unshifted labels (usually ``input_ids``, ``-100`` where not trained).
        position_ids: ``[B, S]`` or ``None``.

    Returns:
        ``[B, S]`` int64 ``shift_labels``.
    """
    # [B, S] -> [B, S]: drop the first label, append ignore_index at the end.
    shifted = F.pad(labels[:, 1:].long(), (0, 1), value=ignore_index)
    if position_ids is not None:
        starts = position_ids[:, 1:] == 0  # [B, S-1]: token t+1 opens a document
        shifted[:, :-1].masked_fill_(starts, ignore_index)
    return shifted


def _is_seq(t: torch.Tensor, batch: int, seqlen: int) -> bool:
    """A tensor is per-token (sharded along dim 1) when its leading dims are ``[B, S]``."""
    return t.dim() >= 2 and tuple(t.shape[:2]) == (batch, seqlen)


def _check_batch(batch: Any) -> torch.Tensor:
    """Validate one rank's batch; return its ``input_ids``. Raises ``ValueError`` naming the problem."""
    if not isinstance(batch, Mapping):
        raise ValueError(
            f"each batch must be a dict with 'input_ids' [B, S] (and optionally labels, position_ids, "
            f"attention_mask), got {type(batch).__name__}"
        )
    if "input_ids" not in batch:
        raise ValueError(f"batch has no 'input_ids' (keys: {sorted(map(str, batch))})")
    ids = batch["input_ids"]
    if not torch.is_tensor(ids) or ids.dim() != 2 or ids.shape[1] == 0:
        what = tuple(ids.shape) if torch.is_tensor(ids) else type(ids).__name__
        raise ValueError(f"'input_ids' must be a non-empty [B, S] tensor, got {what}")
    if "shift_labels" in batch:
        raise ValueError(
            "batch already has 'shift_labels'; pass unshifted 'labels' (the adapter shifts them)"
        )
    for key in _SAME_SHAPE_AS_INPUT:
        t = batch.get(key)
        if t is not None and (not torch.is_tensor(t) or t.shape != ids.shape):
            what = tuple(t.shape) if torch.is_tensor(t) else type(t).__name__
            raise ValueError(
                f"'{key}' has shape {what} but input_ids is [B, S] = {tuple(ids.shape)}; expected the same"
            )
    b, s = ids.shape
    for key, t in batch.items():
        if torch.is_tensor(t) and t.dim() >= 2 and t.shape[1] == s and t.shape[0] != b:
            raise ValueError(
                f"'{key}' has shape {tuple(t.shape)}: a tensor with the sequence length {s} at dim 1 "
                f"must have the batch size {b} of input_ids at dim 0"
            )
    return ids


def prepare_batch(
    batch: Mapping[str, Any], sp_size: int, *, pad_token_id: int = 0, strict: bool = False
) -> dict[str, Any]:
    """Turn one full-sequence batch into the adapter's output format, before sharding.

    Steps: labels default to ``input_ids``; positions where ``attention_mask == 0`` become
    ``-100``; ``position_ids`` default to ``arange(S)``; a length not divisible by ``sp_size`` is
    padded to the next multiple (``pad_token_id``, labels ``-100``, positions continuing, other
    per-token tensors ``0``) or, with ``strict``, rejected; labels are shifted
    (``make_shift_labels``, honouring document starts). ``labels`` and ``attention_mask`` are
    dropped; other entries are kept (per-token tensors padded).

    Returns:
        ``{"input_ids": [B, S], "position_ids": [B, S], "shift_labels": [B, S], **others}`` with
        ``S`` a multiple of ``sp_size``.

    Raises:
        ValueError: malformed batch, or (``strict``) ``S % sp_size != 0`` — the message names the
            length, ``sp_size`` and the padded length.
    """
    ids = _check_batch(batch)
    b, s = ids.shape
    labels = batch.get("labels")
    labels = (ids if labels is None else labels).long()
    mask = batch.get("attention_mask")
    if mask is not None:
        labels = labels.masked_fill(mask == 0, IGNORE_INDEX)
    pos = batch.get("position_ids")
    if pos is None:
        pos = torch.arange(s, device=ids.device).repeat(b, 1)
    padded = math.ceil(s / sp_size) * sp_size
    n = padded - s
    if n and strict:
        raise ValueError(
            f"sequence length {s} is not divisible by sequence_parallel_size {sp_size}; pad to {padded}"
        )
    if n:
        ids = F.pad(ids, (0, n), value=pad_token_id)
        labels = F.pad(labels, (0, n), value=IGNORE_INDEX)
        # [B, S] -> [B, S + n]: positions continue from each row's last one (no new document).
        pos = torch.cat(
            [pos, pos[:, -1:] + torch.arange(1, n + 1, device=pos.device, dtype=pos.dtype)], dim=1
        )
    out: dict[str, Any] = {
        "input_ids": ids,
        "position_ids": pos,
        "shift_labels": make_shift_labels(labels, pos),
    }
    for key, value in batch.items():
        if key in _CONSUMED:
            continue
        if n and torch.is_tensor(value) and _is_seq(value, b, s):
            # pad dim 1 only: F.pad lists dims from the last one backwards.
            value = F.pad(value, (0, 0) * (value.dim() - 2) + (0, n))
        out[key] = value
    return out


def shard_batch(batch: Mapping[str, Any], sp_rank: int, sp_size: int) -> dict[str, Any]:
    """Rank ``sp_rank``'s share of a prepared batch: tokens ``[k*S/P, (k+1)*S/P)`` of every
    per-token tensor (``[B, S, ...] -> [B, S_l, ...]``); other tensors and non-tensors whole."""
    b, s = batch["input_ids"].shape
    if s % sp_size:
        raise ValueError(
            f"sequence length {s} is not divisible by sp_size {sp_size}; use prepare_batch first"
        )
    local = s // sp_size
    lo = sp_rank * local
    return {
        k: v[:, lo : lo + local] if torch.is_tensor(v) and _is_seq(v, b, s) else v for k, v in batch.items()
    }


# ----------------------------------------------------------------------------- the adapter


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

    ``S`` may differ between ranks and steps. Each yielded shard is moved to ``device`` when it is
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
        device: where yielded shards go (``mesh.default_device()``).
        pad_token_id: id used to pad a length not divisible by ``P``.
        strict: raise ``ValueError`` instead of padding such a length.

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
    ) -> None:
        self.dl = dl
        self.sp_rank = sp_rank
        self.sp_group = sp_group
        self.sp_world_size = sp_world_size
        self.device = torch.device(device)
        self.pad_token_id = pad_token_id
        self.strict = strict
        self._default_pass: Iterator[dict[str, Any]] | None = None
        self._logged_padding = False
        self._check_group()

    def _check_group(self) -> None:
        p = self.sp_world_size
        if isinstance(p, bool) or not isinstance(p, int) or p < 1:
            raise ValueError(f"sp_world_size must be a positive int, got {self.sp_world_size!r}")
        if self.sp_group is None:
            if self.sp_world_size != 1 or self.sp_rank != 0:
                raise ValueError(
                    f"sp_group is None but sp_world_size={self.sp_world_size}, sp_rank={self.sp_rank}; "
                    "pass the sequence-parallel group (mesh.sp_group(mesh))"
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
                yield {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in shard.items()}

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
                prepared = prepare_batch(
                    batch, self.sp_world_size, pad_token_id=self.pad_token_id, strict=self.strict
                )
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
            logger.warning(
                "sequence length %d is not divisible by sequence_parallel_size %d; padded to %d "
                "(pad id %d, labels -100); logged once, strict=True raises instead",
                s, self.sp_world_size, padded, self.pad_token_id,
            )  # fmt: skip

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
        """One ``all_to_all``: shard ``k`` of this rank's batch to rank ``k``; the shards of every rank's
        batch (rank order) back, kept on CPU."""
        p = self.sp_world_size
        backend = dist.get_backend(self.sp_group)
        comm_device = self.device if self.device.type != "cpu" and backend != "gloo" else torch.device("cpu")
        # Send buffer: for destination k, shard k of every per-token tensor and every other tensor whole,
        # each as raw bytes, in the batch's key order.
        pieces = [shard_batch(prepared, k, p) for k in range(p)]
        send_parts, in_splits = [], []
        for piece in pieces:
            parts = [
                v.contiguous().reshape(-1).view(torch.uint8) for v in piece.values() if torch.is_tensor(v)
            ]
            send_parts += parts
            in_splits.append(sum(t.numel() for t in parts))
        send = torch.cat(send_parts).to(comm_device)
        del pieces, send_parts
        tensor_metas = [[(k, m) for k, m in meta.items() if m[0] == "tensor"] for meta in metas]
        out_splits = [sum(_piece_nbytes(m, p) for _, m in tm) for tm in tensor_metas]
        recv = torch.empty(sum(out_splits), dtype=torch.uint8, device=comm_device)
        dist.all_to_all_single(recv, send, out_splits, in_splits, group=self.sp_group)
        del send
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


# ----------------------------------------------------------------------------- packing


class PackingCollator:
    """Collate tokenized documents into one packed sequence ``[1, L]`` with restarting positions.

    Each feature is a document: a dict with ``input_ids`` (and optionally ``labels``), or a plain
    sequence / 1-D tensor of token ids. Documents are concatenated in order; ``position_ids``
    restart at ``0`` at every document, which is how the SP attention (and transformers' own
    packed-sequence support) keeps attention inside a document and how ``make_shift_labels``
    knows where not to predict across a boundary. ``labels`` are ``-100`` at the first token of
    each document (so a model's own shifted loss without the adapter is also correct) and at
    padding.

    Args:
        max_length: if given, the packed row is exactly this long: truncated (the tail is dropped,
            logged once) or padded; if ``None``, the row is as long as the documents.
        pad_token_id: id used for padding.
        pad_to_multiple_of: round the length up to a multiple of this (e.g. ``sp_size``); ignored
            with ``max_length``.

    Padding continues the last document's positions (it opens no new document) and is never
    attended to by real tokens under the causal mask.
    """

    def __init__(self, max_length: int | None = None, *, pad_token_id: int = 0, pad_to_multiple_of: int = 1):
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length must be >= 1 or None, got {max_length}")
        if pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
        self.max_length = max_length
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self._logged_truncation = False

    def __call__(self, features: Sequence[Any]) -> dict[str, torch.Tensor]:
        ids, labels, pos = [], [], []
        for f in features:
            raw = f["input_ids"] if isinstance(f, Mapping) else f
            doc = torch.as_tensor(raw, dtype=torch.long).reshape(-1)
            if doc.numel() == 0:
                continue
            lab = torch.as_tensor(f.get("labels", doc) if isinstance(f, Mapping) else doc, dtype=torch.long)
            lab = lab.reshape(-1).clone()
            if lab.shape != doc.shape:
                raise ValueError(
                    f"document labels {tuple(lab.shape)} and input_ids {tuple(doc.shape)} differ"
                )
            lab[0] = IGNORE_INDEX  # nothing before a document start predicts it
            ids.append(doc)
            labels.append(lab)
            pos.append(torch.arange(doc.numel()))
        if not ids:
            raise ValueError("PackingCollator got no non-empty documents")
        ids_row, labels_row, pos_row = torch.cat(ids), torch.cat(labels), torch.cat(pos)
        total = ids_row.numel()
        length = self.max_length or math.ceil(total / self.pad_to_multiple_of) * self.pad_to_multiple_of
        if total > length:
            if not self._logged_truncation:
                self._logged_truncation = True
                logger.warning("packed documents have %d tokens > max_length %d; truncating (logged once)",
                               total, length)  # fmt: skip
            ids_row, labels_row, pos_row = ids_row[:length], labels_row[:length], pos_row[:length]
        n = length - ids_row.numel()
        if n:
            ids_row = F.pad(ids_row, (0, n), value=self.pad_token_id)
            labels_row = F.pad(labels_row, (0, n), value=IGNORE_INDEX)
            pos_row = torch.cat([pos_row, pos_row[-1] + torch.arange(1, n + 1)])
        # [L] -> [1, L]
        return {"input_ids": ids_row[None], "labels": labels_row[None], "position_ids": pos_row[None]}


# ----------------------------------------------------------------------------- deterministic order


class SPDistributedSampler(DistributedSampler):
    """A ``DistributedSampler`` over all ``D * P`` ranks whose order matches an ``sp = 1`` run.

    ``num_replicas = D * P`` and ``rank = sp_rank * D + dp_rank``. Take the stream of samples that
    data-parallel replica ``d`` of an ``sp = 1`` run (``D`` replicas, same seed) would see, cut it
    into batches of ``batch_size``, and deal the batches round-robin to the ``P`` SP ranks of
    replica ``d``: SP rank ``k`` gets batches ``k, k + P, k + 2P, ...``. The adapter then processes
    them in the order ``(j, k)`` = batch ``j*P + k`` — exactly the ``sp = 1`` order. With
    ``batch_size = 1`` this is the plain ``DistributedSampler`` at that rank: rank ``(d, k)``'s
    ``j``-th sample is global sample ``(j*P + k)*D + d`` of the (shuffled) order.

    Lengths are rounded to whole rounds of ``D * P * batch_size`` samples (padding by repeating
    samples, or dropping the tail with ``drop_last``) so that every rank has the same number of
    full batches. ``set_epoch`` works as usual.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        dp_size: int,
        sp_size: int,
        dp_rank: int,
        sp_rank: int,
        batch_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        for name, size, rank in (("dp", dp_size, dp_rank), ("sp", sp_size, sp_rank)):
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"{name}_rank ({rank}) must be in [0, {name}_size ({size}))")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        super().__init__(
            dataset, num_replicas=dp_size * sp_size, rank=sp_rank * dp_size + dp_rank,
            shuffle=shuffle, seed=seed, drop_last=drop_last,
        )  # fmt: skip
        self.dp_size, self.sp_size, self.dp_rank, self.sp_rank = dp_size, sp_size, dp_rank, sp_rank
        self.batch_size = batch_size
        per_round = self.num_replicas * batch_size
        rounds = len(dataset) // per_round if drop_last else math.ceil(len(dataset) / per_round)  # type: ignore[arg-type]
        self.num_samples = rounds * batch_size
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:  # the same permutation as DistributedSampler (seed + epoch)
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        if self.total_size > n:
            order = (order * math.ceil(self.total_size / max(n, 1)))[: self.total_size]
        order = order[: self.total_size]
        stream = order[self.dp_rank :: self.dp_size]  # what sp=1 replica dp_rank would see
        b = self.batch_size
        mine = [
            stream[j * b + t] for j in range(self.sp_rank, len(stream) // b, self.sp_size) for t in range(b)
        ]
        assert len(mine) == self.num_samples
        return iter(mine)


def sp_data_sampler(
    dataset: Dataset,
    mesh: Any | None = None,
    *,
    dp_size: int | None = None,
    sp_size: int | None = None,
    dp_rank: int | None = None,
    sp_rank: int | None = None,
    batch_size: int = 1,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
) -> SPDistributedSampler:
    """The sampler for one rank's ``DataLoader`` under ``(dp, sp)`` parallelism.

    With it, a run with ``sp = P`` and the adapter processes the same global batches in the same
    order as a run with ``sp = 1`` and the same ``dp`` (see ``SPDistributedSampler``). Use the
    loader's ``batch_size`` as ``batch_size`` here.

    Args:
        dataset: a map-style dataset.
        mesh: a ``(data_parallel, sequence_parallel)`` ``DeviceMesh`` or an ``mpu``; or give all four
            of ``dp_size, sp_size, dp_rank, sp_rank``.
    """
    given = (dp_size, sp_size, dp_rank, sp_rank)
    if mesh is not None:
        if any(v is not None for v in given):
            raise ValueError("pass either mesh (or mpu) or dp_size/sp_size/dp_rank/sp_rank, not both")
        if hasattr(mesh, "get_sequence_parallel_world_size"):
            dp_size, sp_size = mesh.get_data_parallel_world_size(), mesh.get_sequence_parallel_world_size()
            dp_rank, sp_rank = mesh.get_data_parallel_rank(), mesh.get_sequence_parallel_rank()
        else:
            info = mesh_info(mesh)
            dp_size, sp_size, dp_rank, sp_rank = info.dp_size, info.sp_size, info.dp_rank, info.sp_rank
    elif any(v is None for v in given):
        raise ValueError(f"without a mesh give dp_size, sp_size, dp_rank and sp_rank; got {given}")
    return SPDistributedSampler(
        dataset, dp_size=dp_size, sp_size=sp_size, dp_rank=dp_rank, sp_rank=sp_rank,
        batch_size=batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
    )  # fmt: skip
