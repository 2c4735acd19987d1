"""Batch-size arithmetic: ``train_batch_size = micro_batch_per_gpu * grad_accum * dp_world_size``.

Any two of the three sizes determine the third; the data-parallel world size comes from
``mesh_shape.data_parallel_world_size`` (the five-step rule). Pure: no process group.
"""

from __future__ import annotations

from dataclasses import dataclass

from ulysses_sp.checks import optional_positive_int, positive_int


@dataclass(frozen=True, kw_only=True)
class BatchSizes:
    """The resolved batch arithmetic: ``train_batch_size = micro * grad_accum * dp_world_size``."""

    train_batch_size: int
    """Samples per optimizer step over all data-parallel replicas."""
    train_micro_batch_size_per_gpu: int
    """Samples per forward/backward on one rank (one SP group shares them)."""
    gradient_accumulation_steps: int
    """Micro-steps per optimizer step."""
    dp_world_size: int
    """Data-parallel replicas the batch is split over (the five-step rule)."""


def resolve_batch_sizes(
    dp_world_size: int,
    *,
    train_batch_size: int | None = None,
    train_micro_batch_size_per_gpu: int | None = None,
    gradient_accumulation_steps: int | None = None,
) -> BatchSizes:
    """Fill in the missing batch sizes from the given ones (DeepSpeed's rules).

    Any two of the three determine the third; with only ``train_batch_size`` or only the micro
    batch, ``gradient_accumulation_steps`` is 1.

    Raises:
        ValueError: an inconsistent or indivisible combination, naming every number; or neither
            ``train_batch_size`` nor ``train_micro_batch_size_per_gpu`` given.
    """
    dp = positive_int("dp_world_size", dp_world_size)
    tb = optional_positive_int("train_batch_size", train_batch_size)
    mb = optional_positive_int("train_micro_batch_size_per_gpu", train_micro_batch_size_per_gpu)
    ga = optional_positive_int("gradient_accumulation_steps", gradient_accumulation_steps)
    if tb is None and mb is None:
        raise ValueError(
            "give train_batch_size or train_micro_batch_size_per_gpu (or both); "
            f"gradient_accumulation_steps ({ga}) and dp_world_size ({dp}) alone do not determine a batch"
        )
    if tb is None:
        ga = ga or 1
        tb = mb * ga * dp
    elif mb is None:
        ga = ga or 1
        if tb % (ga * dp):
            raise ValueError(
                f"train_batch_size ({tb}) is not divisible by gradient_accumulation_steps ({ga}) "
                f"* dp_world_size ({dp}) = {ga * dp}"
            )
        mb = tb // (ga * dp)
    elif ga is None:
        if tb % (mb * dp):
            raise ValueError(
                f"train_batch_size ({tb}) is not divisible by train_micro_batch_size_per_gpu ({mb}) "
                f"* dp_world_size ({dp}) = {mb * dp}"
            )
        ga = tb // (mb * dp)
    if tb != mb * ga * dp:
        raise ValueError(
            f"train_batch_size ({tb}) != train_micro_batch_size_per_gpu ({mb}) * "
            f"gradient_accumulation_steps ({ga}) * dp_world_size ({dp}) = {mb * ga * dp}"
        )
    return BatchSizes(
        train_batch_size=tb,
        train_micro_batch_size_per_gpu=mb,
        gradient_accumulation_steps=ga,
        dp_world_size=dp,
    )
