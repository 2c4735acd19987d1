"""The typed training config: DeepSpeed-style JSON keys, batch-size arithmetic, validation errors.

``load_config`` turns a dict, a JSON file or an existing ``TrainingConfig`` into frozen,
keyword-only dataclasses and rejects anything it does not understand **before** any process group
is touched: an unknown key names itself (with a did-you-mean), a bad value names its key and the
value. Nothing here needs ``torch.distributed``; ``initialize`` (engine) consumes the result.

Where it sits in the step (DESIGN.md): before step 1. The batch arithmetic uses the data-parallel
world size from ``mesh.data_parallel_world_size`` (the five-step rule):
``train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * dp_world_size``.

Accepted keys::

    {
      "train_batch_size": 16,                  # any two of these three determine the third
      "train_micro_batch_size_per_gpu": 2,
      "gradient_accumulation_steps": 4,
      "sequence_parallel_size": 4,             # mesh shape; either may be omitted
      "data_parallel_size": 2,
      "gradient_clipping": 1.0,                # max global grad norm; 0 = no clipping
      "zero_optimization": {"stage": 3, "partition": "data_parallel"},   # or "all"
      "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
      "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 100, "total_num_steps": 1000}}
    }
"""

from __future__ import annotations

import difflib
import inspect
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch

ZERO_STAGES = (0, 1, 2, 3)
PARTITIONS = ("data_parallel", "all")

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
}
"""Optimizer ``type`` (case-insensitive) -> the torch class it builds (torch semantics: ``Adam``
with ``weight_decay`` is L2-regularised Adam, not AdamW)."""

SCHEDULERS: dict[str, dict[str, Any]] = {
    "WarmupLR": {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": None,
        "warmup_num_steps": 1000,
        "warmup_type": "log",
    },
    "WarmupDecayLR": {
        "total_num_steps": None,
        "warmup_min_lr": 0.0,
        "warmup_max_lr": None,
        "warmup_num_steps": 1000,
        "warmup_type": "log",
    },
    "WarmupCosineLR": {
        "total_num_steps": None,
        "warmup_min_ratio": 0.0,
        "warmup_num_steps": 1000,
        "cos_min_ratio": 0.0001,
        "warmup_type": "log",
    },
}
"""DeepSpeed's scheduler names and their parameters with defaults (``None``: required for
``total_num_steps``; for ``warmup_max_lr`` it means the optimizer's own lr)."""

# DeepSpeed keys we know but do not implement: named as such instead of as typos.
_DEEPSPEED_ONLY = {
    "fp16", "bf16", "amp", "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer",
    "gradient_predivide_factor", "prescale_gradients", "communication_data_type", "activation_checkpointing",
    "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comms_logger", "dataloader_drop_last",
    "seq_parallel_communication_data_type", "offload_optimizer", "offload_param", "overlap_comm",
    "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size", "reduce_scatter",
    "allgather_partitions", "round_robin_gradients", "sub_group_size", "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save", "elasticity", "compression_training", "checkpoint",
}  # fmt: skip


def _reject_unknown(where: str, given: Mapping[str, Any], known: list[str]) -> None:
    for key in given:
        if key in known:
            continue
        if key in _DEEPSPEED_ONLY:
            raise ValueError(
                f"{where + str(key)!r} is a DeepSpeed option that ulysses-sp does not implement; remove it"
            )
        close = difflib.get_close_matches(str(key), known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(sorted(known))}"
        raise ValueError(f"unknown config key {where + str(key)!r}{hint}")


def _positive_int(name: str, value: Any, *, allow_none: bool = True) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a positive int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """The ``zero_optimization`` section: what is partitioned, and across which ranks."""

    stage: int = 0
    """0: nothing partitioned (DDP); 1: + optimizer state; 2: + gradients; 3: + parameters."""
    partition: str = "data_parallel"
    """Ranks the partitions span: ``"data_parallel"`` (the DP axis, as DeepSpeed) or ``"all"`` (dp*sp)."""

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in ZERO_STAGES:
            raise ValueError(f"zero_optimization.stage must be one of {ZERO_STAGES}, got {self.stage!r}")
        if self.partition not in PARTITIONS:
            raise ValueError(
                f"zero_optimization.partition must be one of {PARTITIONS}, got {self.partition!r}"
            )


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """The ``optimizer`` section: ``{"type": "AdamW" | "Adam" | "SGD", "params": {...}}``."""

    type: str
    """Optimizer name, case-insensitive; see ``OPTIMIZERS``."""
    params: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the torch optimizer (``lr``, ``betas``, ``weight_decay``, ...); read-only."""

    def __post_init__(self) -> None:
        cls = OPTIMIZERS.get(str(self.type).lower())
        if cls is None:
            raise ValueError(f"optimizer.type must be one of Adam, AdamW, SGD, got {self.type!r}")
        known = [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "params")]
        _reject_unknown("optimizer.params.", self.params, known)
        if "betas" in self.params:  # JSON has no tuples
            object.__setattr__(self, "params", {**self.params, "betas": tuple(self.params["betas"])})

    @property
    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        """The torch optimizer class ``type`` names."""
        return OPTIMIZERS[self.type.lower()]


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """The ``scheduler`` section: a DeepSpeed scheduler name and its parameters."""

    type: str
    """``"WarmupLR"`` (warmup then constant), ``"WarmupDecayLR"`` (then linear), ``"WarmupCosineLR"``."""
    params: dict[str, Any] = field(default_factory=dict)
    """The scheduler's keyword arguments (see ``SCHEDULERS`` for names and defaults); read-only."""

    def __post_init__(self) -> None:
        canonical = {k.lower(): k for k in SCHEDULERS}.get(str(self.type).lower())
        if canonical is None:
            raise ValueError(f"scheduler.type must be one of {', '.join(SCHEDULERS)}, got {self.type!r}")
        object.__setattr__(self, "type", canonical)
        defaults = SCHEDULERS[canonical]
        _reject_unknown("scheduler.params.", self.params, list(defaults))
        merged = {**defaults, **self.params}
        if "total_num_steps" in merged:
            _positive_int("scheduler.params.total_num_steps", merged["total_num_steps"], allow_none=False)
        _positive_int("scheduler.params.warmup_num_steps", merged["warmup_num_steps"], allow_none=False)
        if merged["warmup_type"] not in ("log", "linear"):
            raise ValueError(
                f"scheduler.params.warmup_type must be 'log' or 'linear', got {merged['warmup_type']!r}"
            )

    @property
    def kwargs(self) -> dict[str, Any]:
        """The parameters with defaults filled in, ready for the scheduler class."""
        return {**SCHEDULERS[self.type], **self.params}


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
    dp = _positive_int("dp_world_size", dp_world_size, allow_none=False)
    tb = _positive_int("train_batch_size", train_batch_size)
    mb = _positive_int("train_micro_batch_size_per_gpu", train_micro_batch_size_per_gpu)
    ga = _positive_int("gradient_accumulation_steps", gradient_accumulation_steps)
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


_SIZE_FIELDS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "sequence_parallel_size",
    "data_parallel_size",
)


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """The whole config ``initialize`` accepts (DeepSpeed-compatible key names)."""

    train_batch_size: int | None = None
    """Samples per optimizer step over all DP replicas; ``None``: derived from the other two."""
    train_micro_batch_size_per_gpu: int | None = None
    """Samples per micro-step on one rank; ``None``: derived."""
    gradient_accumulation_steps: int | None = None
    """Micro-steps per optimizer step; ``None``: derived (1 when only one size is given)."""
    sequence_parallel_size: int | None = None
    """Ranks that split one sequence; ``None``: from ``mesh_param``/``mpu``, else world / dp."""
    data_parallel_size: int | None = None
    """Data-parallel replicas; ``None``: world / sp."""
    gradient_clipping: float = 0.0
    """Max L2 norm of the full reduced gradient; ``0`` = no clipping."""
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    """ZeRO stage and partition span."""
    optimizer: OptimizerConfig | None = None
    """Optimizer section; ``None``: pass an optimizer (or a callable) to ``initialize``."""
    scheduler: SchedulerConfig | None = None
    """LR scheduler section; ``None``: no scheduler unless one is passed to ``initialize``."""

    def __post_init__(self) -> None:
        for name in _SIZE_FIELDS:
            _positive_int(name, getattr(self, name))
        clip = self.gradient_clipping
        if (
            isinstance(clip, bool)
            or not isinstance(clip, (int, float))
            or not math.isfinite(clip)
            or clip < 0
        ):
            raise ValueError(f"gradient_clipping must be a finite number >= 0 (0 = off), got {clip!r}")

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> TrainingConfig:
        """Parse a DeepSpeed-style dict; unknown keys raise ``ValueError`` naming the key."""
        if not isinstance(config, Mapping):
            raise ValueError(
                f"config must be a dict, a JSON file path or a TrainingConfig, got {type(config).__name__}"
            )
        _reject_unknown("", config, [f.name for f in fields(cls)])
        kwargs = dict(config)
        sections = {
            "zero_optimization": ZeroConfig,
            "optimizer": OptimizerConfig,
            "scheduler": SchedulerConfig,
        }
        for key, section_cls in sections.items():
            section = kwargs.get(key)
            if section is None:
                kwargs.pop(key, None)
                continue
            if not isinstance(section, Mapping):
                raise ValueError(f"{key} must be a dict, got {section!r}")
            _reject_unknown(f"{key}.", section, [f.name for f in fields(section_cls)])
            if section_cls is not ZeroConfig and "type" not in section:
                raise ValueError(f"{key} needs a 'type'")
            if "params" in section and not isinstance(section["params"], Mapping):
                raise ValueError(f"{key}.params must be a dict, got {section['params']!r}")
            kwargs[key] = section_cls(**{k: dict(v) if k == "params" else v for k, v in section.items()})
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The DeepSpeed-style dict this config parses from (``None`` entries omitted)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.name in ("zero_optimization", "optimizer", "scheduler"):
                value = {g.name: getattr(value, g.name) for g in fields(value)}
                if "params" in value:
                    value["params"] = dict(value["params"])
            out[f.name] = value
        return out

    def batch_sizes(self, dp_world_size: int) -> BatchSizes:
        """Resolve the batch triple for ``dp_world_size`` replicas (see ``resolve_batch_sizes``)."""
        return resolve_batch_sizes(
            dp_world_size,
            train_batch_size=self.train_batch_size,
            train_micro_batch_size_per_gpu=self.train_micro_batch_size_per_gpu,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
        )


def load_config(config: TrainingConfig | Mapping[str, Any] | str | os.PathLike[str]) -> TrainingConfig:
    """A ``TrainingConfig`` from itself, a dict, or the path of a JSON file."""
    if isinstance(config, TrainingConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        if not os.path.isfile(config):
            raise ValueError(f"config file {os.fspath(config)!r} does not exist")
        with open(config, encoding="utf-8") as f:
            try:
                config = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"config file {os.fspath(f.name)!r} is not valid JSON: {e}") from None
    return TrainingConfig.from_dict(config)
