"""Rehearsal of the real training step on fake tensors and a fake process group (``train --rehearse``).

Owns: the fake stage (``fake``), the per-place storage tracker (``tracker``), the rehearsed step
(``step``), the run-level driver beside the planner (``run``) and its report (``report``), and the HF
Trainer path's rehearsal (``trainer``: ``rehearse_trainer``, importable from here).

May import: everything below it (``run``, ``integrations``, ``engine``, ``state``, ``plan``, ``data``, ``parallel``,
``memory``, ``attention``, ``checks``); only ``cli`` imports it.
"""

from typing import Any

__all__ = ["rehearse_trainer"]


def __getattr__(name: str) -> Any:
    if name == "rehearse_trainer":  # lazily: the Trainer path imports transformers' Trainer
        from ulysses_sp.rehearse.trainer import rehearse_trainer

        return rehearse_trainer
    raise AttributeError(f"module 'ulysses_sp.rehearse' has no attribute {name!r}")
