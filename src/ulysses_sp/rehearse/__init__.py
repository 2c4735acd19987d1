"""Rehearsal of the real training step on fake tensors and a fake process group (``train --rehearse``).

Owns: the fake stage (``fake``), the per-place storage tracker (``tracker``), the rehearsed step
(``step``), the run-level driver beside the planner (``run``) and its report (``report``).

May import: everything below it (``run``, ``engine``, ``state``, ``plan``, ``data``, ``parallel``,
``memory``, ``attention``, ``checks``); only ``cli`` imports it.
"""
