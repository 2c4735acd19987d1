"""Instruments: bytes through collectives (deterministic), and wall time per phase or per function.

Pure torch (imported in both virtual environments). ``CollectiveCounter`` wraps the functions of
``torch.distributed`` that ulysses-sp's parallel/comm.py and DeepSpeed's comm layer both end up calling, looked
up at call time, and records for each call the bytes this rank sends to *other* ranks (its own slice of
an all-to-all never leaves the process, so it is not counted) under the current phase label.
``PhaseTimer`` times named phases of a step; ``CallTimer`` sums the time spent inside one function.
Peak tensor memory is the other instrument: ``bench/memmeter.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import defaultdict

import torch
import torch.distributed as dist


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclasses.dataclass
class CollectiveCounter:
    """Counts bytes sent to other ranks, by ``(phase, op)``; use as a context manager."""

    phase: str = "other"
    sent: dict = dataclasses.field(default_factory=lambda: defaultdict(int))
    calls: dict = dataclasses.field(default_factory=lambda: defaultdict(int))

    def _add(self, op: str, nbytes: int) -> None:
        self.sent[(self.phase, op)] += int(nbytes)
        self.calls[(self.phase, op)] += 1

    @contextlib.contextmanager
    def label(self, phase: str):
        prev = self.phase
        self.phase = phase
        try:
            yield self
        finally:
            self.phase = prev

    def total(self, phase: str, op: str | None = None) -> int:
        return sum(v for (p, o), v in self.sent.items() if p == phase and (op is None or o == op))

    def ncalls(self, phase: str, op: str | None = None) -> int:
        return sum(v for (p, o), v in self.calls.items() if p == phase and (op is None or o == op))

    def __enter__(self) -> CollectiveCounter:
        self._saved = {}
        counter = self

        def wrap(name, count):
            orig = getattr(dist, name)
            self._saved[name] = orig

            def wrapped(*args, **kwargs):
                counter._add(name, count(*args, **kwargs))
                return orig(*args, **kwargs)

            setattr(dist, name, wrapped)

        def group_of(kwargs, args, pos):
            return kwargs.get("group", args[pos] if len(args) > pos else None)

        def a2a_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **_):
            p = dist.get_world_size(group)
            me = dist.get_rank(group)
            if input_split_sizes:
                row = _nbytes(input) // max(input.shape[0], 1)
                return sum(s * row for j, s in enumerate(input_split_sizes) if j != me)
            return _nbytes(input) * (p - 1) // p

        def a2a(output_list, input_list, group=None, **_):
            me = dist.get_rank(group)
            return sum(_nbytes(t) for j, t in enumerate(input_list) if j != me)

        def all_gather(tensor_list, tensor, group=None, **_):
            # what this rank contributes reaches P-1 peers (the analytic lower bound of any algorithm)
            return _nbytes(tensor) * (dist.get_world_size(group) - 1)

        def all_gather_into(output, input, group=None, **_):
            return _nbytes(input) * (dist.get_world_size(group) - 1)

        def all_reduce(tensor, op=None, group=None, **_):
            # ring all-reduce: each rank sends 2 (P-1)/P of the buffer
            p = dist.get_world_size(group)
            return 2 * _nbytes(tensor) * (p - 1) // p

        def reduce_scatter(output, input, op=None, group=None, **_):
            p = dist.get_world_size(group)
            return _nbytes(input) * (p - 1) // p

        def reduce_scatter_list(output, input_list, op=None, group=None, **_):
            return (
                sum(_nbytes(t) for t in input_list)
                * (dist.get_world_size(group) - 1)
                // dist.get_world_size(group)
            )

        def broadcast(tensor, src=None, group=None, **_):
            return _nbytes(tensor) if dist.get_rank() == src else 0

        wrap("all_to_all_single", a2a_single)
        wrap("all_to_all", a2a)
        wrap("all_gather", all_gather)
        wrap("all_gather_into_tensor", all_gather_into)
        wrap("all_reduce", all_reduce)
        wrap("reduce_scatter_tensor", reduce_scatter)
        wrap("reduce_scatter", reduce_scatter_list)
        wrap("broadcast", broadcast)
        return self

    def __exit__(self, *exc) -> None:
        for name, orig in self._saved.items():
            setattr(dist, name, orig)


class PhaseTimer:
    """Wall time per named phase per step: ``with timer("forward"): ...``; ``best()`` = min over steps.

    The minimum over steps is the estimator least disturbed by other load on a shared machine.
    """

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
    """Seconds spent inside ``owner.name`` while active: ``with CallTimer(dist, "all_to_all_single") as t``.

    ``t.seconds`` accumulates (reset it by assignment); the original function is restored on exit.
    """

    def __init__(self, owner, name: str) -> None:
        self.owner, self.name, self.seconds = owner, name, 0.0

    def __enter__(self) -> CallTimer:
        self._orig = orig = getattr(self.owner, self.name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        setattr(self.owner, self.name, timed)
        return self

    def __exit__(self, *exc) -> None:
        setattr(self.owner, self.name, self._orig)
