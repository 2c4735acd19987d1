"""The typed training config: DeepSpeed-style JSON keys, batch-size arithmetic, validation errors.

``load_config`` turns a dict, a JSON file or an existing ``TrainingConfig`` into frozen,
keyword-only dataclasses and rejects anything it does not understand **before** any process group
is touched: an unknown key names itself (with a did-you-mean), a bad value names its key and the
value. Nothing here needs ``torch.distributed``; ``initialize`` (engine) consumes the result.

Where it sits in the step (DESIGN.md): before step 1. The batch arithmetic uses the data-parallel
world size from ``mesh_shape.data_parallel_world_size`` (the five-step rule):
``train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * dp_world_size``.

Accepted keys::

    {
      "train_batch_size": 16,                  # any two of these three determine the third
      "train_micro_batch_size_per_gpu": 2,
      "gradient_accumulation_steps": 4,
      "sequence_parallel_size": 4,             # mesh shape; either may be omitted
      "data_parallel_size": 2,
      "gradient_clipping": 1.0,                # max global grad norm; 0 = no clipping
      "zero_optimization": {"stage": 3, "partition": "data_parallel",   # or "all"
                            "offload_param": {"device": "cpu"}},           # stage 3: FSDP2 CPUOffloadPolicy
      "bf16": {"enabled": true},               # or "fp16": {"enabled": true, "initial_scale_power": 16}
      "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
      "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 100, "total_num_steps": 1000}}
    }

May import: ``checks``, ``parallel`` (the DP world-size rule).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ulysses_sp.checks import optional_positive_int, positive_int
from ulysses_sp.config.batch import BatchSizes, resolve_batch_sizes
from ulysses_sp.config.sections import (
    BF16Config,
    FP16Config,
    OptimizerConfig,
    SchedulerConfig,
    ZeroConfig,
    reject_unknown,
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
    bf16: BF16Config = field(default_factory=BF16Config)
    """bf16 mixed precision (``state/precision.py``); off by default (fp32)."""
    fp16: FP16Config = field(default_factory=FP16Config)
    """fp16 mixed precision with dynamic loss scaling; off by default."""
    max_nonfinite_steps: int = 3
    """Optimizer steps in a row with a non-finite loss or gradient norm that are skipped; the next
    one raises ``DivergenceError`` (the divergence guard, ``engine/divergence.py``)."""

    def __post_init__(self) -> None:
        if self.bf16.enabled and self.fp16.enabled:
            raise ValueError("bf16.enabled and fp16.enabled are both true; enable one of them")
        for name in _SIZE_FIELDS:
            optional_positive_int(name, getattr(self, name))
        positive_int("max_nonfinite_steps", self.max_nonfinite_steps)
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
        reject_unknown("", config, [f.name for f in fields(cls)])
        kwargs = dict(config)
        sections = {
            "zero_optimization": ZeroConfig,
            "optimizer": OptimizerConfig,
            "scheduler": SchedulerConfig,
            "bf16": BF16Config,
            "fp16": FP16Config,
        }
        for key, section_cls in sections.items():
            section = kwargs.get(key)
            if section is None:
                kwargs.pop(key, None)
                continue
            if not isinstance(section, Mapping):
                raise ValueError(f"{key} must be a dict, got {section!r}")
            reject_unknown(f"{key}.", section, [f.name for f in fields(section_cls)])
            if section_cls in (OptimizerConfig, SchedulerConfig) and "type" not in section:
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
            if f.name in ("zero_optimization", "optimizer", "scheduler", "bf16", "fp16"):
                value = {k: v for k, v in asdict(value).items() if v is not None}
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
