"""One rank's ``DataLoader`` under ``(dp, sp)`` parallelism: the SP sampler order, resumable.

Every ``DataLoader`` ulysses-sp builds comes from ``sp_dataloader``: the one ``initialize(
training_data=...)`` returns (``engine.data``), the train command's endless stream
(``run.stream.DataStream``, resuming mid-epoch) and the eval command's single pass
(``run.stream.epoch_batches``). Where it sits in the step (DESIGN.md, step 1): it yields this
rank's full-length batches ``[b, S]``; wrap it in ``UlyssesSPDataLoaderAdapter`` (the caller's
choice: it needs the SP group and device) to get the shards.

Shape legend: ``D`` dp size, ``P`` sp size, ``b`` the loader's batch size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, Dataset

from ulysses_sp.checks import positive_int
from ulysses_sp.data.sampler import sp_data_sampler


def sp_dataloader(
    dataset: Dataset,
    *,
    batch_size: int,
    dp_size: int,
    sp_size: int,
    dp_rank: int,
    sp_rank: int,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    epoch: int = 0,
    start_batch: int = 0,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> DataLoader:
    """A ``DataLoader`` of this rank's batches of ``batch_size`` in the ``sp_data_sampler`` order.

    With it (and the adapter) a run with ``sp = P`` processes the same global batches, in the same
    order, as a run with ``sp = 1`` and the same ``dp``, ``seed`` and ``batch_size``.

    Args:
        dataset: a map-style dataset (``__len__`` and ``__getitem__``).
        batch_size: samples per batch of this rank (the micro-batch).
        dp_size, sp_size, dp_rank, sp_rank: this rank's place in the ``(dp, sp)`` layout.
        shuffle, seed: a ``seed + epoch`` permutation as ``DistributedSampler``; else in order.
        drop_last: drop the tail that does not fill a whole round of ``D * P * batch_size``
            samples (else it is padded by repeating samples).
        epoch: the sampler's epoch (``set_epoch``); later epochs: ``loader.sampler.set_epoch(e)``.
        start_batch: skip this many of this rank's batches of ``epoch`` without loading them (a
            resumed run). With ``start_batch > 0`` the loader covers the rest of that one epoch
            (its sampler is then the list of remaining indices, without ``set_epoch``).
        collate_fn: the ``DataLoader``'s (``None``: torch's default collation).
    """
    positive_int("start_batch", start_batch, minimum=0)
    sampler = sp_data_sampler(
        dataset, dp_size=dp_size, sp_size=sp_size, dp_rank=dp_rank, sp_rank=sp_rank,
        batch_size=batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
    )  # fmt: skip
    sampler.set_epoch(epoch)
    if start_batch:
        remaining = list(sampler)[start_batch * batch_size :]
        return DataLoader(dataset, batch_size=batch_size, sampler=remaining, collate_fn=collate_fn)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn)
