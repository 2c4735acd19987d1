"""``PackingCollator``: several tokenized documents in one sequence, marked by restarting positions."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ulysses_sp.parallel.loss import IGNORE_INDEX

logger = logging.getLogger(__name__)


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
