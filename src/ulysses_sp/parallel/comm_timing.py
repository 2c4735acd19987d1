"""Timing of the library's collectives (``--profile-comm``): where the step's communication time goes.

``record_comm_times`` opens a recording scope; ``parallel/comm.py`` wraps each collective it wants counted in
``timed(kind)``, which synchronises the device before and after so that the wall time is the
collective's own. Outside a scope the cost is one ``ContextVar.get`` per collective. Sits at the
mesh layer: it measures, it does not communicate (``parallel/comm.py`` imports it, never the reverse).
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


@dataclass
class CommTimes:
    """Seconds spent in collectives while ``record_comm_times`` is active, by kind.

    ``sp``: the sequence-parallel collectives (attention all-to-alls, the position gather, the loss
    reduce); ``dp``: the gradient reduction issued through ``sum_over_sp_mean_over_dp_`` (DDP's
    hook, stages 0-1). FSDP2's own reduce-scatters and all-gathers (stages 2-3) run inside FSDP2
    and are not counted. The data adapter's shard exchange is not counted either (it is data
    loading, not the step's communication).
    """

    device: torch.device
    sp: float = 0.0
    dp: float = 0.0
    calls: dict[str, int] = field(default_factory=dict)


_RECORDER: contextvars.ContextVar[CommTimes | None] = contextvars.ContextVar(
    "ulysses_sp_comm_times", default=None
)


@contextlib.contextmanager
def record_comm_times(device: torch.device) -> Iterator[CommTimes]:
    """Time every collective of ``parallel/comm.py`` run inside (this thread/context), synchronising
    ``device`` before and after each so that the wall time is the collective's own.

    Costs a device synchronisation per collective while active and nothing when inactive (one
    ``ContextVar.get``). Gradient reductions become blocking while recording (they are timed).
    """
    times = CommTimes(device=device)
    token = _RECORDER.set(times)
    try:
        yield times
    finally:
        _RECORDER.reset(token)


def active_comm_times() -> CommTimes | None:
    """The recording scope's ``CommTimes`` in this context, or ``None`` when not recording."""
    return _RECORDER.get()


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device.type).synchronize(device)


@contextlib.contextmanager
def timed(kind: str, times: CommTimes | None = None) -> Iterator[None]:
    """Add the wall time of the body to ``times.<kind>`` (``times``: the active scope's by default;
    nothing is measured when there is none)."""
    times = times if times is not None else _RECORDER.get()
    if times is None:
        yield
        return
    _sync(times.device)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _sync(times.device)
        setattr(times, kind, getattr(times, kind) + time.perf_counter() - t0)
        times.calls[kind] = times.calls.get(kind, 0) + 1
