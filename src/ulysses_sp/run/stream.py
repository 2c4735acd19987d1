"""The run's micro-batches on this rank, as ``train``'s loop and ``eval`` see them.

``epoch_batches(dataset, mesh, ...)``: one epoch of this rank's micro-batches over the ``(dp, sp)``
layout ``mesh``: ``sp_dataloader`` (an SP group's ranks load different batches; the ``dp`` replicas
split the samples) -> ``UlyssesSPDataLoaderAdapter`` (each batch in turn, every rank of the group
holding its shard), or for a VLM ``VLMDataLoaderAdapter`` (whole batches to every rank of the group:
the merge and mrope need the full sample). So a layout with ``sp = P`` processes the same global
batches, in the same order, as ``sp = 1`` with the same ``dp``. ``DataStream``: ``train``'s endless,
resumable stream of them (epoch after epoch, from ``(epoch, offset)``), counting the real (non-padding)
tokens it yielded from the adapter's host metadata (``take_real_tokens``: ``train``'s tokens/s).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import partial
from typing import Any

from ulysses_sp.parallel.mesh import SPMesh


def epoch_batches(dataset, mesh: SPMesh, *, micro_batch_size: int, pad_id: int, shuffle: bool, seed: int = 0,
                  epoch: int = 0, start_batch: int = 0, vlm: Any = None,
                  require_split: bool = False) -> Iterable[dict[str, Any]]:  # fmt: skip
    """One epoch of this rank's micro-batches (module docstring), from the sampler's ``start_batch``:
    the adapter, to iterate once (its ``last_real_tokens``: the real tokens of the last batch).

    ``vlm``: the model, for a VLM's batches (``run.vlm.collate_vlm``, ``VLMDataLoaderAdapter``);
    ``None``: text; ``require_split``: refuse a VLM batch whose frames cannot be split over the SP group
    (``--split-images on``). A tail that does not fill a round of ``dp * sp * micro_batch_size`` samples is
    padded by repeating samples (the sampler's ``drop_last=False``).
    """
    from ulysses_sp.data import UlyssesSPDataLoaderAdapter, sp_dataloader
    from ulysses_sp.run.vlm import collate_vlm
    from ulysses_sp.vlm import VLMDataLoaderAdapter

    collate = None if vlm is None else partial(collate_vlm, pad_id=pad_id)
    loader = sp_dataloader(
        dataset, batch_size=micro_batch_size, dp_size=mesh.dp_size, sp_size=mesh.sp_size, dp_rank=mesh.dp_rank,
        sp_rank=mesh.sp_rank, shuffle=shuffle, seed=seed, epoch=epoch, start_batch=start_batch, collate_fn=collate,
    )  # fmt: skip
    group = mesh.sp_group if mesh.sp_size > 1 else None
    if vlm is None:
        return UlyssesSPDataLoaderAdapter(loader, mesh.sp_rank, group, mesh.sp_size, mesh.device,
                                          pad_token_id=pad_id)  # fmt: skip
    return VLMDataLoaderAdapter(loader, mesh.sp_rank, group, mesh.sp_size, mesh.device, model=vlm,
                                pad_token_id=pad_id, ring_size=mesh.ring_size,
                                require_split=require_split and mesh.sp_size > 1)  # fmt: skip


class DataStream:
    """Endless micro-batches for this rank, resumable from ``(epoch, offset)``.

    ``offset`` counts the adapter micro-steps consumed in ``epoch``; a resumed stream skips whole
    rounds in the sampler (no loading) and the remaining ``offset % sp`` micro-steps of the round.
    """

    def __init__(self, dataset, engine, *, micro_batch_size: int, seed: int, shuffle: bool, pad_id: int,
                 epoch: int = 0, offset: int = 0, vlm: Any = None, require_split: bool = False) -> None:  # fmt: skip
        self.dataset, self.engine, self.vlm = dataset, engine, vlm  # vlm: the model, for a VLM's batches
        self.require_split = require_split  # epoch_batches' (--split-images on)
        self.micro_batch_size, self.seed, self.shuffle, self.pad_id = micro_batch_size, seed, shuffle, pad_id
        self.epoch, self.offset = epoch, offset
        self.real_tokens = 0
        """Real (non-padding) tokens of the whole batches yielded since the last ``take_real_tokens``."""

    def take_real_tokens(self) -> int:
        """The real tokens of the micro-batches yielded since the last call (a host int, the same on
        every rank of an SP group: each micro-step's whole batch, not this rank's shard), then 0."""
        n, self.real_tokens = self.real_tokens, 0
        return n

    def position(self) -> dict[str, int]:
        """Where the stream is: ``{"epoch", "offset"}`` (what a checkpoint saves)."""
        return {"epoch": self.epoch, "offset": self.offset}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while True:
            rounds, rest = divmod(self.offset, self.engine.sp_size)
            batches = epoch_batches(
                self.dataset, self.engine.mesh, micro_batch_size=self.micro_batch_size, pad_id=self.pad_id,
                shuffle=self.shuffle, seed=self.seed, epoch=self.epoch, start_batch=rounds, vlm=self.vlm,
                require_split=self.require_split,
            )  # fmt: skip
            for i, batch in enumerate(batches):
                if i < rest:
                    continue
                self.offset += 1
                self.real_tokens += batches.last_real_tokens
                yield batch
            self.epoch, self.offset = self.epoch + 1, 0
