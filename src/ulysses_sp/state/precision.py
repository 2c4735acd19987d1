"""The dtype policy of a run: fp32, bf16 or fp16 mixed precision, and fp16's dynamic loss scale.

One rule at every ZeRO stage, what DeepSpeed and FSDP users expect: **compute in the low
precision; master weights, optimizer state and the gradient reduction in fp32; the loss and its
SP reduction in fp32** (``parallel/loss.py`` upcasts the logits). How each engine gets there:

====== ======================================================== ==================================
stage  compute copy                                             gradients reduced in
====== ======================================================== ==================================
0, 1   ``torch.autocast(device, dtype)`` around forward + loss  fp32 (the parameters are fp32, so
       (per-op casts: matmuls in low precision, norms and       are their ``.grad``; DDP reduces
       softmax kept fp32 by autocast's lists)                   what ``.grad`` holds)
2, 3   FSDP2 ``MixedPrecisionPolicy(param_dtype=dtype,          fp32 (``reduce_dtype``); the
       reduce_dtype=float32)``: the all-gathered parameters    sharded fp32 parameters are the
       are cast once per unit                                  master weights
====== ======================================================== ==================================

Autocast at stages 0/1 keeps one fp32 parameter set (no second low-precision copy to keep in
sync) at the cost of per-op casts; at stages 2/3 FSDP2 casts each gathered unit once. Both give
fp32 ``.grad`` on fp32 parameters, so the optimizer (and ZeRO-1's partitioned state) is fp32.

fp16 adds ``DynamicLossScaler`` (DeepSpeed's ``fp16`` keys): the loss is multiplied by the scale
before backward; at the step the global gradient norm (already computed for clipping, identical on
every rank) tells whether any gradient overflowed. On overflow the step is skipped (no optimizer or
scheduler step, ``engine.skipped_steps`` counts it) and, once ``hysteresis`` overflows have been
tolerated, the scale halves; after ``loss_scale_window`` clean steps it doubles. Clean steps divide
the gradients by the scale before clipping and the optimizer step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ulysses_sp.config import TrainingConfig
from ulysses_sp.config.sections import FP16Config

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The ``--dtype`` names and the compute dtype each means."""


@dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    """The compute dtype of a run and where the model states live (built by ``policy_for``)."""

    compute_dtype: torch.dtype = torch.float32
    """Dtype of the forward/backward compute; fp32 master weights and optimizer state in any case."""
    cpu_offload: bool = False
    """Parameters, gradients and the optimizer step in host memory (stage 3, FSDP2)."""
    pin_memory: bool = True
    """Pin the offloaded host memory when the device is an accelerator."""

    @property
    def name(self) -> str:
        """``"fp32"``, ``"bf16"`` or ``"fp16"``."""
        return {v: k for k, v in DTYPES.items()}[self.compute_dtype]

    @property
    def mixed(self) -> bool:
        """Whether compute runs in a lower precision than the fp32 master weights."""
        return self.compute_dtype != torch.float32

    def fsdp_kwargs(self, device: torch.device) -> dict:
        """``fully_shard`` keyword arguments: the ``mp_policy`` and the ``offload_policy``."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

        kwargs: dict = {}
        if self.mixed:
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=self.compute_dtype, reduce_dtype=torch.float32
            )
        offload = (
            CPUOffloadPolicy(pin_memory=self.pin_memory and device.type != "cpu")
            if self.cpu_offload
            else OffloadPolicy()
        )
        kwargs["offload_policy"] = offload
        return kwargs

    @contextlib.contextmanager
    def autocast(self, device: torch.device, *, enabled: bool) -> Iterator[None]:
        """``torch.autocast`` to the compute dtype when ``enabled`` and mixed (stages 0/1), else nothing."""
        if not (enabled and self.mixed):
            yield
            return
        with torch.autocast(device_type=device.type, dtype=self.compute_dtype):
            yield


def policy_for(config: TrainingConfig) -> PrecisionPolicy:
    """The policy a config's ``bf16`` / ``fp16`` / ``zero_optimization.offload_*`` sections mean."""
    dtype = torch.bfloat16 if config.bf16.enabled else torch.float16 if config.fp16.enabled else torch.float32
    zero = config.zero_optimization
    return PrecisionPolicy(compute_dtype=dtype, cpu_offload=zero.cpu_offload, pin_memory=zero.pin_memory)


class DynamicLossScaler:
    """fp16's loss scale: multiply the loss, detect overflow from the global grad norm, adapt.

    A fixed ``loss_scale > 0`` never changes (overflowing steps are still skipped).
    """

    def __init__(self, section: FP16Config) -> None:
        self.dynamic = section.loss_scale == 0
        self.scale = float(2**section.initial_scale_power) if self.dynamic else float(section.loss_scale)
        self.window, self.min_scale = section.loss_scale_window, float(section.min_loss_scale)
        self.hysteresis = section.hysteresis
        self._tolerated = section.hysteresis
        self._clean = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (back-propagate this one)."""
        return loss * self.scale

    def update(self, scaled_norm: float) -> bool:
        """Record one step's global gradient norm (of the scaled gradients); return whether it is
        finite (take the step) or overflowed (skip it). Adapts the scale."""
        finite = math.isfinite(scaled_norm)
        if not self.dynamic:
            return finite
        if finite:
            self._clean += 1
            if self._clean % self.window == 0:
                self.scale *= 2.0
                self._tolerated = self.hysteresis
            return True
        self._clean = 0
        self._tolerated -= 1
        if self._tolerated <= 0:
            self.scale = max(self.scale / 2.0, self.min_scale)
            self._tolerated = 1  # from here on every overflow halves, until the scale grows again
        return False

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "tolerated": self._tolerated, "clean": self._clean}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale, self._tolerated, self._clean = (
            float(state["scale"]),
            int(state["tolerated"]),
            int(state["clean"]),
        )


def scaler_for(config: TrainingConfig) -> DynamicLossScaler | None:
    """A loss scaler when fp16 is on, else ``None`` (bf16 has fp32's range: no scaling)."""
    return DynamicLossScaler(config.fp16) if config.fp16.enabled else None


def unscale_grads_(grads: list[torch.Tensor], scale: float) -> None:
    """Divide every gradient by ``scale`` in place (plain tensors or FSDP2 ``DTensor`` shards)."""
    if scale != 1.0:
        for g in grads:
            g.mul_(1.0 / scale)
