"""The embedded ``recall`` task: a random span stated early, recalled late.

One sample of ``S`` tokens (ids of the byte tokenizer, so it decodes to bytes)::

    <bos> x_1 x_2 ... x_m  |  x_1 x_2 ... x_m        (m = (S - 2) // 2; an odd S recalls one more)
    `---- span (~S/2) ---'    `- recall (~S/2) -'

The span is uniform random over ``ALPHABET`` (221 bytes), so a token of the recall half is
independent of everything except the span: no model can predict it better than chance
(``ln 221 = 5.40`` nats) without attending back ``~S/2`` positions — which, under sequence
parallelism with ``sp >= 2``, means into another rank's shard.

Labels: only the recall half carries labels (the span is ``-100``). The span is noise by
construction: its loss is the constant ``ln 221`` whatever the model does, and measured here it
drowns the signal. In a one-process prototype of this task (tiny Llama, lr 3e-3, 8 x 256 tokens per
step) the model learned recall by step ~200 with labels on the recall half, and had not started
after 400 steps with labels everywhere (two seeds). Scoring only the recall half also makes the
logged loss *the* recall loss (chance 5.40, learned ~0) and exercises the SP loss path where a
whole shard (the span) has no valid label. The default run (``ulysses-sp train``: lr 1e-2, 300
steps, sp=2) sits at chance for ~100 steps and reaches ~0.001.

Samples are a pure function of ``(seed, index)``: any worker, rank or resumed run regenerates the
same sample, at any sequence length.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import Dataset

from ulysses_sp.parallel.loss import IGNORE_INDEX
from ulysses_sp.tasks.tokenizer import BOS_ID

SEPARATOR = ord("|")
ALPHABET = tuple(b for b in range(33, 256) if b not in (SEPARATOR, 127))
CHANCE_LOSS = math.log(len(ALPHABET))
"""Loss (nats) of the best prediction of a recalled token that does not look back: ``ln 221``."""

MIN_SEQ_LEN = 4


def recall_start(seq_len: int) -> int:
    """Index of the first recalled token (the first labelled position) in a sample of ``seq_len``."""
    if seq_len < MIN_SEQ_LEN:
        raise ValueError(f"the recall task needs --seq-len >= {MIN_SEQ_LEN}, got {seq_len}")
    return 2 + (seq_len - 2) // 2


def recall_sample(seed: int, index: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [S], labels [S])`` of sample ``index`` (labels unshifted, HF convention)."""
    start = recall_start(seq_len)
    span_len = start - 2
    gen = torch.Generator().manual_seed((seed * 1_000_003 + index) & 0x7FFF_FFFF_FFFF_FFFF)
    span = torch.tensor(ALPHABET)[torch.randint(len(ALPHABET), (span_len,), generator=gen)]
    recall = span.repeat(2)[: seq_len - start]  # an odd seq_len recalls one token more
    ids = torch.cat([torch.tensor([BOS_ID]), span, torch.tensor([SEPARATOR]), recall])
    labels = ids.clone()
    labels[:start] = IGNORE_INDEX
    return ids, labels


class RecallDataset(Dataset):
    """``num_samples`` recall samples of ``seq_len`` tokens as ``{"input_ids", "labels"}`` dicts."""

    def __init__(self, *, seq_len: int, num_samples: int, seed: int) -> None:
        recall_start(seq_len)  # validate early
        self.seq_len, self.num_samples, self.seed = seq_len, num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        ids, labels = recall_sample(self.seed, index, self.seq_len)
        return {"input_ids": ids, "labels": labels}
