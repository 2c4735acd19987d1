"""The divergence guard: a non-finite step is skipped and counted, a diverged run stops loud.

Where it sits in the step (DESIGN.md, step 7): ``Engine.step`` at the accumulation boundary asks
``DivergenceGuard.admit(loss, grad_norm)`` whether to apply the optimizer step. Both numbers are
already **global** when it asks — the loss is reduced over the DP axis (and over the SP group by the
loss itself), the gradient norm is that of the reduced gradient (DDP's all-reduce, FSDP2's
``full_tensor``) — so every rank reaches the same verdict with no collective of its own: the guard
adds nothing to the hot path's synchronisation. NaN and inf propagate through every sum, so one
rank's non-finite shard makes the global number non-finite everywhere.

A bad step is skipped (no optimizer step, no scheduler step, gradients zeroed) and counted; after
``max_consecutive`` bad steps in a row ``DivergenceError`` is raised, naming the step and what to
try. ``check_finite_model`` is the check before a checkpoint is written (a non-finite model is never
saved) and before ``eval`` reports a loss.

``check_sp_attention`` guards the other silent failure: a transformers model trained on sequence
shards (sp > 1) whose attention is not the SP attention attends only within its own shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ulysses_sp.attention.registration import ATTN_NAME, registered_layout
from ulysses_sp.checks import positive_int
from ulysses_sp.parallel.comm import raise_if_any_rank_failed

HINT = (
    "Try a lower --lr (e.g. 10x lower), gradient clipping (--grad-clip 1.0), a longer warmup, or bf16 "
    "instead of fp16 (fp16 overflows at 65504)."
)
"""What to try when a run diverges (the end of every divergence message)."""


class DivergenceError(RuntimeError):
    """Raised when ``max_consecutive`` optimizer steps in a row had a non-finite loss or gradient."""

    def __init__(self, message: str, *, step: int, bad_steps: int) -> None:
        super().__init__(message)
        self.step = step
        """The optimizer step (1-based, counting skipped ones) at which the run stopped."""
        self.bad_steps = bad_steps
        """Consecutive non-finite steps up to and including ``step``."""


@dataclass(kw_only=True)
class DivergenceGuard:
    """Per-engine state of the guard (one per ``Engine``; not shared, not module-level).

    ``admit`` is called once per optimizer step with that step's global loss and gradient norm.
    """

    max_consecutive: int = 3
    """Consecutive non-finite steps tolerated; the next one raises ``DivergenceError``."""
    steps: int = 0
    """Optimizer steps seen (applied or skipped)."""
    skipped: int = 0
    """Steps skipped in total."""
    consecutive: int = 0
    """Steps skipped in a row up to now (0 after an applied step)."""
    last_skipped: bool = False
    """Whether the most recent step was skipped."""
    history: list[int] = field(default_factory=list)
    """The (1-based) numbers of the skipped steps of the current bad streak."""

    def __post_init__(self) -> None:
        positive_int("max_consecutive (non-finite steps tolerated in a row)", self.max_consecutive)

    def admit(self, loss: float | None, grad_norm: float | None) -> bool:
        """Whether to apply this step: ``False`` (skip) when the loss or gradient norm is not finite.

        Raises:
            DivergenceError: the ``max_consecutive``-th non-finite step in a row.
        """
        self.steps += 1
        finite = all(v is None or math.isfinite(v) for v in (loss, grad_norm))
        self.last_skipped = not finite
        if finite:
            self.consecutive = 0
            self.history.clear()
            return True
        self.skipped += 1
        self.consecutive += 1
        self.history.append(self.steps)
        if self.consecutive >= self.max_consecutive:
            raise DivergenceError(
                f"training diverged: the loss or gradient norm was not finite in {self.consecutive} steps "
                f"in a row (steps {self.history}; last loss {loss}, gradient norm {grad_norm}); the steps "
                f"were skipped, the model holds the weights of step {self.steps - self.consecutive}. {HINT}",
                step=self.steps,
                bad_steps=self.consecutive,
            )
        return False


def local_nonfinite(tensors: list[torch.Tensor]) -> bool:
    """Whether any of this rank's ``tensors`` (or ``DTensor`` shards) holds a NaN or inf.

    Local: for sharded parameters the caller combines the ranks' answers (``all_reduce_max``).
    """
    from torch.distributed.tensor import DTensor

    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        if local.numel() and not bool(torch.isfinite(local.detach()).all()):
            return True
    return False


def nonfinite_names(state: dict[str, torch.Tensor], limit: int = 5) -> list[str]:
    """Names of the (full, unsharded) tensors of ``state`` that hold a NaN or inf (at most ``limit``)."""
    bad = []
    for name, t in state.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad.append(name)
            if len(bad) == limit:
                break
    return bad


def check_finite_model(state: dict[str, torch.Tensor], where: str) -> None:
    """Raise ``ValueError`` if a full model state (e.g. a checkpoint's weights) is not finite."""
    bad = nonfinite_names(state)
    if bad:
        raise ValueError(
            f"{where}: the weights hold NaN or inf (e.g. {', '.join(bad)}): this model diverged; evaluate "
            f"an earlier checkpoint. {HINT}"
        )


def check_sp_attention(model: Any, batch: dict[str, Any], sp_group: Any, sp_size: int) -> None:
    """Raise ``ValueError`` on every rank of ``sp_group`` when a transformers model (one that
    dispatches attention through ``AttentionInterface``: it has ``config._attn_implementation``)
    receives sequence **shards** (position ids not starting at 0, as ``UlyssesSPDataLoaderAdapter``
    makes them on SP ranks > 0) while its attention is not the SP attention: each rank would attend
    within its own shard only — a wrong loss and no error.

    Whole sequences per rank (SP used only to share the loss, position ids from 0) are fine. The
    ``Engine`` calls it on its first training forward; a collective over ``sp_group`` only when
    ``sp_size > 1`` and the model is such an unregistered model (the same on every rank).
    """
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if sp_size == 1 or impl is None or registered_layout(model) is not None:
        return
    pos = batch.get("position_ids")
    sharded = isinstance(pos, torch.Tensor) and pos.numel() > 0 and int(pos.min()) > 0
    error = None
    if sharded:
        error = (
            f"the model's attention is {impl!r}, not the sequence-parallel attention, but it is trained on "
            f"sequence shards (sp_size {sp_size}): each rank would attend only within its own shard. Call "
            f"mpu = UlyssesSPAttentionHF.register_with_transformers(model, {impl!r}, {sp_size}, micro_batch_size, "
            f"seq_length=...) before initialize(model, config, mpu=mpu) (or load the model with "
            f"attn_implementation={ATTN_NAME!r} after registering)"
        )
    raise_if_any_rank_failed(error, sp_group)
