"""The DataLoader ``initialize(training_data=...)`` builds: every SP rank loads its own batches.

The data adapter (``data.UlyssesSPDataLoaderAdapter``) all-gathers the batches of the ``sp_size``
ranks of an SP group and processes them round-robin: on adapter step ``t * P + k`` the whole group
works on the ``t``-th batch loaded by SP rank ``k``. For an ``sp = P`` run to see the same global
batches, in the same order, as an ``sp = 1`` run with the same ``dp`` (the project's equivalence
test), SP rank ``k`` of DP replica ``d`` must load batch ``t * P + k`` of what replica ``d`` of the
``sp = 1`` run loads. ``SequenceParallelSampler`` does exactly that: it takes the sample stream of
``DistributedSampler(num_replicas=dp_size, rank=dp_rank)`` (the ``sp = 1`` stream), cuts it into
micro-batches and yields every ``P``-th one starting at ``sp_rank``.

(A ``DistributedSampler`` over all ``dp * sp`` ranks with ``rank = sp_rank * dp_size + dp_rank``
gives the same order only for micro-batch size 1: with ``B > 1`` it deals out single samples, not
batches, so the batches regroup.)

The stream is padded by wrapping around to a multiple of ``B * P`` samples so every rank of the
group yields the same number of full batches (the adapter's collectives need that);
``drop_last=True`` truncates instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler


class SequenceParallelSampler(Sampler[int]):
    """Sample indices of this rank's micro-batches, in order, for ``DataLoader(batch_size=B)``.

    Args:
        dataset: a map-style dataset (``__len__`` and ``__getitem__``).
        dp_size, dp_rank, sp_size, sp_rank: this rank's place on the mesh.
        batch_size: the micro-batch size ``B`` the DataLoader uses.
        shuffle, seed, drop_last: as ``DistributedSampler``; call ``set_epoch`` every epoch.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        dp_size: int,
        dp_rank: int,
        sp_size: int,
        sp_rank: int,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        self.replica = DistributedSampler(
            dataset, num_replicas=dp_size, rank=dp_rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        self.sp_size, self.sp_rank, self.batch_size, self.drop_last = sp_size, sp_rank, batch_size, drop_last
        group = batch_size * sp_size  # samples one SP group consumes per round of P batches
        n = len(self.replica)
        self._group_total = (n // group if drop_last else math.ceil(n / group)) * group

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (same permutation on every rank)."""
        self.replica.set_epoch(epoch)

    def __len__(self) -> int:
        return self._group_total // self.sp_size

    def __iter__(self) -> Iterator[int]:
        stream = list(self.replica)
        while stream and len(stream) < self._group_total:  # wrap around to fill the last round
            stream += stream[: self._group_total - len(stream)]
        stream = stream[: self._group_total]
        b, p = self.batch_size, self.sp_size
        for start in range(self.sp_rank * b, len(stream), p * b):
            yield from stream[start : start + b]


def check_dataset(dataset: Any) -> None:
    """Raise ``ValueError`` unless ``dataset`` is map-style (the sampler needs its length)."""
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ValueError(
            f"training_data must be a map-style dataset (with __len__ and __getitem__), got "
            f"{type(dataset).__name__}; build your own DataLoader for iterable datasets"
        )


def build_dataloader(
    dataset: Dataset,
    *,
    batch_size: int,
    dp_size: int,
    dp_rank: int,
    sp_size: int,
    sp_rank: int,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> DataLoader:
    """A ``DataLoader`` of micro-batches for this rank (see the module docstring for the order)."""
    check_dataset(dataset)
    sampler = SequenceParallelSampler(
        dataset, dp_size=dp_size, dp_rank=dp_rank, sp_size=sp_size, sp_rank=sp_rank, batch_size=batch_size
    )
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn)
