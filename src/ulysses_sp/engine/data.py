"""The DataLoader ``initialize(training_data=...)`` builds: micro-batches in the sequence-parallel order.

Each rank loads its own micro-batches with ``data.SPDistributedSampler`` (``num_replicas = dp*sp``,
``rank = sp_rank * dp_size + dp_rank``, dealing *batches* round-robin to the SP ranks of a DP
replica). The data adapter (``data.UlyssesSPDataLoaderAdapter``) then processes the ``P`` batches
of an SP group round-robin, so an ``sp = P`` run sees the same global batches, in the same order,
as an ``sp = 1`` run with the same ``dp`` and seed: SP rank ``k`` of replica ``d`` loads batches
``k, k+P, k+2P, ...`` of the stream replica ``d`` of the ``sp = 1`` run would load, and the adapter
processes batch ``j*P + k`` at its micro-step ``j*P + k``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, Dataset

from ..data import sp_data_sampler


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
    """A shuffling ``DataLoader`` of micro-batches for this rank; call ``loader.sampler.set_epoch(e)``
    each epoch. Wrap it in ``UlyssesSPDataLoaderAdapter`` when ``sp_size > 1``."""
    check_dataset(dataset)
    sampler = sp_data_sampler(
        dataset, dp_size=dp_size, sp_size=sp_size, dp_rank=dp_rank, sp_rank=sp_rank, batch_size=batch_size
    )
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn)
