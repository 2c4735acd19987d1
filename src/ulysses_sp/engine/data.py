"""The DataLoader ``initialize(training_data=...)`` builds: micro-batches in the sequence-parallel order.

The loader comes from ``data.sp_dataloader``, the one construction path (``SPDistributedSampler``:
an ``sp = P`` run sees the same global batches, in the same order, as an ``sp = 1`` run with the
same ``dp`` and seed); this module adds the engine's policy: ``training_data`` must be map-style,
is shuffled with seed 0, and ``loader.sampler.set_epoch(e)`` is the caller's, once per epoch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, Dataset

from ulysses_sp.data import sp_dataloader


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
    return sp_dataloader(
        dataset, batch_size=batch_size, dp_size=dp_size, sp_size=sp_size, dp_rank=dp_rank,
        sp_rank=sp_rank, collate_fn=collate_fn,
    )  # fmt: skip
