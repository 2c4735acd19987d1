"""The sampler order that makes an ``sp = P`` run see the same global batches as an ``sp = 1`` run.

Shape legend: ``D`` dp size, ``P`` sp size, ``b`` the loader's batch size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, DistributedSampler

from ulysses_sp.checks import positive_int
from ulysses_sp.parallel.mesh import as_sp_mesh


class SPDistributedSampler(DistributedSampler):
    """A ``DistributedSampler`` over all ``D * P`` ranks whose order matches an ``sp = 1`` run.

    ``num_replicas = D * P`` and ``rank = sp_rank * D + dp_rank``. Take the stream of samples that
    data-parallel replica ``d`` of an ``sp = 1`` run (``D`` replicas, same seed) would see, cut it
    into batches of ``batch_size``, and deal the batches round-robin to the ``P`` SP ranks of
    replica ``d``: SP rank ``k`` gets batches ``k, k + P, k + 2P, ...``. The adapter then processes
    them in the order ``(j, k)`` = batch ``j*P + k`` — exactly the order in which replica ``d`` of
    an ``sp = 1`` run with ``DistributedSampler(num_replicas=D, rank=d)`` sees them. With
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
            positive_int(f"{name}_size", size)
            if not 0 <= rank < size:
                raise ValueError(f"{name}_rank ({rank}) must be in [0, {name}_size ({size}))")
        positive_int("batch_size", batch_size)
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
        mesh: the run's ``SPMesh`` (or what holds one: the ``mpu`` ``register_with_transformers``
            returns); or give all four of ``dp_size, sp_size, dp_rank, sp_rank``.
    """
    given = (dp_size, sp_size, dp_rank, sp_rank)
    if mesh is not None:
        if any(v is not None for v in given):
            raise ValueError("pass either mesh (or mpu) or dp_size/sp_size/dp_rank/sp_rank, not both")
        layout = as_sp_mesh(mesh)
        dp_size, sp_size, dp_rank, sp_rank = layout.dp_size, layout.sp_size, layout.dp_rank, layout.sp_rank
    elif any(v is None for v in given):
        raise ValueError(f"without a mesh give dp_size, sp_size, dp_rank and sp_rank; got {given}")
    return SPDistributedSampler(
        dataset, dp_size=dp_size, sp_size=sp_size, dp_rank=dp_rank, sp_rank=sp_rank,
        batch_size=batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
    )  # fmt: skip
