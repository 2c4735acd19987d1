"""Ulysses for linear-attention mixers whose model code calls a short causal convolution and a
chunked scan as module-level functions: gated delta-net (Qwen3-Next, Qwen3.5) and KDA (Kimi-Linear);
Mamba-1's selective scan reuses the mechanism with its own scan exchange (``mixers.mamba1``).

The model's own ``forward`` runs unchanged on the local tokens. While a sharded mixer runs, two of
the functions it calls (looked up in its modeling module at call time, with their kernel-or-torch
fallback intact) are dispatched:

- the **convolution** ``causal_conv1d_fn(x [B, C, S_l], weight [C, K], ...)``, ``C`` the
  ``[q | k | v]`` channels: the ``K-1`` positions before the shard come from the previous SP rank
  (``halo``), the model's function runs on ``[halo | local]`` and the halo's outputs are dropped —
  the full-sequence convolution at the local positions, every channel, no weight slicing;
- the **scan** (``q, k [B, S_l, Hk, Dk]``, ``v [B, S_l, Hv, Dv]``, decay ``g``, ``beta``): ONE packed
  all-to-all turns all five into head shards ``[B, S, H_l, ...]``, the model's own scan runs over
  the full sequence for the local heads, one all-to-all returns ``[B, S_l, Hv, Dv]``.

So a layer costs one all-to-all in, one out (the minimum) plus a halo of ``(K-1) * C`` values per
row. Gated delta-net's decay and beta are computed by the model before the exchange, on the local
tokens from the *full* per-head parameters (``A_log``, ``dt_bias``): autograd returns full-parameter
gradients with no slicing (KDA's per-channel decay is made after the exchange instead, from a
low-rank feature: ``_Sharded.local_decay``, ``mixers.kda``); the output gate, norm and projection
run after the return exchange, on local tokens.

Grouped heads: key heads split like value heads when ``Hk % P == 0``; when ``P % Hk == 0`` each key
head is replicated ``P/Hk`` times before the exchange, so every rank receives exactly the key head
its value heads use. Packed documents (``documents.PositionTracker``, installed by
``apply.apply_mixers``): the convolution and the scan restart at every global document start (the
model's functions run once per document span).

Shape legend: ``B`` batch, ``S`` global sequence, ``S_l = S/P``, ``C`` conv channels, ``K`` kernel,
``Hk``/``Hv`` key/value heads, ``H_l = H/P``, ``D*`` head dims, ``P`` sp size.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ulysses_sp.attention.masks import SeqLayout
from ulysses_sp.mixers._kernels import ForwardHandler, check_layout, wrap_sharded_forward
from ulysses_sp.mixers.documents import (
    PositionTracker,
    per_document,
    per_window_document,
    segments,
    window_cuts,
)
from ulysses_sp.mixers.halo import halo_from_previous
from ulysses_sp.parallel.comm import heads_to_seq, seq_to_heads_packed

SCAN_INPUTS = ("query", "key", "value", "g", "beta")


def check_heads(what: str, key_heads: int, value_heads: int, sp_size: int) -> None:
    """``ValueError`` unless value heads divide by ``sp_size`` and key heads divide by it or divide it."""
    if value_heads % sp_size or (key_heads % sp_size and sp_size % key_heads):
        raise ValueError(
            f"{what} has {key_heads} key heads and {value_heads} value heads: sequence parallelism "
            f"shards heads, so sp_size ({sp_size}) must divide the value heads and divide or be a "
            "multiple of the key heads; use an sp_size that does"
        )


class LinearAttentionHandler(ForwardHandler):
    """What the gated delta-net and KDA handlers share (``mixers.base.MixerHandler``): matching by
    structure (``attrs``, a depthwise ``conv1d``, a modeling module that defines ``conv_fn`` and
    ``scan_fn``), the heads check, and the plain wrap. Subclasses set the class attributes and
    ``heads``; KDA adds to ``matches`` and ``wrap``."""

    name = ""
    label = ""
    """The mixer's kind in messages (``gated delta-net``)."""
    attrs: tuple[str, ...] = ()
    conv_fn = "causal_conv1d_fn"
    scan_fn = ""

    def heads(self, module: nn.Module) -> tuple[int, int]:
        """``(key heads, value heads)`` of ``module``."""
        raise NotImplementedError

    def matches(self, module: nn.Module) -> bool:
        modeling = sys.modules.get(type(module).__module__)
        return (
            all(hasattr(module, a) for a in self.attrs)
            and isinstance(module.conv1d, nn.Conv1d)
            and callable(getattr(modeling, self.conv_fn, None))
            and callable(getattr(modeling, self.scan_fn, None))
        )

    def check(self, module: nn.Module, sp_size: int) -> None:
        check_heads(f"{type(module).__name__} ({self.label})", *self.heads(module), sp_size)

    def what(self, module: nn.Module) -> str:
        return f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"

    def wrap(self, module: nn.Module, mesh: Any) -> Callable[[], None]:
        """Unlike ``ForwardHandler.wrap``, works without a ``PositionTracker`` (every row one document)."""
        self.check(module, mesh.sp_size)
        return wrap_linear_attention(module, mesh, self.positions, conv_fn=self.conv_fn,
                                     scan_fns=(self.scan_fn,), what=self.what(module))  # fmt: skip


@dataclass
class _Sharded:
    """What the dispatched functions need while one sharded mixer's forward runs."""

    group: dist.ProcessGroup
    sp_size: int
    sp_rank: int
    layout: SeqLayout | None
    """The full sequence's layout; ``None``: no position ids (every row one document)."""
    local_decay: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Set when the scan's ``g`` arrives as a low-rank feature ``[B, S_l, r]`` that every rank needs
    whole (KDA): it rides the same all-to-all replicated ``P`` times, and ``local_decay([B, S, r])``
    makes this rank's ``g [B, S, H_l, D]`` with the model's own gate on its heads' parameters."""

    def conv(self, original: Callable[..., Any], signature: inspect.Signature, args: tuple, kwargs: dict):
        bound = signature.bind(*args, **kwargs)
        x = bound.arguments["hidden_states"]  # [B, C, S_l]
        width = bound.arguments["weight"].shape[-1] - 1
        if width == 0:
            return original(*args, **kwargs)
        halo = halo_from_previous(x, width, self.group)  # [B, C, K-1] of the previous rank
        ext = torch.cat([halo, x], dim=-1)  # [B, C, K-1+S_l]: positions r*S_l-K+1 .. (r+1)*S_l-1

        def run(part: torch.Tensor) -> torch.Tensor:
            bound.arguments["hidden_states"] = part
            return original(*bound.args, **bound.kwargs)

        out = per_window_document(run, (ext,), self._window_docs(x.shape[-1], width), dim=-1)
        return out[..., width:]  # [B, C, S_l]: the halo's own outputs dropped

    def scan(self, original: Callable[..., Any], signature: inspect.Signature, args: tuple, kwargs: dict):
        bound = signature.bind(*args, **kwargs)
        if bound.arguments.get("initial_state") is not None:
            raise ValueError("a recurrent initial state (generation with a cache) is not sequence-parallel")
        q, k, v, g, beta = (bound.arguments[n] for n in SCAN_INPUTS)
        hk = k.shape[2]
        if hk % self.sp_size:  # Hk < P: [B, S_l, Hk, Dk] -> [B, S_l, P, Dk], rank j gets key head j*Hk//P
            q, k = (t.repeat_interleave(self.sp_size // hk, dim=2) for t in (q, k))
        if self.local_decay is not None:  # [B, S_l, r] -> [B, S_l, P, r]: every rank gets all of it
            g = g.unsqueeze(2).expand(-1, -1, self.sp_size, -1)
        # one all-to-all: [B, S_l, H*, ...] -> [B, S, H*_l, ...] for q, k, v, g, beta
        full = seq_to_heads_packed((q, k, v, g, beta), self.group)
        if self.local_decay is not None:  # [B, S, 1, r] -> this rank's decay [B, S, H_l, D]
            full = (*full[:3], self.local_decay(full[3].squeeze(2)), full[4])

        def run(*parts: torch.Tensor) -> torch.Tensor:
            bound.arguments.update(zip(SCAN_INPUTS, parts))
            out, state = original(*bound.args, **bound.kwargs)
            return out  # state is None: no output_final_state without a cache

        spans = segments(self.layout, q.shape[0], full[0].shape[1])
        out = per_document(run, full, spans, seq_dim=1)  # [B, S, Hv_l, Dv], per packed document
        return heads_to_seq(out, self.group, head_dim=2, seq_dim=1), None  # -> [B, S_l, Hv, Dv]

    def _window_docs(self, s_local: int, width: int) -> list[list[int]] | None:
        """Per row of ``[halo | local]`` (``K-1+S_l`` tokens from global ``lo - width``; a halo before the
        sequence is its own document): where a new document starts, as host ints; ``None`` unpacked."""
        lo = self.sp_rank * s_local
        return window_cuts(self.layout, lo - width, lo + s_local)


_ACTIVE: ContextVar[_Sharded | None] = ContextVar("ulysses_sp_linear_attn", default=None)


def in_sharded_forward() -> bool:
    """True while a sharded linear-attention mixer's forward runs (in this context)."""
    return _ACTIVE.get() is not None


class _Dispatch:
    """Stands in for one module-level function of a modeling module while sharded mixers exist:
    the original outside a sharded mixer's forward, the SP version inside. Counts its users."""

    def __init__(self, original: Callable[..., Any], kind: str) -> None:
        self.original, self.kind, self.users = original, kind, 0
        self.signature = inspect.signature(original)
        functools.update_wrapper(self, original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        active = _ACTIVE.get()
        if active is None:
            return self.original(*args, **kwargs)
        return getattr(active, self.kind)(self.original, self.signature, args, kwargs)


def _install(modeling: Any, name: str, kind: str) -> Callable[[], None]:
    """Put a ``_Dispatch`` in place of ``modeling.<name>`` (shared by every wrapped mixer of that
    modeling module); the undo restores the original when its last user is gone."""
    current = getattr(modeling, name)
    dispatch = current if isinstance(current, _Dispatch) else _Dispatch(current, kind)
    setattr(modeling, name, dispatch)
    dispatch.users += 1

    def undo() -> None:
        dispatch.users -= 1
        if dispatch.users == 0 and getattr(modeling, name) is dispatch:
            setattr(modeling, name, dispatch.original)

    return undo


def wrap_linear_attention(module: nn.Module, mesh: Any, positions: PositionTracker | None, *, conv_fn: str,
                          scan_fns: Sequence[str], what: str,
                          local_decay: Callable[[torch.Tensor], torch.Tensor] | None = None,
                          state: type[_Sharded] = _Sharded, fused_fns: Sequence[str] = ()) -> Callable[[], None]:  # fmt: skip
    """Shard ``module`` (a mixer whose forward calls ``conv_fn`` and one of ``scan_fns`` from its
    modeling module) over ``mesh``'s SP group; returns the undo. ``positions`` gives the forward's
    global document boundaries (``None``: every row one document). ``what`` names it in errors.
    ``local_decay``: see ``_Sharded.local_decay`` (the caller makes the model pass the feature).
    ``state``: a ``_Sharded`` subclass whose ``scan`` takes another scan's arguments (Mamba-1's
    selective scan, ``mixers.mamba1``); ``fused_fns``: functions dispatched to ``state.fused``."""
    check_layout(mesh, what)
    modeling = sys.modules[type(module).__module__]

    def sharded(original: Callable[..., Any], hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                **kwargs: Any) -> Any:  # fmt: skip
        # at sp 1 too: packed documents stay apart as they do at sp > 1, so sp 1 and sp P train alike
        b, s_local, _ = hidden_states.shape  # [B, S_l, hidden]
        layout = None if positions is None else positions.layout(s_local, b)  # a collective, once per forward
        token = _ACTIVE.set(state(mesh.sp_group, mesh.sp_size, mesh.sp_rank, layout, local_decay))
        try:
            return original(hidden_states, cache=None, attention_mask=attention_mask, **kwargs)
        finally:
            _ACTIVE.reset(token)

    # first: refuses a module sharded twice, before any patch
    undos = [wrap_sharded_forward(module, mesh, what, sharded)]
    undos += [_install(modeling, conv_fn, "conv"), *(_install(modeling, n, "scan") for n in scan_fns),
              *(_install(modeling, n, "fused") for n in fused_fns)]

    def undo() -> None:
        for u in reversed(undos):
            u()

    return undo
