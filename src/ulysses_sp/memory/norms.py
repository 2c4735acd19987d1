"""Norm recompute: each RMSNorm of the decoder keeps only its input and output.

An RMSNorm in transformers (``LlamaRMSNorm`` and its copies) computes in fp32 and autograd keeps
what its ops save: in fp32 the normalised input ``[B, S_l, h]`` next to the output; in 16-bit
the fp32 copy of the input and the 16-bit cast of the normalised input as well (``3 x`` the
output's bytes on top of it). Per decoder layer there are two such norms (input and
post-attention), plus ``q_norm``/``k_norm`` on ``[B, S_l, H, D]`` where the model has them, and the
final norm after the last layer (whose backward, untiled, holds fp32 temporaries of the whole shard
at the start of the backward).
``apply_norm_recompute(model)`` makes each of them run its own, unchanged ``forward`` through
``memory.tiling.sequence_tiled_compute`` (the tiled MLP's autograd function; no RNG replay: a norm
draws no random numbers): forward runs without autograd and keeps only the norm's input (a tensor
the layer holds anyway: the layer input or the residual sum) next to the output its consumer saves;
backward re-runs the norm's forward and its backward one tile of the sequence at a time (tiles of
about ``h`` tokens, the tiled MLP's rule), so that its fp32 internals and gradient temporaries exist
for one tile only, next to the ``[B, S_l, h]`` input gradient. A norm normalises over its last dim,
so any split of the other dims is exact: the same ops per token, the gradients equal to rounding
(the weight's is the sum of the tiles', the input's is accumulated with the residual's in another
order). Where it sits in the step: inside each decoder layer (step 3 of DESIGN.md's data flow), the
recompute in step 6.

Shape legend: ``B`` batch, ``S_l`` local sequence, ``h`` hidden, ``H`` heads, ``D`` head dim, ``T``
tokens of a flattened ``[T, h]`` input; a tile is a ``narrow`` of the token dim (no reshape).

Which modules: every submodule of the model whose class name ends in ``RMSNorm``, or that has a
``variance_epsilon`` attribute and a 1-D ``weight`` parameter (``nn.LayerNorm`` is left alone: it
saves only its input and two statistics). A matched norm called with more than its input (a gated
norm, ``RMSNormGated(x, gate)``, inside a sequence mixer) runs unchanged.

Composes with activation checkpointing (inside the layer's recompute the norm again keeps only
input and output, and its internals exist one tile at a time in the layer's backward), FSDP2 and
DDP (the weight is read at recompute time, while the layer's unit is still unsharded for its
backward), tiled MLP (a different submodule), autocast (a norm's ops are on none of autocast's
lists: the backward's recompute, which runs outside autocast, computes the same) and activation
offload (the norm saves only its input, the tensor the checkpoint offloads). Costs one more norm
forward per norm in backward.

A tiled MLP (``memory.tiling``) or a linear layer (the q/k/v projections: every ``nn.Linear`` but
the output embeddings) fed by a recomputed norm's output absorbs the norm: it tiles ``mlp(norm(x))``
/ ``proj(norm(x))`` over the norm's input ``x`` (held anyway), so the norm's ``[B, S_l, h]`` output
is kept by no one for backward (8 GiB per layer at 1M tokens and h 4096 in bf16); the output carries
``(forward, x, params)`` under ``_tiled.NORM_OF`` for that (``_tiled.absorb_norm``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ulysses_sp.memory._tiled import (
    NORM_OF,
    ForwardPatchHandle,
    absorb_norm,
    auto_num_shards,
    check_num_shards,
)
from ulysses_sp.memory.tiling import sequence_tiled_compute

__all__ = ["NormRecomputeHandle", "apply_norm_recompute", "is_rms_norm"]


def is_rms_norm(module: nn.Module) -> bool:
    """Whether ``module`` is RMSNorm-like: its class name ends in ``RMSNorm``, or it has a
    ``variance_epsilon`` attribute and a 1-D ``weight`` parameter."""
    if type(module).__name__.endswith("RMSNorm"):
        return True
    weight = getattr(module, "weight", None)
    return hasattr(module, "variance_epsilon") and isinstance(weight, nn.Parameter) and weight.dim() == 1


class NormRecomputeHandle(ForwardPatchHandle):
    """Undo handle of ``apply_norm_recompute`` (``num_shards``: tiles per norm call in backward);
    ``absorbing``: the linear layers that absorb a recomputed norm before them."""

    def __init__(self, patched: list[tuple[str, nn.Module, Any]], num_shards: int | None,
                 absorbing: list[tuple[str, nn.Module, Any]] = ()) -> None:  # fmt: skip
        super().__init__(patched, num_shards)
        self.absorbing = ForwardPatchHandle(list(absorbing), num_shards)

    def remove(self) -> None:
        super().remove()
        self.absorbing.remove()


def apply_norm_recompute(model: nn.Module, num_shards: int | None = None) -> NormRecomputeHandle:
    """Make every RMSNorm-like module of ``model`` recompute in backward.

    Each matched norm's ``forward`` is replaced, on the instance, by one that calls the original
    through ``sequence_tiled_compute`` over ``num_shards`` tiles of the sequence (dim 1 of a
    ``[B, S_l, ...]`` input, dim 0 of ``[T, h]``) when gradients are on (unchanged without them:
    evaluation keeps nothing anyway).

    Args:
        model: an HF model (or any module); every RMSNorm-like submodule (``is_rms_norm``).
        num_shards: tiles of the norm's backward recompute; ``None`` = ``auto_num_shards`` at each
            call (tiles of about as many tokens as a token has elements); ``1``: the whole norm at
            once (its full internals for one norm at a time).

    Returns:
        A handle; ``handle.remove()`` restores the original ``forward`` objects.

    Raises:
        ValueError: ``num_shards < 1``; no RMSNorm-like module (names the model's class); applying twice (names the module); at a call, fewer tokens than
            ``num_shards``.

    Apply before or after ``fully_shard``/DDP, before or after ``apply_tiled_mlp`` and activation
    checkpointing: it patches only the norms' ``forward``.
    """
    if num_shards is not None:
        check_num_shards(num_shards, what="norm recompute num_shards")
    norms: dict[int, tuple[str, nn.Module]] = {}
    for name, m in model.named_modules():
        if is_rms_norm(m):
            norms.setdefault(id(m), (name or type(m).__name__, m))
    if not norms:
        raise ValueError(
            f"{type(model).__name__} has no RMSNorm-like module (a class named "
            "*RMSNorm, or one with variance_epsilon and a 1-D weight): norm recompute has nothing to do; "
            "leave it off for this model"
        )
    for name, norm in norms.values():
        if getattr(norm.forward, "_ulysses_sp_norm_recompute", False):
            raise ValueError(f"{name} already recomputes: remove the previous handle before applying again")
    patched = []
    for name, norm in norms.values():
        previous = norm.__dict__.get("forward")
        norm.forward = _recompute_forward(name, norm, norm.forward, num_shards)
        patched.append((name, norm, previous))
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    absorbing = []
    for name, m in model.named_modules():  # a projection fed by a norm tiles proj(norm(x)) over x
        if isinstance(m, nn.Linear) and m is not out and not getattr(m.forward, "_ulysses_sp_absorbs", False):
            absorbing.append((name, m, m.__dict__.get("forward")))
            m.forward = _absorbing_forward(name, m, m.forward, num_shards)
    return NormRecomputeHandle(patched, num_shards, absorbing)


def _absorbing_forward(name: str, linear: nn.Module, forward: Callable, num_shards: int | None) -> Callable:
    """``linear``'s forward; on a recomputed norm's output ``y = norm(x)`` it runs ``linear(norm(x))``
    tiled over ``x`` instead (``sequence_tiled_compute``): ``y`` is then kept by no one for backward
    (the q/k/v projections of a layer held it: ``[B, S_l, h]``, 8 GiB at 1M tokens and h 4096 in
    bf16). Exact: the same ops per token; the projection is recomputed per tile in backward."""

    def absorbing_forward(x: torch.Tensor) -> torch.Tensor:
        fn, x0, params = absorb_norm(x, forward, list(linear.parameters()))
        if x0 is x or not torch.is_grad_enabled():
            return forward(x)
        seq_dim = 1 if x0.dim() >= 3 else 0
        b = x0.shape[0] if seq_dim == 1 else 1
        n = auto_num_shards(x0.shape[seq_dim], x0.shape[-1], b) if num_shards is None else num_shards
        check_num_shards(n, x0.shape[seq_dim], what=f"{name}: norm recompute num_shards")
        return sequence_tiled_compute(fn, x0, n, params=params, seq_dim=seq_dim, preserve_rng_state=False)

    absorbing_forward.__wrapped__ = forward  # type: ignore[attr-defined]
    absorbing_forward._ulysses_sp_absorbs = True  # type: ignore[attr-defined]
    return absorbing_forward


def _recompute_forward(name: str, norm: nn.Module, forward: Callable, num_shards: int | None) -> Callable:
    def recompute_forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs or not torch.is_grad_enabled():  # a gated norm; evaluation keeps nothing anyway
            return forward(x, *args, **kwargs)
        seq_dim = 1 if x.dim() >= 3 else 0  # [B, S_l, h] / [B, S_l, H, D] / [T, h]: the tokens
        b = x.shape[0] if seq_dim == 1 else 1
        n = auto_num_shards(x.shape[seq_dim], x[(0,) * (seq_dim + 1)].numel(), b) if num_shards is None else num_shards
        check_num_shards(n, x.shape[seq_dim], what=f"{name}: norm recompute num_shards")
        params = list(norm.parameters())
        y = sequence_tiled_compute(forward, x, n, params=params, seq_dim=seq_dim, preserve_rng_state=False)
        setattr(y, NORM_OF, (forward, x, params))  # a tiled MLP fed by y takes x instead (memory.tiling)
        return y

    recompute_forward.__wrapped__ = forward  # type: ignore[attr-defined]
    recompute_forward._ulysses_sp_norm_recompute = True  # type: ignore[attr-defined]
    return recompute_forward
