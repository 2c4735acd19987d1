"""``Engine``: forward with the sequence-parallel loss, backward with accumulation, the optimizer step.

The training loop, DeepSpeed-style (every call once per micro-step)::

    for batch in adapter:                      # UlyssesSPDataLoaderAdapter: local shards + shift_labels
        loss = engine(**batch).loss            # sp_causal_lm_loss over the SP group
        engine.backward(loss)                  # / grad_accum; gradient sync only at the boundary
        step_loss = engine.step()              # at the boundary: norm, clip, step, schedule, zero_grad

Where it sits in the step (DESIGN.md): steps 3, 5, 6 and 7 — the model forward on the local
shard, the loss, the backward, and the sharding engine's gradient reduction and optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from ulysses_sp.config import TrainingConfig
from ulysses_sp.config.batch import BatchSizes
from ulysses_sp.engine.divergence import DivergenceGuard, check_sp_attention
from ulysses_sp.parallel.comm import all_reduce_sum
from ulysses_sp.parallel.loss import sp_causal_lm_loss
from ulysses_sp.parallel.mesh import SPMesh
from ulysses_sp.state.precision import policy_for, scaler_for, unscale_grads_

LossFn = Callable[[nn.Module, dict[str, Any], torch.Tensor, Any], Any]
"""``loss_fn(model, batch, shift_labels, sp_group) -> outputs`` with ``outputs.loss`` set."""


class Engine:
    """A model wrapped in DDP or FSDP2 over the ``(dp, sp)`` mesh, with its optimizer and schedule.

    Built by ``ulysses_sp.initialize``; see there for the arguments. Attributes:

    - ``module``: the user's model, as trained (for FSDP2 its parameters are ``DTensor`` shards);
      what DeepSpeed calls ``engine.module``.
    - ``wrapper``: what ``engine(**batch)`` calls: the ``DistributedDataParallel`` wrapper at
      stages 0/1, ``module`` itself at stages 2/3.
    - ``mesh``: the run's ``SPMesh``; ``sp_group``, ``dp_group``, ``dp_size``, ``sp_size``,
      ``dp_rank``, ``sp_rank`` and ``device`` read from it.
    - ``mpu``, ``zero_stage``, ``partition``, ``optimizer``, ``lr_scheduler``, ``config``,
      ``batch_sizes``, ``micro_steps``, ``global_steps``, ``last_loss``.
    - ``guard``: the ``DivergenceGuard`` (``skipped_steps``, ``last_step_skipped``): a step whose
      loss or gradient norm is not finite is skipped; ``max_nonfinite_steps`` in a row raise.
    """

    def __init__(
        self,
        *,
        module: nn.Module,
        wrapper: nn.Module,
        optimizer: Optimizer | None,
        lr_scheduler: Any,
        mesh: SPMesh,
        mpu: Any,
        config: TrainingConfig,
        batch_sizes: BatchSizes,
        loss_fn: LossFn | None = None,
    ) -> None:
        self.module, self.wrapper = module, wrapper
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.mesh, self.mpu, self.config, self.batch_sizes = mesh, mpu, config, batch_sizes
        self.loss_fn = loss_fn
        self.zero_stage = config.zero_optimization.stage
        self.partition = config.zero_optimization.partition
        self.device = mesh.device
        self.micro_steps = 0
        """Micro-steps taken (``step()`` calls)."""
        self.global_steps = 0
        """Optimizer steps taken."""
        self.last_loss: float | None = None
        """The last optimizer step's loss: mean over its micro-steps, averaged over the DP axis."""
        self._grad_norm: float | None = None
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self.precision = policy_for(config)
        """The dtype policy (``state/precision.py``): compute dtype, CPU offload."""
        self.loss_scaler = scaler_for(config)
        """fp16's ``DynamicLossScaler``; ``None`` in fp32 and bf16."""
        self._overflow_skips = 0  # fp16 steps whose gradient overflowed (the scaler's skips)
        self._overflowed = False
        self._backward_since_step = False
        self._attention_checked = False
        self.guard = DivergenceGuard(max_consecutive=config.max_nonfinite_steps)

    # the layout, read from the mesh
    @property
    def dp_size(self) -> int:
        return self.mesh.dp_size

    @property
    def sp_size(self) -> int:
        return self.mesh.sp_size

    @property
    def dp_rank(self) -> int:
        return self.mesh.dp_rank

    @property
    def sp_rank(self) -> int:
        return self.mesh.sp_rank

    @property
    def sp_group(self) -> Any:
        return self.mesh.sp_group

    @property
    def dp_group(self) -> Any:
        return self.mesh.dp_group

    # DeepSpeed-style accessors
    def train_batch_size(self) -> int:
        return self.batch_sizes.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.batch_sizes.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.batch_sizes.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-step is the last of an optimizer step."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def get_global_grad_norm(self) -> float | None:
        """L2 norm of the full reduced gradient of the last optimizer step, before clipping."""
        return self._grad_norm

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped (counted in ``global_steps``): a non-finite loss or gradient norm
        (the divergence guard), or an fp16 gradient overflow (the loss scaler)."""
        return self.guard.skipped + self._overflow_skips

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (non-finite loss/gradient norm, fp16 overflow)."""
        return self.guard.last_skipped or self._overflowed

    def get_lr(self) -> list[float]:
        """The current learning rate of each param group."""
        return [g["lr"] for g in self.optimizer.param_groups] if self.optimizer is not None else []

    def train(self, mode: bool = True) -> Engine:
        self.wrapper.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    # the step
    def __call__(self, *args: Any, **batch: Any) -> Any:
        return self.forward(*args, **batch)

    def forward(self, *args: Any, **batch: Any) -> Any:
        """Run the model; with ``shift_labels`` in the batch, also the SP loss into ``outputs.loss``.

        ``shift_labels [B, S_l]`` (the data adapter's key) is popped so the model never sees it;
        the loss is ``loss_fn(wrapper, batch, shift_labels, sp_group)`` if one was given, else
        ``sp_causal_lm_loss(outputs.logits, shift_labels, sp_group)``.
        """
        if torch.is_grad_enabled() and self.wrapper.training:
            self._set_gradient_sync(self.is_gradient_accumulation_boundary())
        # stages 0/1: autocast casts per op; stages 2/3: FSDP2's MixedPrecisionPolicy casts the units
        with self.precision.autocast(self.device, enabled=self.zero_stage <= 1):
            try:
                return self._forward(*args, **batch)
            except RuntimeError as e:  # DDP's, pointing at a keyword the engine sets itself
                if "Expected to have finished reduction" not in str(e):
                    raise
                raise ValueError(
                    "a parameter of the model got no gradient in the previous step under ZeRO stage 0/1 (DDP), so "
                    "that step's gradients were not fully reduced. DDP looks for unused parameters only in VLMs "
                    "and mixtures of experts (engine.sharding.may_leave_parameters_unused); freeze the parameters "
                    "the model does not use (requires_grad_(False)) or make every parameter take part in the loss"
                ) from e

    def _forward(self, *args: Any, **batch: Any) -> Any:
        shift_labels = batch.pop("shift_labels", None)
        if shift_labels is None:
            return self.wrapper(*args, **batch)
        if not self._attention_checked:  # once: shards on a model whose attention is not SP's
            check_sp_attention(self.module, batch, self.sp_group, self.sp_size)
            self._attention_checked = True
        if args:
            raise ValueError("with shift_labels, pass the whole batch as keyword arguments")
        if getattr(getattr(self.module, "config", None), "use_cache", None) is not None:
            # no KV cache in training; with one, transformers ignores packed position ids and lets
            # packed documents attend to each other (at sp = 1, where its own attention runs)
            batch.setdefault("use_cache", False)
        if self.loss_fn is not None:
            return self.loss_fn(self.wrapper, batch, shift_labels, self.sp_group)
        outputs = self.wrapper(**batch)
        logits = getattr(outputs, "logits", None)
        if logits is None:
            raise ValueError(
                "the model output has no .logits; pass initialize(..., loss_fn=...) to compute the loss"
            )
        loss = sp_causal_lm_loss(logits, shift_labels, self.sp_group)
        if isinstance(outputs, MutableMapping):  # transformers ModelOutput: keep item and attribute in step
            outputs["loss"] = loss
        else:
            outputs.loss = loss
        return outputs

    def _set_gradient_sync(self, sync: bool) -> None:
        # Decided at forward time: DDP prepares its reducer in forward (this is what no_sync() sets).
        if isinstance(self.wrapper, DistributedDataParallel):
            self.wrapper.require_backward_grad_sync = sync
        elif isinstance(self.module, FSDPModule):
            self.module.set_requires_gradient_sync(sync)

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Back-propagate ``loss / gradient_accumulation_steps``; record ``loss`` for the step's report.

        Gradients are reduced (sum over SP, mean over DP) only on the boundary micro-step.
        """
        value = loss.detach().float()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._loss_count += 1
        self._backward_since_step = True
        ga = self.gradient_accumulation_steps()
        scaled = loss if self.loss_scaler is None else self.loss_scaler.scale_loss(loss)
        (scaled / ga if ga > 1 else scaled).backward()
        return loss

    def step(self) -> float | None:
        """End a micro-step; at the accumulation boundary take the optimizer step.

        At the boundary: reduce the step's loss, compute the global gradient norm, and — when both
        are finite (the divergence guard's verdict, the same on every rank since both numbers are
        global) — clip to ``gradient_clipping`` if > 0, ``optimizer.step()``,
        ``lr_scheduler.step()``; a non-finite step is skipped (no update, the LR does not move) and
        counted in ``skipped_steps``. Then ``zero_grad``; return the step's loss (mean over its
        micro-steps, averaged over the DP axis; ``None`` if ``backward`` never saw one).
        Off the boundary: return ``None``.

        Raises:
            ValueError: ``step()`` without a ``backward()`` since the last ``step()`` (it would count
                a micro-step and move the schedule with no gradient).
            DivergenceError: the ``max_nonfinite_steps``-th non-finite step in a row.
        """
        if not self._backward_since_step:
            raise ValueError(
                "engine.step() without engine.backward(loss) since the last step(): call "
                "engine.backward(engine(**batch).loss) once per micro-step, then engine.step()"
            )
        self._backward_since_step = False
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return None
        if self.optimizer is None:
            raise ValueError(
                "engine.step() needs an optimizer: add an 'optimizer' section or pass optimizer="
            )
        self.last_loss = self._reduce_loss()
        self._grad_norm = self._norm_and_clip()
        self.global_steps += 1
        self._overflowed = self._grad_norm is None
        try:
            if self._overflowed:  # fp16 overflow: the scaler skips it (DeepSpeed's behaviour), not divergence
                self._overflow_skips += 1
            elif self.guard.admit(self.last_loss, self._grad_norm):
                self.optimizer.step()
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step()
        finally:
            self.optimizer.zero_grad(set_to_none=True)
        return self.last_loss

    def _norm_and_clip(self) -> float | None:
        """The global grad norm (after fp16 unscaling) and clipping; ``None``: fp16 overflow, skip."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        if not params:
            return 0.0
        total = torch.nn.utils.get_total_norm([p.grad for p in params])
        if isinstance(total, DTensor):  # FSDP2: per-shard partial norms -> the full norm
            total = total.full_tensor()
        if self.loss_scaler is not None:  # the same norm on every rank: the same verdict
            scale = self.loss_scaler.scale
            if not self.loss_scaler.update(float(total)):
                return None
            unscale_grads_([p.grad for p in params], scale)
            total = total / scale
        clip = self.config.gradient_clipping
        if clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, clip, total)
        return float(total)

    def _reduce_loss(self) -> float | None:
        if self._loss_sum is None:
            return None
        mean = self._loss_sum / self._loss_count
        self._loss_sum, self._loss_count = None, 0
        return float(all_reduce_sum(mean, self.dp_group) / self.dp_size)

    def __repr__(self) -> str:
        return (
            f"Engine(zero_stage={self.zero_stage}, partition={self.partition!r}, dp_size={self.dp_size}, "
            f"sp_size={self.sp_size}, device={self.device})"
        )
