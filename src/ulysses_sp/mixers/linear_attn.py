"""Ulysses for linear-attention mixers whose model code calls a short causal convolution and a
chunked scan as module-level functions: gated delta-net (Qwen3-Next, Qwen3.5) and KDA (Kimi-Linear).

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
row. Decay and beta are computed by the model before the exchange, on the local tokens from the
*full* per-head parameters (``A_log``, ``dt_bias``): autograd returns full-parameter gradients with
no slicing; the output gate, norm and projection run after the return exchange, on local tokens.

Grouped heads: key heads split like value heads when ``Hk % P == 0``; when ``P % Hk == 0`` each key
head is replicated ``P/Hk`` times before the exchange, so every rank receives exactly the key head
its value heads use. Packed documents (``documents.track_documents``): the convolution and the scan
restart at every global document start (the model's functions run per document segment).

Shape legend: ``B`` batch, ``S`` global sequence, ``S_l = S/P``, ``C`` conv channels, ``K`` kernel,
``Hk``/``Hv`` key/value heads, ``H_l = H/P``, ``D*`` head dims, ``P`` sp size.
"""

from __future__ import annotations

import functools
import inspect
import sys
import weakref
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ulysses_sp.attention.masks import SeqLayout
from ulysses_sp.mixers.documents import TRACK_HINT, current_layout
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


@dataclass
class _Sharded:
    """What the dispatched functions need while one sharded mixer's forward runs."""

    group: dist.ProcessGroup
    sp_size: int
    sp_rank: int
    layout: SeqLayout | None
    """The full sequence's layout; ``None``: untracked (refused only if a function needs it)."""

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

        out = _per_document(run, (ext,), self._window_docs(x.shape[-1], width), dim=2)
        return out[..., width:]  # [B, C, S_l]: the halo's own outputs dropped

    def scan(self, original: Callable[..., Any], signature: inspect.Signature, args: tuple, kwargs: dict):
        bound = signature.bind(*args, **kwargs)
        if bound.arguments.get("initial_state") is not None:
            raise ValueError("a recurrent initial state (generation with a cache) is not sequence-parallel")
        q, k, v, g, beta = (bound.arguments[n] for n in SCAN_INPUTS)
        hk = k.shape[2]
        if hk % self.sp_size:  # Hk < P: [B, S_l, Hk, Dk] -> [B, S_l, P, Dk], rank j gets key head j*Hk//P
            q, k = (t.repeat_interleave(self.sp_size // hk, dim=2) for t in (q, k))
        # one all-to-all: [B, S_l, H*, ...] -> [B, S, H*_l, ...] for q, k, v, g, beta
        full = seq_to_heads_packed(q, k, v, g, beta, group=self.group)

        def run(*parts: torch.Tensor) -> torch.Tensor:
            bound.arguments.update(zip(SCAN_INPUTS, parts))
            out, state = original(*bound.args, **bound.kwargs)
            return out  # state is None: no output_final_state without a cache

        docs = None if self.layout is None else self.layout.doc_ids
        out = _per_document(run, full, docs, dim=1)  # [B, S, Hv_l, Dv]
        return heads_to_seq(out, self.group, head_dim=2, seq_dim=1), None  # -> [B, S_l, Hv, Dv]

    def _window_docs(self, s_local: int, width: int) -> torch.Tensor | None:
        """``[B|1, K-1+S_l]`` document ids of ``[halo | local]`` (-1 before the sequence), or None."""
        if self.layout is None or self.layout.doc_ids is None:
            return None
        docs, lo = self.layout.doc_ids, self.sp_rank * s_local
        before = docs.new_full((docs.shape[0], max(0, width - lo)), -1)
        return torch.cat([before, docs[:, max(0, lo - width) : lo + s_local]], dim=-1)


def _segments(doc: torch.Tensor) -> list[tuple[int, int]]:
    """``[L]`` document ids -> ``[(start, length)]`` of their maximal runs."""
    cuts = (torch.nonzero(doc[1:] != doc[:-1]).flatten() + 1).tolist()
    edges = [0, *cuts, doc.shape[0]]
    return [(a, b - a) for a, b in zip(edges[:-1], edges[1:])]


def _per_document(fn: Callable[..., torch.Tensor], xs: Sequence[torch.Tensor], docs: torch.Tensor | None,
                  dim: int) -> torch.Tensor:  # fmt: skip
    """``fn`` over every document segment of ``xs`` along ``dim`` (``docs [B|1, L]``), concatenated;
    one call when unpacked. Rows with different boundaries run one by one."""
    if docs is None or bool((docs == docs[:, :1]).all()):
        return fn(*xs)
    if docs.shape[0] == 1:
        return torch.cat([fn(*(x.narrow(dim, a, n) for x in xs)) for a, n in _segments(docs[0])], dim=dim)
    rows = [_per_document(fn, [x[b : b + 1] for x in xs], docs[b : b + 1], dim) for b in range(docs.shape[0])]
    return torch.cat(rows, dim=0)


_ACTIVE: ContextVar[_Sharded | None] = ContextVar("ulysses_sp_linear_attn", default=None)


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


def wrap_linear_attention(module: nn.Module, mesh: Any, *, conv_fn: str, scan_fns: Sequence[str],
                          what: str) -> Callable[[], None]:  # fmt: skip
    """Shard ``module`` (a mixer whose forward calls ``conv_fn`` and one of ``scan_fns`` from its
    modeling module) over ``mesh``'s SP group; returns the undo. ``what`` names it in errors."""
    modeling = sys.modules[type(module).__module__]
    undos = [_install(modeling, conv_fn, "conv"), *(_install(modeling, n, "scan") for n in scan_fns)]
    original = module.forward
    signature = inspect.signature(original)
    last: list[weakref.ref] = []  # this mixer's most recent layout (for a checkpoint recompute)

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if mesh.sp_size == 1:
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs).arguments
        if bound.get("cache") is not None or bound.get("cache_params") is not None:
            raise ValueError(
                f"{what}: a cache (generation) is not sequence-parallel; call the model with use_cache=False"
            )
        extra = bound.get("kwargs", {})
        if extra.get("cu_seq_lens_q") is not None or extra.get("seq_idx") is not None:
            raise ValueError(f"{what}: cu_seq_lens_q/seq_idx under sequence parallelism are ambiguous (local or "
                             "global?); pass packed documents as position_ids that restart at 0 instead")  # fmt: skip
        hidden = bound["hidden_states"]  # [B, S_l, hidden]
        layout = current_layout(hidden.shape[0], what)
        if layout is None and last and last[0]() is not None:
            layout = last[0]()  # a recompute during backward: the layout of the forward it repeats
        if layout is None:
            raise ValueError(
                f"{what} under sequence parallelism needs the forward's position ids: {TRACK_HINT}"
            )
        last[:] = [weakref.ref(layout)]
        token = _ACTIVE.set(_Sharded(mesh.sp_group, mesh.sp_size, mesh.sp_rank, layout))
        try:
            return original(*args, **kwargs)
        finally:
            _ACTIVE.reset(token)

    module.forward = forward

    def undo() -> None:
        if module.__dict__.get("forward") is forward:
            del module.forward
        for u in reversed(undos):
            u()

    return undo
