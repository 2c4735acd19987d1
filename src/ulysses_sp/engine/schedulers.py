"""DeepSpeed's warmup learning-rate schedules as ordinary ``torch.optim.lr_scheduler.LRScheduler`` s.

Names and parameters mirror DeepSpeed's ``lr_schedules`` (``WarmupLR``, ``WarmupDecayLR``,
``WarmupCosineLR``) so a DeepSpeed ``scheduler`` section works unchanged. Step counting follows
torch: optimizer step ``k`` (0-based) runs with the lr computed for ``k``; the engine calls
``scheduler.step()`` once per optimizer step (not per micro-step). Being ``LRScheduler`` s they
have ``state_dict``/``load_state_dict`` for exact resume. Their parameters' defaults are
``config.SCHEDULERS``'s (the one table, which the config's validation also reads).
"""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from ulysses_sp.config.sections import SCHEDULERS

_LR, _DECAY, _COS = SCHEDULERS["WarmupLR"], SCHEDULERS["WarmupDecayLR"], SCHEDULERS["WarmupCosineLR"]


class _Warmup(LRScheduler):
    """Shared warmup: a ramp over ``warmup_num_steps`` steps, ``"log"`` or ``"linear"`` shaped."""

    def __init__(
        self, optimizer: Optimizer, *, warmup_num_steps: int, warmup_type: str, last_epoch: int
    ) -> None:
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")
        # DeepSpeed clamps to 2 so that log(warmup_num_steps) is not 0.
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_epoch)

    def _warmup_fraction(self, step: int) -> float:
        """0 at step 0, rising to 1 at ``warmup_num_steps`` (DeepSpeed's ``gamma``)."""
        if step >= self.warmup_num_steps:
            return 1.0
        if self.warmup_type == "log":
            return math.log(step + 1) / math.log(self.warmup_num_steps)
        return step / self.warmup_num_steps


class WarmupLR(_Warmup):
    """lr ramps from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then stays.

    ``warmup_max_lr=None`` means each param group's own lr (DeepSpeed's default is 1e-3).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        warmup_min_lr: float = _LR["warmup_min_lr"],
        warmup_max_lr: float | None = _LR["warmup_max_lr"],
        warmup_num_steps: int = _LR["warmup_num_steps"],
        warmup_type: str = _LR["warmup_type"],
        last_epoch: int = -1,
    ) -> None:
        self.warmup_min_lr = warmup_min_lr
        self.warmup_max_lr = warmup_max_lr
        super().__init__(
            optimizer, warmup_num_steps=warmup_num_steps, warmup_type=warmup_type, last_epoch=last_epoch
        )

    def _gamma(self, step: int) -> float:
        return self._warmup_fraction(step)

    def get_lr(self) -> list[float]:
        gamma = self._gamma(self.last_epoch)
        out = []
        for base_lr in self.base_lrs:
            max_lr = base_lr if self.warmup_max_lr is None else self.warmup_max_lr
            out.append(self.warmup_min_lr + (max_lr - self.warmup_min_lr) * gamma)
        return out


class WarmupDecayLR(WarmupLR):
    """``WarmupLR``, then linear decay back to ``warmup_min_lr`` at ``total_num_steps``."""

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        total_num_steps: int,
        warmup_min_lr: float = _DECAY["warmup_min_lr"],
        warmup_max_lr: float | None = _DECAY["warmup_max_lr"],
        warmup_num_steps: int = _DECAY["warmup_num_steps"],
        warmup_type: str = _DECAY["warmup_type"],
        last_epoch: int = -1,
    ) -> None:
        if total_num_steps < warmup_num_steps:
            raise ValueError(f"total_num_steps ({total_num_steps}) < warmup_num_steps ({warmup_num_steps})")
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer,
            warmup_min_lr=warmup_min_lr,
            warmup_max_lr=warmup_max_lr,
            warmup_num_steps=warmup_num_steps,
            warmup_type=warmup_type,
            last_epoch=last_epoch,
        )

    def _gamma(self, step: int) -> float:
        if step < self.warmup_num_steps:
            return self._warmup_fraction(step)
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - step) / span)


class WarmupCosineLR(_Warmup):
    """lr ratio ramps from ``warmup_min_ratio`` to 1, then follows a cosine down to ``cos_min_ratio``
    at ``total_num_steps``; the ratio multiplies each param group's own lr."""

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        total_num_steps: int,
        warmup_min_ratio: float = _COS["warmup_min_ratio"],
        warmup_num_steps: int = _COS["warmup_num_steps"],
        cos_min_ratio: float = _COS["cos_min_ratio"],
        warmup_type: str = _COS["warmup_type"],
        last_epoch: int = -1,
    ) -> None:
        if total_num_steps < warmup_num_steps:
            raise ValueError(f"total_num_steps ({total_num_steps}) < warmup_num_steps ({warmup_num_steps})")
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        super().__init__(
            optimizer, warmup_num_steps=warmup_num_steps, warmup_type=warmup_type, last_epoch=last_epoch
        )

    def _ratio(self, step: int) -> float:
        if step < self.warmup_num_steps:
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * self._warmup_fraction(step)
        done = min(step - self.warmup_num_steps, self.total_num_steps - self.warmup_num_steps)
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        cosine = (1.0 + math.cos(math.pi * done / span)) / 2.0
        return self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine

    def get_lr(self) -> list[float]:
        ratio = self._ratio(self.last_epoch)
        return [base_lr * ratio for base_lr in self.base_lrs]


SCHEDULER_CLASSES: dict[str, type[LRScheduler]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
}
"""``scheduler.type`` (canonical spelling, see ``config.SCHEDULERS``) -> class."""
