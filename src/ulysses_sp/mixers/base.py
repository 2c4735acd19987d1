"""The contract every sequence-mixer handler meets, and the undoable pass that applies them.

A *sequence mixer* is a module of a decoder layer that mixes tokens along the sequence by other
means than the registered SP attention (a scan, a recurrence, a causal convolution). Under
sequence parallelism each rank holds ``[B, S_l, ...]``; a mixer that runs on the local shard alone
restarts its state at every shard boundary: a silently wrong result. A handler makes one kind of
mixer exact: its input projections run on the local tokens, an all-to-all turns sequence shards
into head shards (``[B, S_l, H, ...] -> [B, S, H_l, ...]``), the model's own kernel runs over the
full sequence for the rank's heads, and the inverse all-to-all returns the output to the local
tokens.

``MixerHandler`` is what a handler module provides; ``shard_mixers(model, mesh, handlers)`` wraps
every module some handler claims and returns a handle whose ``remove()`` restores the model. The
closed-world guard asks ``claimed_by(module, handlers)`` whether a module is handled.

Shape legend: ``B`` batch, ``S`` global sequence, ``S_l = S/P``, ``H`` heads, ``H_l = H/P``,
``P`` the SP group size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import nn


class MixerHandler(Protocol):
    """One kind of sequence mixer (e.g. Mamba-2's mixer module, a short convolution)."""

    name: str
    """Short name for messages and tables (``"mamba2"``, ``"short_conv"``, ``"gated_delta_net"``)."""

    def matches(self, module: nn.Module) -> bool:
        """True when this handler knows how to shard ``module`` (judged by structure, not model name)."""
        ...

    def check(self, module: nn.Module, sp_size: int) -> None:
        """Raise ``ValueError`` naming the module and the numbers when ``sp_size`` cannot shard it
        (e.g. heads not divisible by ``sp_size``)."""
        ...

    def wrap(self, module: nn.Module, mesh: Any) -> Callable[[], None]:
        """Make ``module`` sequence-parallel over ``mesh``'s SP group; return the undo."""
        ...


def claimed_by(module: nn.Module, handlers: Iterable[MixerHandler]) -> MixerHandler | None:
    """The first handler that matches ``module``, or ``None``."""
    for handler in handlers:
        if handler.matches(module):
            return handler
    return None


@dataclass
class MixerHandle:
    """What ``shard_mixers`` returns: which modules it wrapped, and ``remove()`` to undo all of them."""

    wrapped: list[tuple[str, str]] = field(default_factory=list)
    """``(module path, handler name)`` for every wrapped module, in model order."""
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def remove(self) -> None:
        """Restore every wrapped module (last wrapped first)."""
        while self._undo:
            self._undo.pop()()
        self.wrapped.clear()


def check_mixers(
    model: nn.Module, sp_size: int, handlers: Sequence[MixerHandler]
) -> list[tuple[str, nn.Module, MixerHandler]]:
    """Every ``(path, module, handler)`` a handler claims, each checked at ``sp_size``.

    Raises ``ValueError`` (every problem, one per line) when some claimed module cannot be sharded
    at ``sp_size``. The modules inside one whose handler sets ``whole`` (it runs the module's own
    forward, with what is inside, over the full sequence) are not claimed apart. Pure: reads the modules' sizes (a model on the meta device will do), so the
    launcher runs it before any worker starts and ``shard_mixers`` before it wraps anything.
    """
    claimed, whole = [], []
    for n, m in model.named_modules():
        if any(n.startswith(f"{w}.") for w in whole):
            continue  # inside a module whose handler runs its whole forward (``whole``): claimed with it
        if (h := claimed_by(m, handlers)) is not None:
            claimed.append((n, m, h))
            if getattr(h, "whole", False):
                whole.append(n)
    problems = []
    for name, module, handler in claimed:
        try:
            handler.check(module, sp_size)
        except ValueError as err:
            problems.append(f"{name}: {err}")
    if problems:
        raise ValueError("sequence parallelism cannot shard these mixers:\n" + "\n".join(problems))
    return claimed


def shard_mixers(model: nn.Module, mesh: Any, handlers: Sequence[MixerHandler]) -> MixerHandle:
    """Wrap every module of ``model`` that a handler claims; check all before wrapping any.

    Raises ``ValueError`` (every problem, one per line) before touching the model when some claimed
    module cannot be sharded at ``mesh``'s SP size. If a ``wrap`` still fails part-way, the modules
    already wrapped are restored before the error propagates.
    """
    claimed = check_mixers(model, mesh.sp_size, handlers)
    handle = MixerHandle()
    try:
        for name, module, handler in claimed:
            handle._undo.append(handler.wrap(module, mesh))
            handle.wrapped.append((name, handler.name))
    except BaseException:  # a wrap failed part-way: the model leaves as it came
        handle.remove()
        raise
    return handle
