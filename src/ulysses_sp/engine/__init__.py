"""The training engine: ``initialize()`` and ``Engine`` (DeepSpeed's shape, PyTorch's machinery).

``initialize`` builds or adopts the ``(dp, sp)`` mesh, wraps the model in DDP (ZeRO 0/1, with
``ZeroRedundancyOptimizer`` at 1) or FSDP2 (ZeRO 2/3) so that gradients are summed over the SP
group and averaged over the DP axis, and builds the optimizer, scheduler and DataLoader.

Modules, one concern each: ``build`` (``initialize``), ``engine`` (``Engine``: forward/backward/
step), ``sharding`` (DDP / FSDP2 over the mesh), ``optim`` (optimizer and scheduler construction),
``schedulers`` (DeepSpeed's warmup schedules), ``data`` (the DataLoader over ``training_data``).

May import: ``checks``, ``parallel``, ``attention``, ``memory``, ``data``, ``config``, ``mixers``, ``state``, ``vlm``.
"""

from __future__ import annotations

from ulysses_sp.engine.build import initialize
from ulysses_sp.engine.engine import Engine
from ulysses_sp.engine.schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = ["Engine", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "initialize"]
