"""Per-token batch logic of the SP data path, pure (no process group): label shift, padding, sharding.

``prepare_batch`` turns one full-sequence batch ``[B, S]`` into what the model and loss consume
(``input_ids``, ``position_ids``, pre-shifted ``shift_labels``; ``S`` padded to a multiple of ``P``),
and ``shard_batch`` cuts rank ``k``'s tokens ``[k*S/P, (k+1)*S/P)`` out of it. The adapter runs
these on each rank's own batch before the exchange; an ``sp = 1`` reference run can use them too.

Shape legend: ``B`` batch, ``S`` global (padded) sequence, ``S_l = S/P`` local sequence, ``P`` sp size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ulysses_sp.checks import check_seq_len_divisible
from ulysses_sp.parallel.loss import IGNORE_INDEX
from ulysses_sp.parallel.mesh_shape import seq_multiple, shard_spans

_CONSUMED = ("input_ids", "labels", "position_ids", "attention_mask")
_SAME_SHAPE_AS_INPUT = ("labels", "position_ids", "attention_mask")


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
    mask = batch.get("attention_mask")
    if mask is not None:
        _check_right_padded(mask)
    return ids


def _check_right_padded(mask: torch.Tensor) -> None:
    """Raise unless every row of ``attention_mask`` is real tokens followed only by padding.

    The SP path drops ``attention_mask`` (the full-sequence structure comes from ``position_ids``),
    which is exact for right padding (causal attention never looks ahead, and padded positions
    carry no label) but not for padding before real tokens (left padding, gaps).
    """
    real = mask != 0
    # [B, S-1]: a padded position followed by a real one
    gap = (~real[:, :-1] & real[:, 1:]).any(dim=1)
    if bool(gap.any()):
        rows = gap.nonzero().flatten().tolist()
        raise ValueError(
            f"attention_mask rows {rows} have padding before real tokens (left padding or gaps), which "
            "sequence parallelism cannot shard: it drops attention_mask and takes the sequence "
            "structure from position_ids; pad on the right (tokenizer.padding_side = 'right') or pass "
            "padding-free batches (documents concatenated, position_ids restarting at 0)"
        )


def prepare_batch(
    batch: Mapping[str, Any], sp_size: int, *, pad_token_id: int = 0, strict: bool = False, ring_size: int = 1
) -> dict[str, Any]:
    """Turn one full-sequence batch into the adapter's output format, before sharding.

    Steps: labels default to ``input_ids``; positions where ``attention_mask == 0`` become
    ``-100``; ``position_ids`` default to ``arange(S)``; a length not divisible by ``sp_size`` is
    padded to the next multiple (``pad_token_id``, labels ``-100``, positions continuing, other
    per-token tensors ``0``) or, with ``strict``, rejected; labels are shifted
    (``make_shift_labels``, honouring document starts). ``labels`` and ``attention_mask`` are
    dropped; other entries are kept (per-token tensors padded). With a ring (``ring_size > 1``) the
    length is padded to a multiple of ``2 * sp_size`` (``mesh_shape.seq_multiple``: zigzag chunks).

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
    multiple = seq_multiple(sp_size, ring_size)
    padded = math.ceil(s / multiple) * multiple
    n = padded - s
    if strict:
        check_seq_len_divisible(s, sp_size, ring_size, fix="pad to")
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


def shard_batch(batch: Mapping[str, Any], sp_rank: int, sp_size: int, ring_size: int = 1) -> dict[str, Any]:
    """Rank ``sp_rank``'s share of a prepared batch: tokens ``[k*S/P, (k+1)*S/P)`` of every
    per-token tensor (``[B, S, ...] -> [B, S_l, ...]``), or with a ring its zigzag tokens
    (``mesh_shape.shard_spans``); other tensors and non-tensors whole."""
    b, s = batch["input_ids"].shape
    check_seq_len_divisible(s, sp_size, ring_size, fix="pad (prepare_batch) to")
    spans = shard_spans(s, sp_rank, sp_size, ring_size)

    def cut(v: torch.Tensor) -> torch.Tensor:
        pieces = [v[:, a:e] for a, e in spans]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)

    return {k: cut(v) if torch.is_tensor(v) and _is_seq(v, b, s) else v for k, v in batch.items()}
