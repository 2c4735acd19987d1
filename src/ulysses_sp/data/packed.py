"""Packed fine-tuning blocks: tokenized samples, an eval split, a packing plan -> ``seq_len`` rows.

``packed_dataset(corpus, seq_len=..., ...)`` splits the samples into train / eval (deterministic
by ``seed``, at the sample level, so a conversation is never in both), plans the blocks of the
requested split (``bestfit.plan_blocks``) and returns a ``PackedDataset``: a map-style dataset of
``{"input_ids", "labels", "position_ids", "attention_mask"}`` rows of exactly ``seq_len`` tokens. In a row each
segment is its own document (``position_ids`` restart at 0, so the document-causal masking keeps
attention inside it and ``make_shift_labels`` does not predict across it); ``labels`` are the ids
where the loss scores them and ``-100`` elsewhere; the tail is padding (``pad_id``, ``-100``,
positions continuing, ``attention_mask`` ``False``: the adapter counts real tokens from it and
``prepare_batch`` drops it). Rows are built on access from the memory-mapped cache.

Shape legend: ``S`` = ``seq_len``.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
from torch.utils.data import Dataset

from ulysses_sp.data.bestfit import PackingPlan, plan_blocks
from ulysses_sp.data.cache import TokenizedCorpus
from ulysses_sp.data.packing import PackingCollator
from ulysses_sp.parallel.loss import IGNORE_INDEX

logger = logging.getLogger(__name__)


def split_samples(n: int, eval_split: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(train, eval)`` sample indices (each sorted): ``ceil(eval_split * n)`` samples held out,
    chosen by a ``seed`` permutation; ``eval_split == 0``: all train, no eval."""
    if not (isinstance(eval_split, (int, float)) and 0 <= eval_split < 1):
        raise ValueError(f"--eval-split must be a fraction in [0, 1), got {eval_split!r}")
    k = math.ceil(round(eval_split * n, 9)) if eval_split else 0
    if eval_split and k >= n:
        raise ValueError(f"--eval-split {eval_split} of {n} samples holds out {k}, leaving none to train on; "
                         "use a smaller fraction or more data")  # fmt: skip
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()
    return np.sort(order[k:]), np.sort(order[:k])


class PackedDataset(Dataset):
    """``seq_len`` rows packed from a ``TokenizedCorpus`` by a ``PackingPlan`` (see the module)."""

    def __init__(self, corpus: TokenizedCorpus, plan: PackingPlan, *, seq_len: int, pad_id: int,
                 samples: np.ndarray | None = None) -> None:  # fmt: skip
        self.corpus, self.plan, self.seq_len = corpus, plan, seq_len
        self.samples = np.arange(len(corpus)) if samples is None else samples  # plan index -> sample
        self.collate = PackingCollator(max_length=seq_len, pad_token_id=pad_id)

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        p, c = self.plan, self.corpus
        docs = []
        for s in range(p.offsets[index], p.offsets[index + 1]):
            base = c.offsets[self.samples[p.sample[s]]]
            lo, hi = base + p.start[s], base + p.end[s]
            ids = torch.tensor(c.ids[lo:hi], dtype=torch.long)  # a copy out of the memory map
            scored = torch.tensor(c.scored[lo:hi], dtype=torch.bool)
            docs.append({"input_ids": ids, "labels": ids.masked_fill(~scored, IGNORE_INDEX)})
        row = {k: v[0] for k, v in self.collate(docs).items()}  # [1, S] -> [S] each
        real = min(sum(d["input_ids"].numel() for d in docs), self.seq_len)
        row["attention_mask"] = torch.arange(self.seq_len) < real  # [S] bool: the tail padding is False
        return row

    def packs_documents(self) -> bool:
        """Whether some row holds more than one document (segment) of the corpus."""
        return len(self.plan) > 0 and int(np.diff(self.plan.offsets).max()) > 1

    def stats(self) -> dict[str, float | int]:
        """Blocks, real and scored tokens, packing efficiency, the long-sample counts."""
        p, c = self.plan, self.corpus
        block_tokens = len(p) * self.seq_len
        real = p.real_tokens
        # scored tokens that a row's label keeps (the first token of a document has no predecessor)
        starts = c.offsets[self.samples[p.sample]] + p.start if len(p.sample) else np.zeros(0, np.int64)
        cum = np.concatenate([[0], np.cumsum(np.asarray(c.scored, dtype=np.int64))])
        ends = starts + (p.end - p.start)
        scored = (
            int((cum[ends] - cum[starts]).sum() - np.asarray(c.scored)[starts].sum()) if len(starts) else 0
        )
        return {
            "blocks": len(p), "samples": len(self.samples), "block_tokens": block_tokens, "real_tokens": real,
            "scored_tokens": scored, "efficiency": real / block_tokens if block_tokens else 0.0,
            "scored_share": scored / block_tokens if block_tokens else 0.0,
            "truncated": p.truncated, "split": p.split, "dropped": p.dropped,
        }  # fmt: skip


def packed_dataset(
    corpus: TokenizedCorpus,
    *,
    seq_len: int,
    pad_id: int,
    packing: str = "best-fit",
    long_samples: str = "truncate",
    eval_split: float = 0.0,
    seed: int = 0,
    held_out: bool = False,
) -> PackedDataset:
    """The train (or, ``held_out``, the eval) split of ``corpus`` packed into ``seq_len`` blocks.

    Raises:
        ValueError: a bad setting, or no block (no sample left) — naming the counts.
    """
    train, held = split_samples(len(corpus), eval_split, seed)
    samples = held if held_out else train
    if held_out and not eval_split:
        samples = train  # no split asked for: evaluate on all of the data given
    plan = plan_blocks(corpus.lengths[samples], seq_len, packing=packing, long_samples=long_samples)
    if not len(plan):
        raise ValueError(
            f"--data: no {'eval' if held_out else 'training'} block: {len(samples)} samples, {plan.dropped} "
            f"dropped (empty, or longer than --seq-len {seq_len} with --long-samples drop)"
        )
    return PackedDataset(corpus, plan, seq_len=seq_len, pad_id=pad_id, samples=samples)


def describe(stats: dict) -> str:
    """One startup-summary line for ``PackedDataset.stats()``."""
    return (
        f"  packing: {stats['samples']} samples -> {stats['blocks']} blocks; efficiency "
        f"{100 * stats['efficiency']:.1f}% (real / block tokens), scored tokens {100 * stats['scored_share']:.1f}% "
        f"of block tokens; long samples: {stats['truncated']} truncated, {stats['split']} split, "
        f"{stats['dropped']} dropped"
    )


def scored_counts(dataset: PackedDataset) -> dict[str, int]:
    """Per sample of ``dataset``: how many have scored tokens at all (``scored``), how many none
    (``unscored``: e.g. chats without an assistant turn under ``--loss-on assistant``), how many lost
    all of theirs to truncation (``truncated_away``: scored only past ``seq_len``), and the scored
    tokens the blocks keep (``kept_tokens``; a document's first token has no label)."""
    c, p, samples = dataset.corpus, dataset.plan, dataset.samples
    flags = np.asarray(c.scored, dtype=np.int64)
    cum = np.concatenate([[0], np.cumsum(flags)])
    total = cum[c.offsets[samples + 1]] - cum[c.offsets[samples]]
    base = c.offsets[samples[p.sample]] if len(p.sample) else np.zeros(0, np.int64)
    starts, ends = base + p.start, base + p.end
    piece = cum[ends] - cum[starts] - (flags[starts] if len(starts) else 0)
    kept = np.bincount(p.sample, weights=piece, minlength=len(samples))
    placed = np.bincount(p.sample, minlength=len(samples)) > 0  # not dropped (--long-samples drop)
    return {"samples": len(samples), "scored": int((total > 0).sum()), "unscored": int((total == 0).sum()),
            "truncated_away": int(((total > 0) & (kept == 0) & placed).sum()), "kept_tokens": int(kept.sum())}  # fmt: skip


def check_scored(dataset: Dataset, *, seq_len: int, data: str) -> None:
    """Refuse packed training data in which the loss scores no token (it would train to a loss of 0,
    learning nothing); warn with the counts when some samples lose all their scored tokens to
    truncation at ``seq_len``. Other datasets (recall, text blocks) score every token."""
    if not isinstance(dataset, PackedDataset):
        return
    n = scored_counts(dataset)
    cut = (
        f"{n['truncated_away']} of {n['samples']} samples have their scored tokens only past --seq-len {seq_len} "
        "(truncated away)"
    )
    if n["kept_tokens"] == 0:
        raise ValueError(
            f"--data {data!r}: no token is scored, so training would learn nothing (loss 0): "
            f"{n['unscored']} of {n['samples']} samples have no scored token (--loss-on assistant/completion "
            f"scores assistant turns / completions only: are there any?), {cut}. Use --loss-on all, a longer "
            "--seq-len or --long-samples split, or data with assistant turns"
        )
    if n["truncated_away"]:
        logger.warning(
            "--data %r: %s and train nothing; raise --seq-len or use --long-samples split", data, cut
        )
