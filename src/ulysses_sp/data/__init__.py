"""Feeding a sequence-parallel group: the round-robin loader adapter, document packing, sampler order.

Where it sits in the step (DESIGN.md, step 2): an ordinary ``DataLoader`` yields full-length
batches ``[B, S]`` on every rank. ``UlyssesSPDataLoaderAdapter`` turns the ``P`` batches that the
``P`` ranks of one SP group loaded into ``P`` micro-steps: on micro-step ``i`` of a round every rank
of the group works on the batch SP rank ``i mod P`` loaded, rank ``k`` holding its tokens
``[k*S/P, (k+1)*S/P)``. Labels are shifted over the *full* sequence before sharding, so the loss
(``loss.sp_causal_lm_loss``) needs no communication beyond its ``(sum, count)`` reduction.

One concern per module:

- ``shard``: the pure per-token logic (``make_shift_labels``, ``prepare_batch``, ``shard_batch``),
  no process group needed;
- ``adapter``: ``UlyssesSPDataLoaderAdapter``, which adds only the exchange between ranks;
- ``packing``: ``PackingCollator``, packed batches (documents marked by restarting ``position_ids``);
- ``sampler``: ``sp_data_sampler``, the order that makes an ``sp = P`` run see the same global
  batches as an ``sp = 1`` run;
- ``loader``: ``sp_dataloader``, one rank's ``DataLoader`` in that order (resumable): the one
  construction path of the engine, the train and the eval commands.

Fine-tuning data (local files, tokenized once, packed):

- ``formats``: reading ``.jsonl/.json/.parquet/.arrow/.txt`` and ``save_to_disk`` directories
  through ``datasets`` (local only), and the format (``text`` / ``chat`` / ``prompt-completion``);
- ``chat``: one record to ``(ids, scored)`` — chat templates, assistant-only / completion masks;
- ``cache``: ``tokenized_corpus``, tokenization in worker processes into a memory-mapped on-disk
  cache, one tokenizing process per node (file lock);
- ``bestfit``: ``plan_blocks``, best-fit-decreasing packing (or one sample per block);
- ``packed``: ``packed_dataset`` / ``PackedDataset``, the eval split and the packed rows.

Shape legend: ``B`` batch, ``S`` global (padded) sequence, ``S_l = S/P`` local sequence,
``P`` sp size, ``D`` dp size.

May import: ``checks``, ``parallel``.
"""

from __future__ import annotations

from ulysses_sp.data.adapter import UlyssesSPDataLoaderAdapter
from ulysses_sp.data.bestfit import PackingPlan, plan_blocks
from ulysses_sp.data.cache import TokenizedCorpus, tokenized_corpus
from ulysses_sp.data.loader import sp_dataloader
from ulysses_sp.data.packed import PackedDataset, packed_dataset
from ulysses_sp.data.packing import PackingCollator
from ulysses_sp.data.sampler import SPDistributedSampler, sp_data_sampler
from ulysses_sp.data.shard import make_shift_labels, prepare_batch, shard_batch

__all__ = [
    "PackedDataset",
    "PackingCollator",
    "PackingPlan",
    "SPDistributedSampler",
    "TokenizedCorpus",
    "UlyssesSPDataLoaderAdapter",
    "make_shift_labels",
    "packed_dataset",
    "plan_blocks",
    "prepare_batch",
    "shard_batch",
    "sp_data_sampler",
    "sp_dataloader",
    "tokenized_corpus",
]
