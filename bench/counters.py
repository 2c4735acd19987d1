"""Instruments: bytes through collectives (deterministic), and wall time per phase of a step.

Pure torch (imported in both virtual environments). ``CollectiveCounter`` wraps the functions of
``torch.distributed`` that ulysses-sp's parallel/comm.py and DeepSpeed's comm layer both end up calling,
looked up at call time, and records for each call the bytes this rank sends to *other* ranks (its own slice of
an all-to-all never leaves the process, so it is not counted) under the current phase label. ``timed`` times
one call on every rank, ``PhaseTimer`` named phases of a step; ``CallTimer`` sums the time inside one function.
Peak tensor memory is the library's ``ulysses_sp.memory.track_peak_memory``.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch
import torch.distributed as dist


def _nb(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _share(nbytes: int, group) -> int:
    """What one rank's ``nbytes`` sends to the others when they are spread evenly over the group."""
    p = dist.get_world_size(group)
    return nbytes * (p - 1) // p


def _a2a_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **_):
    if input_split_sizes:
        row, me = _nb(input) // max(input.shape[0], 1), dist.get_rank(group)
        return sum(s * row for j, s in enumerate(input_split_sizes) if j != me)
    return _share(_nb(input), group)


SENT = {  # op -> bytes this rank sends to other ranks, from the op's arguments (torch's parameter names)
    "all_to_all_single": _a2a_single,
    "all_to_all": lambda output_tensor_list, input_tensor_list, group=None, **_: sum(
        _nb(t) for j, t in enumerate(input_tensor_list) if j != dist.get_rank(group)),
    # what this rank contributes reaches P-1 peers (the analytic lower bound of any algorithm)
    "all_gather": lambda tensor_list, tensor, group=None, **_: _nb(tensor) * (dist.get_world_size(group) - 1),
    "all_gather_into_tensor": lambda output_tensor, input_tensor, group=None, **_: _nb(input_tensor) * (
        dist.get_world_size(group) - 1),
    "all_reduce": lambda tensor, op=None, group=None, **_: 2 * _share(_nb(tensor), group),  # ring: 2 (P-1)/P
    "reduce_scatter_tensor": lambda output, input, op=None, group=None, **_: _share(_nb(input), group),
    "reduce_scatter": lambda output, input_list, op=None, group=None, **_: _share(sum(map(_nb, input_list)), group),
    "broadcast": lambda tensor, src=None, group=None, **_: _nb(tensor) if dist.get_rank() == src else 0,
}  # fmt: skip


class CollectiveCounter:
    """Counts bytes sent to other ranks, by ``(phase, op)``; use as a context manager."""

    def __init__(self) -> None:
        self.phase = "other"
        self.sent: dict[tuple[str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)

    @contextlib.contextmanager
    def label(self, phase: str):
        prev, self.phase = self.phase, phase
        try:
            yield self
        finally:
            self.phase = prev

    def total(self, phase: str, op: str | None = None) -> int:
        return sum(v for (p, o), v in self.sent.items() if p == phase and (op is None or o == op))

    def ncalls(self, phase: str, op: str | None = None) -> int:
        return sum(v for (p, o), v in self.calls.items() if p == phase and (op is None or o == op))

    def __enter__(self) -> CollectiveCounter:
        self._saved = {name: getattr(dist, name) for name in SENT}
        for name, orig in self._saved.items():

            def wrapped(*args, _name=name, _orig=orig, **kwargs):
                self.sent[(self.phase, _name)] += int(SENT[_name](*args, **kwargs))
                self.calls[(self.phase, _name)] += 1
                return _orig(*args, **kwargs)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc) -> None:
        for name, orig in self._saved.items():
            setattr(dist, name, orig)


def timed(fn) -> float:
    """Wall seconds of ``fn()``, started on every rank together (a barrier first)."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class PhaseTimer:
    """Wall time per named phase per step: ``with timer("forward"): ...``; ``best()`` = min over steps
    (the estimator least disturbed by other load on a shared machine)."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = defaultdict(list)
        self.active = True

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.active:
                self.times[name].append(time.perf_counter() - t0)

    def best(self, skip: int = 1) -> dict[str, float]:
        return {k: min(v[skip:] or v) for k, v in self.times.items()}


class CallTimer:
    """Seconds inside ``owner.name`` while active, ``with CallTimer(dist, "all_to_all_single") as t``: ``t.seconds``
    accumulates (reset it by assignment), the original is restored on exit (bench/hf_trainer.py's collectives)."""

    def __init__(self, owner, name: str) -> None:
        self.owner, self.name, self.seconds = owner, name, 0.0

    def __enter__(self) -> CallTimer:
        self._orig = orig = getattr(self.owner, self.name)

        def wrapped(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        setattr(self.owner, self.name, wrapped)
        return self

    def __exit__(self, *exc) -> None:
        setattr(self.owner, self.name, self._orig)
