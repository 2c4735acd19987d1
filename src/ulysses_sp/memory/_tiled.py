"""The tiled-compute mechanism (private: the public API is ``ulysses_sp.memory.tiling``).

One autograd Function, ``TiledCompute``: forward runs a token-local ``fn`` over ``n`` tiles of the
sequence under ``no_grad`` and keeps only the inputs; backward recomputes each tile with grad and
back-propagates it, so one tile's intermediates exist at a time. Around it: the tile-count rule
(``auto_num_shards``) and its validation (``check_num_shards``), and the token-locality check of
an MLP block (``check_token_local``), the precondition for tiling it exactly.

Parameters are *inputs* of the Function: their gradients are summed over the tiles inside it and
handed to autograd once, so a parameter's gradient hook fires once per backward (DDP, FSDP2's
reduce-scatter, ZeRO-1 see an untiled module). No communication, no model library.

Shape legend: ``B`` batch, ``S_l`` local sequence, ``h`` hidden, ``n`` number of tiles,
``T = ceil(S_l / n)`` tile length.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn
from torch.autograd.function import once_differentiable


def auto_num_shards(seq_len: int, hidden_size: int, batch_size: int = 1) -> int:
    """Default tile count: tiles of about ``hidden_size`` tokens, ``ceil(B * S_l / h)``.

    ALST's TiledMLP rule: a tile's ``[T, I]`` MLP activations (``[T, V]`` logits) are then no
    larger than the block's own ``[h, I]`` (``[V, h]``) weight, which is in memory anyway.
    Clamped to ``[1, S_l]``.
    """
    return max(1, min(seq_len, math.ceil(batch_size * seq_len / max(hidden_size, 1))))


def check_num_shards(num_shards: Any, seq_len: int | None = None, *, what: str = "num_shards") -> int:
    """Validate a tile count (and, given ``seq_len``, that every tile holds at least one token)."""
    if isinstance(num_shards, bool) or not isinstance(num_shards, int):
        raise ValueError(f"{what} must be a positive int, got {num_shards!r}")
    if num_shards < 1:
        raise ValueError(f"{what} must be >= 1, got {num_shards}")
    if seq_len is not None and num_shards > seq_len:
        raise ValueError(
            f"{what} ({num_shards}) is larger than the local sequence length ({seq_len}): "
            f"every tile needs at least one token; use at most {seq_len} (or None for auto)"
        )
    return num_shards


def has_dropout(module: nn.Module) -> bool:
    """Whether ``module`` draws random numbers (so a recompute must replay the RNG)."""
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in module.modules())


def _tiles(length: int, n: int) -> list[tuple[int, int]]:
    """``(start, size)`` of ``n`` tiles covering ``length`` (sizes differ by at most one)."""
    base, extra = divmod(length, n)
    out, start = [], 0
    for i in range(n):
        size = base + (i < extra)
        out.append((start, size))
        start += size
    return out


@contextlib.contextmanager
def _rng_restored(state: tuple[torch.Tensor, torch.Tensor | None] | None, device: torch.device) -> Iterator:
    """Replay the RNG from ``state`` (dropout masks of the forward) without disturbing the caller's."""
    if state is None:
        yield
        return
    accel = device.type != "cpu"
    with torch.random.fork_rng(devices=[device] if accel else [], device_type=device.type):
        torch.set_rng_state(state[0])
        if accel:
            torch.get_device_module(device.type).set_rng_state(state[1], device)
        yield


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    dev = torch.get_device_module(device.type).get_rng_state(device) if device.type != "cpu" else None
    return torch.get_rng_state(), dev


def _unlisted_leaves(y: torch.Tensor, listed: set[int]) -> list[torch.Tensor]:
    """Leaf tensors requiring grad that ``y``'s graph reaches but that are not in ``listed``."""
    found, seen, stack = [], set(), [y.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if var is not None and id(var) not in listed:
            found.append(var)
        stack.extend(f for f, _ in node.next_functions)
    return found


def _check_not_freed(params: Sequence[torch.Tensor]) -> None:
    freed = [tuple(p.shape) for p in params if p.numel() and p.untyped_storage().nbytes() == 0]
    if freed:
        raise ValueError(
            f"parameters {freed} of a tiled function were freed between forward and backward (FSDP2 "
            "resharded them): run the tiled module inside an FSDP unit whose parameters are gathered "
            "again for backward (its own unit's pre-backward hook, or the root with the default "
            "reshard_after_forward), not in a unit that never sees the gradient"
        )


NORM_OF = "_ulysses_sp_norm_of"
"""Attribute a recomputed norm's output carries: ``(norm forward, its input, its parameters)``."""


def absorb_norm(
    x: torch.Tensor, forward: Callable, params: list[torch.Tensor]
) -> tuple[Callable, torch.Tensor, list[torch.Tensor]]:
    """``(fn, input, params)`` to tile for ``forward(x)``: when ``x = norm(x0)`` is a recomputed
    norm's output (``NORM_OF``), ``forward(norm(t))`` over ``x0`` with the norm's parameters added, so
    that ``x`` is kept by no one for backward; else ``forward`` over ``x`` unchanged."""
    norm = getattr(x, NORM_OF, None)
    if norm is None or norm[1].shape != x.shape:
        return forward, x, params
    norm_forward, x0, norm_params = norm
    return (lambda t: forward(norm_forward(t))), x0, [*norm_params, *params]


@dataclass(frozen=True)
class TileSpec:
    """How ``TiledCompute`` cuts and combines (validated by ``tiling.sequence_tiled_compute``)."""

    seq_dim: int
    """The dim of ``x`` and of the aux tensors that is tiled."""
    num_shards: int
    """Number of tiles, ``1 <= num_shards <= x.shape[seq_dim]``."""
    n_aux: int
    """How many of the Function's trailing inputs are aux tensors (the rest are params)."""
    reduce_sum: bool
    """Sum the tile outputs (a scalar per tile) instead of concatenating them along ``seq_dim``."""
    preserve_rng: bool
    """Replay the forward's RNG in the backward recompute (dropout)."""


def _autocast_state(device_type: str) -> dict[str, Any]:
    """The forward's autocast state for ``device_type``, as ``torch.autocast`` kwargs: the backward's recompute
    re-enters it (backward runs outside the forward's autocast context — on CUDA in autograd's own thread — so
    without this a bf16-autocast forward would be recomputed, and differentiated, in fp32)."""
    return {"device_type": device_type, "dtype": torch.get_autocast_dtype(device_type),
            "enabled": torch.is_autocast_enabled(device_type), "cache_enabled": torch.is_autocast_cache_enabled()}  # fmt: skip


class TiledCompute(torch.autograd.Function):
    """``TiledCompute.apply(fn, spec, x, *aux, *params)``.

    Forward: ``fn`` on each tile under ``no_grad``, outputs concatenated (or summed); saves only
    ``x`` and the aux tensors. Backward: each tile recomputed with grad and back-propagated; the
    tile gradients of ``x`` are concatenated and the parameter gradients summed.
    """

    @staticmethod
    def forward(ctx: Any, fn: Callable, spec: TileSpec, x: torch.Tensor, *rest: torch.Tensor):
        ctx.fn, ctx.spec, ctx.params = fn, spec, rest[spec.n_aux :]
        ctx.rng = _rng_state(x.device) if spec.preserve_rng else None
        ctx.autocast = _autocast_state(x.device.type)
        aux = rest[: spec.n_aux]
        # Saved first: under activation checkpointing the layer's recompute stops at its last saved
        # tensor (torch's early stop), so the tiles below are not recomputed in backward (their
        # output is not needed there) and no [B, S_l, ...] output is made for nothing.
        ctx.save_for_backward(x, *aux)
        d, out = spec.seq_dim, None
        with torch.no_grad():
            for start, size in _tiles(x.shape[d], spec.num_shards):
                y = fn(x.narrow(d, start, size), *(a.narrow(d, start, size) for a in aux))
                if spec.reduce_sum:
                    out = y if out is None else out.add_(y)
                    continue
                if out is None:  # [B, T, ...] -> preallocate [B, S_l, ...]: no list of tiles, no cat
                    out = y.new_empty(y.shape[:d] + x.shape[d : d + 1] + y.shape[d + 1 :])
                out.narrow(d, start, size).copy_(y)
                del y  # the tile's activations die here, before the next tile
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor):
        x, *aux = ctx.saved_tensors
        spec, params = ctx.spec, ctx.params
        _check_not_freed(params)
        want_x = ctx.needs_input_grad[2]
        want = [i for i, p in enumerate(params) if ctx.needs_input_grad[3 + spec.n_aux + i]]
        grad_x = torch.zeros_like(x) if want_x else None
        grad_p: list[torch.Tensor | None] = [None] * len(params)
        d, checked = spec.seq_dim, False
        with _rng_restored(ctx.rng, x.device), torch.enable_grad(), torch.autocast(**ctx.autocast):
            for start, size in _tiles(x.shape[d], spec.num_shards):
                xt = x.narrow(d, start, size).detach().requires_grad_(want_x)
                yt = ctx.fn(xt, *(a.narrow(d, start, size) for a in aux))
                if yt.grad_fn is None:  # the tile does not depend on anything (e.g. no valid label)
                    continue
                inputs = ([xt] if want_x else []) + [params[i] for i in want]
                if not checked and (extra := _unlisted_leaves(yt, {id(t) for t in inputs})):
                    shapes = [tuple(t.shape) for t in extra]
                    raise ValueError(
                        f"the tiled function uses {len(extra)} tensor(s) that require grad but were "
                        f"not passed in params (shapes {shapes}); their gradients would be lost"
                    )
                checked = True
                g = grad_out if spec.reduce_sum else grad_out.narrow(d, start, size)
                grads = torch.autograd.grad(yt, inputs, g, allow_unused=True)
                if want_x:
                    grad_x.narrow(d, start, size).copy_(grads[0])
                    grads = grads[1:]
                for i, gi in zip(want, grads):
                    if gi is not None:
                        grad_p[i] = gi if grad_p[i] is None else grad_p[i].add_(gi)
                del yt, grads
        for i in want:  # e.g. every tile skipped: a zero gradient, as the untiled graph would give
            if grad_p[i] is None:
                grad_p[i] = torch.zeros_like(params[i])
        return (None, None, grad_x, *([None] * spec.n_aux), *grad_p)


# ---------------------------------------------------------------- token locality (what may be tiled)
_TOKEN_LOCAL = (nn.Linear, nn.Identity, nn.LayerNorm, nn.RMSNorm, nn.modules.dropout._DropoutNd)
_CONTAINERS = (nn.ModuleDict, nn.ModuleList, nn.ParameterDict, nn.ParameterList)


def _is_token_local_leaf(m: nn.Module) -> bool:
    """Module types that act on each position independently (over the last dim only)."""
    cls = type(m)
    if isinstance(m, _TOKEN_LOCAL) or cls.__name__.endswith("RMSNorm"):
        return True
    if isinstance(m, _CONTAINERS):  # compute nothing themselves (PEFT's LoRA layers hold empty ones)
        return True
    if cls.__module__ == "transformers.activations":
        return True
    return cls.__module__ == nn.modules.activation.__name__ and not isinstance(
        m, (nn.MultiheadAttention, nn.Softmax, nn.Softmin, nn.LogSoftmax, nn.Softmax2d)
    )


def _probe_token_local(name: str, mlp: nn.Module, hidden: int) -> None:
    """Check numerically that position ``t`` of the output depends on position ``t`` only."""
    p = next(mlp.parameters(), None)
    if p is None or p.device.type == "meta" or type(p) not in (torch.Tensor, nn.Parameter):
        return  # meta or sharded (DTensor) parameters: the structural check has to do
    modes = {m: m.training for m in mlp.modules()}
    mlp.eval()  # dropout off for the probe
    try:
        with torch.no_grad():
            gen = torch.Generator(device=p.device).manual_seed(0)  # never the caller's RNG stream
            x = torch.randn(1, 6, hidden, device=p.device, dtype=p.dtype, generator=gen)  # [1, 6, h]
            whole = mlp.forward(x)
            parts = torch.cat([mlp.forward(x[:, :2]), mlp.forward(x[:, 2:])], dim=1)
    finally:
        for m, mode in modes.items():
            m.training = mode
    tol = 1e-4 if p.dtype in (torch.float32, torch.float64) else 5e-2
    if whole.shape != parts.shape or not torch.allclose(whole, parts, rtol=tol, atol=tol):
        raise ValueError(
            f"cannot tile {name} ({type(mlp).__name__}): it is not token-local (its output for a "
            "token changes with the other tokens of the sequence), so computing it on tiles would "
            "change the model"
        )


def check_token_local(name: str, mlp: nn.Module, hidden: int | None) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``mlp`` acts on every position independently.

    Structurally (every leaf module of a type known to be token-local: Linear, activations, norms,
    dropout) and, given ``hidden`` and plain local parameters, numerically (the block on two
    slices of a ``[1, 6, hidden]`` input equals the block on the whole).
    """
    for sub_name, sub in mlp.named_modules():
        if next(sub.children(), None) is None and not _is_token_local_leaf(sub):
            full = f"{name}.{sub_name}" if sub_name else name
            raise ValueError(
                f"cannot tile {name} ({type(mlp).__name__}): its submodule {full} "
                f"({type(sub).__name__}) is not known to be token-local. Tiled MLP recomputes the "
                "block on slices of the sequence, which is exact only when each token's output "
                "depends on that token alone (Linear, activations, norms, dropout)"
            )
    if hidden is not None:
        _probe_token_local(name, mlp, hidden)


_H = TypeVar("_H", bound="ForwardPatchHandle")


class ForwardPatchHandle:
    """Undo handle of a per-module ``forward`` patch (tiled MLP, norm recompute): ``remove()`` (or leaving a
    ``with`` block) restores every patched module's original ``forward`` object."""

    def __init__(self, patched: list[tuple[str, nn.Module, Any]], num_shards: int | None) -> None:
        self._patched = patched
        self.num_shards = num_shards
        """Tiles per patched call; ``None`` = ``auto_num_shards`` per call."""

    @property
    def module_names(self) -> list[str]:
        """Qualified names of the patched modules."""
        return [n for n, _, _ in self._patched]

    def remove(self) -> None:
        for _, module, previous in self._patched:
            if previous is None:
                del module.forward  # back to the class's forward
            else:
                module.forward = previous
        self._patched = []

    def __repr__(self) -> str:
        shards = "auto" if self.num_shards is None else self.num_shards
        return f"{type(self).__name__}(modules={len(self._patched)}, num_shards={shards})"

    def __enter__(self: _H) -> _H:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
