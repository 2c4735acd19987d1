"""The sections of the training config: ``zero_optimization``, ``optimizer``, ``scheduler``.

Each section is a frozen, keyword-only dataclass that validates itself; the tables of what exists
(``ZERO_STAGES``, ``PARTITIONS``, ``OPTIMIZERS``, ``SCHEDULERS`` with each schedule's defaults)
live here once, and the engine builds from them. ``reject_unknown`` is the one unknown-key check
(with a did-you-mean) every section and the top level use.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ulysses_sp.checks import positive_int

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
``total_num_steps``; for ``warmup_max_lr`` it means the optimizer's own lr). The one place these
defaults are written: the scheduler classes (``engine.schedulers``) take theirs from here."""

# DeepSpeed keys we know but do not implement: named as such instead of as typos.
_DEEPSPEED_ONLY = {
    "amp", "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer",
    "gradient_predivide_factor", "prescale_gradients", "communication_data_type", "activation_checkpointing",
    "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comms_logger", "dataloader_drop_last",
    "seq_parallel_communication_data_type", "overlap_comm",
    "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size", "reduce_scatter",
    "allgather_partitions", "round_robin_gradients", "sub_group_size", "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save", "elasticity", "compression_training", "checkpoint",
}  # fmt: skip


def reject_unknown(where: str, given: Mapping[str, Any], known: list[str]) -> None:
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


OFFLOAD_DEVICES = ("none", "cpu")


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """``zero_optimization.offload_param`` / ``offload_optimizer``: where the model states live."""

    device: str = "none"
    """``"cpu"``: host memory (FSDP2 ``CPUOffloadPolicy``, stage 3 only); ``"none"``: the accelerator."""
    pin_memory: bool = True
    """Pin the host copies (page-locked, faster copies) when the run's device is an accelerator."""

    def __post_init__(self) -> None:
        if self.device not in OFFLOAD_DEVICES:
            hint = " (NVMe offload is DeepSpeed-only)" if self.device == "nvme" else ""
            raise ValueError(f"offload device must be one of {OFFLOAD_DEVICES}, got {self.device!r}{hint}")
        if not isinstance(self.pin_memory, bool):
            raise ValueError(f"offload pin_memory must be true or false, got {self.pin_memory!r}")


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """The ``zero_optimization`` section: what is partitioned, and across which ranks."""

    stage: int = 0
    """0: nothing partitioned (DDP); 1: + optimizer state; 2: + gradients; 3: + parameters."""
    partition: str = "data_parallel"
    """Ranks the partitions span: ``"data_parallel"`` (the DP axis, as DeepSpeed) or ``"all"`` (dp*sp)."""
    offload_param: OffloadConfig | None = None
    """Parameters (and their gradients) in host memory; ``None``: not offloaded."""
    offload_optimizer: OffloadConfig | None = None
    """Optimizer state and step in host memory; ``None``: not offloaded."""

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in ZERO_STAGES:
            raise ValueError(f"zero_optimization.stage must be one of {ZERO_STAGES}, got {self.stage!r}")
        if self.partition not in PARTITIONS:
            raise ValueError(
                f"zero_optimization.partition must be one of {PARTITIONS}, got {self.partition!r}"
            )
        for key in ("offload_param", "offload_optimizer"):
            value = getattr(self, key)
            if isinstance(value, Mapping):
                reject_unknown(f"zero_optimization.{key}.", value, ["device", "pin_memory"])
                value = OffloadConfig(**value)
                object.__setattr__(self, key, value)
            if value is not None and not isinstance(value, OffloadConfig):
                raise ValueError(
                    f"zero_optimization.{key} must be a dict like {{'device': 'cpu'}}, got {value!r}"
                )
        if self.cpu_offload and self.stage != 3:
            raise ValueError(
                f"CPU offload of model states (zero_optimization.offload_param / offload_optimizer device 'cpu') "
                f"needs zero_optimization.stage 3, got stage {self.stage}: FSDP2's CPUOffloadPolicy offloads "
                "sharded parameters, gradients and the optimizer step together; use stage 3"
            )

    @property
    def cpu_offload(self) -> bool:
        """Whether any model state is offloaded to host memory."""
        return any(o is not None and o.device == "cpu" for o in (self.offload_param, self.offload_optimizer))

    @property
    def pin_memory(self) -> bool:
        """Pin offloaded host memory (on an accelerator): unless an enabled offload section says no."""
        return all(o.pin_memory for o in (self.offload_param, self.offload_optimizer) if o is not None)


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
        reject_unknown("optimizer.params.", self.params, known)
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
        reject_unknown("scheduler.params.", self.params, list(defaults))
        merged = {**defaults, **self.params}
        if "total_num_steps" in merged:
            positive_int("scheduler.params.total_num_steps", merged["total_num_steps"])
        positive_int("scheduler.params.warmup_num_steps", merged["warmup_num_steps"])
        if merged["warmup_type"] not in ("log", "linear"):
            raise ValueError(
                f"scheduler.params.warmup_type must be 'log' or 'linear', got {merged['warmup_type']!r}"
            )

    @property
    def kwargs(self) -> dict[str, Any]:
        """The parameters with defaults filled in, ready for the scheduler class."""
        return {**SCHEDULERS[self.type], **self.params}


@dataclass(frozen=True, kw_only=True)
class BF16Config:
    """The ``bf16`` section: compute in bfloat16, fp32 master weights, optimizer state and reduction."""

    enabled: bool = False
    """Turn bf16 mixed precision on."""

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"bf16.enabled must be true or false, got {self.enabled!r}")


@dataclass(frozen=True, kw_only=True)
class FP16Config:
    """The ``fp16`` section (DeepSpeed's keys): float16 compute with a dynamic loss scale."""

    enabled: bool = False
    """Turn fp16 mixed precision on."""
    loss_scale: float = 0.0
    """A fixed loss scale; ``0``: dynamic (start at ``2**initial_scale_power``)."""
    initial_scale_power: int = 16
    """The dynamic scale starts at ``2**initial_scale_power``."""
    loss_scale_window: int = 1000
    """Steps without overflow after which the dynamic scale doubles."""
    hysteresis: int = 2
    """Overflowing steps tolerated (skipped without halving) before the scale halves."""
    min_loss_scale: float = 1.0
    """The dynamic scale never drops below this."""

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"fp16.enabled must be true or false, got {self.enabled!r}")
        positive_int("fp16.initial_scale_power", self.initial_scale_power, minimum=0)
        positive_int("fp16.loss_scale_window", self.loss_scale_window)
        positive_int("fp16.hysteresis", self.hysteresis)
        for key in ("loss_scale", "min_loss_scale"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"fp16.{key} must be a number >= 0, got {value!r}")
        if self.min_loss_scale <= 0:
            raise ValueError(f"fp16.min_loss_scale must be > 0, got {self.min_loss_scale!r}")
