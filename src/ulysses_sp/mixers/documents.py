"""The full-sequence document layout a sharded mixer needs, from the model's ``position_ids``.

A linear-attention or convolution mixer is called by its decoder layer without ``position_ids``,
yet under sequence parallelism with packed documents it must know the *global* document boundaries:
its scan restarts at every document, and its causal convolution must not reach into the previous
document (also across a shard boundary). ``track_documents(model, mesh)`` installs a forward
pre-hook on the model that makes the forward's ``position_ids`` visible to the mixers it calls
(a ``ContextVar``, reset when the forward ends, also on error); the first mixer of a forward gathers
them over the SP group (``attention.masks.gather_positions``, one small all-gather) and every later
mixer of that forward reuses the ``SeqLayout`` (keyed on the ``position_ids`` tensor, released with it).

Under activation checkpointing a mixer's forward is re-run during backward, outside the model's
forward: it then uses the layout of its own most recent forward (the one being recomputed).

Shape legend: ``B`` batch, ``S`` global sequence, ``S_l = S/P``.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

from ulysses_sp.attention.masks import SeqLayout, gather_positions

TRACK_HINT = (
    "call ulysses_sp.mixers.documents.track_documents(model, mesh) once after shard_mixers, and pass "
    "the full-sequence position_ids of the local tokens to the model (UlyssesSPDataLoaderAdapter does)"
)


class DocumentTracker:
    """One model's per-forward position ids and the full-sequence layout derived from them."""

    def __init__(self, mesh: Any) -> None:
        self.sp_group = mesh.sp_group
        self._source: weakref.ref | None = None
        self._key: tuple[int, int] | None = None
        self._layout: SeqLayout | None = None
        self.gathers = 0
        """Position gathers run (one per forward with sharded mixers; tests count them)."""

    def layout(self, position_ids: torch.Tensor, batch: int) -> SeqLayout:
        """``[B|1, S_l]`` local position ids -> the full sequence's ``SeqLayout`` (cached per forward)."""
        key = (position_ids._version, batch)
        if self._source is not None and self._source() is position_ids and self._key == key:
            assert self._layout is not None
            return self._layout
        if position_ids.dim() != 2 or position_ids.shape[0] not in (1, batch):
            raise ValueError(
                f"position_ids must be [B, S_l] (or [1, S_l]) with B = {batch}, got {tuple(position_ids.shape)}"
            )
        positions = gather_positions(position_ids, self.sp_group, batch=batch, expected_len=None)  # [B|1, S]
        self.gathers += 1
        self._layout = SeqLayout.from_positions(positions)
        self._source, self._key = weakref.ref(position_ids, self._release), key
        return self._layout

    def _release(self, source: weakref.ref) -> None:
        if self._source is source:
            self._source, self._key, self._layout = None, None, None


_CURRENT: ContextVar[tuple[DocumentTracker, torch.Tensor | None] | None] = ContextVar(
    "ulysses_sp_mixer_positions", default=None
)


def track_documents(model: nn.Module, mesh: Any) -> Callable[[], None]:
    """Make ``model``'s ``position_ids`` visible to its sharded mixers; returns the undo.

    Hooks on ``model`` (any module whose ``forward`` takes ``position_ids``, e.g. a
    ``...ForCausalLM``): before its forward the position ids are recorded, after it (also on error)
    forgotten. Idempotent per model: a second call replaces the first.
    """
    previous = getattr(model, "_ulysses_sp_documents", None)
    if previous is not None:
        previous()
    tracker = DocumentTracker(mesh)
    signature = inspect.signature(model.forward)
    tokens: list[Any] = []

    def before(module: nn.Module, args: tuple, kwargs: dict) -> None:
        bound = signature.bind_partial(*args, **kwargs).arguments
        tokens.append(_CURRENT.set((tracker, bound.get("position_ids"))))

    def after(*_: Any) -> None:
        if tokens:
            _CURRENT.reset(tokens.pop())

    hooks = [
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, always_call=True),
    ]

    def undo() -> None:
        for h in hooks:
            h.remove()
        if model.__dict__.get("_ulysses_sp_documents") is undo:
            del model._ulysses_sp_documents, model._ulysses_sp_document_tracker

    model._ulysses_sp_documents = undo
    model._ulysses_sp_document_tracker = tracker
    return undo


def current_layout(batch: int, what: str) -> SeqLayout | None:
    """The running model forward's full-sequence layout, or ``None`` outside a tracked forward.

    Raises ``ValueError`` (naming ``what``) inside a tracked forward without ``position_ids``.
    """
    current = _CURRENT.get()
    if current is None:
        return None
    tracker, position_ids = current
    if position_ids is None:
        raise ValueError(f"{what} under sequence parallelism needs the model's position_ids: {TRACK_HINT}")
    return tracker.layout(position_ids, batch)
