"""Norm recompute: each RMSNorm inside the decoder layers keeps only its input and output.

An RMSNorm in transformers (``LlamaRMSNorm`` and its copies) computes in fp32 and autograd keeps
what its ops save: in fp32 the normalised input ``[B, S_l, h]`` next to the output; in 16-bit
the fp32 copy of the input and the 16-bit cast of the normalised input as well (``3 x`` the
output's bytes on top of it). Per decoder layer there are two such norms (input and
post-attention), plus ``q_norm``/``k_norm`` on ``[B, S_l, H, D]`` where the model has them.
``apply_norm_recompute(model)`` makes each of them run its own, unchanged ``forward`` under a
non-reentrant ``torch.utils.checkpoint`` (``preserve_rng_state=False``: a norm draws no random
numbers): forward keeps only the norm's input (a tensor the layer holds anyway: the layer input or
the residual sum) and the output its consumer saves; backward re-runs the norm's forward for one
norm at a time and frees it again. The result and every gradient equal those without recompute
bitwise (same ops, same order). Where it sits in the step: inside each decoder layer (step 3 of
DESIGN.md's data flow), the recompute in step 6.

Which modules: every submodule of a decoder layer (a transformers ``GradientCheckpointingLayer``;
a model without them: every submodule of the model) whose class name ends in ``RMSNorm``, or that
has a ``variance_epsilon`` attribute and a 1-D ``weight`` parameter. ``nn.LayerNorm`` and the
model's final norm are left alone (the first saves only its input and two statistics; the second
is outside the layers, one per model).

Composes with activation checkpointing (the norm's checkpoint nests inside the layer's: during the
layer's recompute it again keeps only input and output, and its internals exist one norm at a
time in the layer's backward), FSDP2 and DDP (the weight is read at recompute time, while the
layer's unit is still unsharded for its backward), tiled MLP (a different submodule), autocast
(the checkpoint restores the autocast state) and activation offload (the norm's own saved-tensor
hooks take precedence inside it). Costs one more norm forward per norm in backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["NormRecomputeHandle", "apply_norm_recompute", "is_rms_norm"]


def is_rms_norm(module: nn.Module) -> bool:
    """Whether ``module`` is RMSNorm-like: its class name ends in ``RMSNorm``, or it has a
    ``variance_epsilon`` attribute and a 1-D ``weight`` parameter."""
    if type(module).__name__.endswith("RMSNorm"):
        return True
    weight = getattr(module, "weight", None)
    return hasattr(module, "variance_epsilon") and isinstance(weight, nn.Parameter) and weight.dim() == 1


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    return layers or [model]


class NormRecomputeHandle:
    """Undo handle of ``apply_norm_recompute``: ``remove()`` (or leaving a ``with`` block) restores
    every patched norm's original ``forward`` object."""

    def __init__(self, patched: list[tuple[str, nn.Module, Any]]) -> None:
        self._patched = patched

    @property
    def module_names(self) -> list[str]:
        """Qualified names of the norms that recompute."""
        return [n for n, _, _ in self._patched]

    def remove(self) -> None:
        for _, norm, previous in self._patched:
            if previous is None:
                del norm.forward  # back to the class's forward
            else:
                norm.forward = previous
        self._patched = []

    def __repr__(self) -> str:
        return f"NormRecomputeHandle(modules={len(self._patched)})"

    def __enter__(self) -> NormRecomputeHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def apply_norm_recompute(model: nn.Module) -> NormRecomputeHandle:
    """Make every RMSNorm-like module inside ``model``'s decoder layers recompute in backward.

    Each matched norm's ``forward`` is replaced, on the instance, by one that calls the original
    under ``torch.utils.checkpoint(..., use_reentrant=False, preserve_rng_state=False)`` when
    gradients are on (unchanged without them: evaluation keeps nothing anyway).

    Args:
        model: an HF model (or any module); norms are searched inside its decoder layers
            (``GradientCheckpointingLayer``), or in the whole module when it has none.

    Returns:
        A handle; ``handle.remove()`` restores the original ``forward`` objects.

    Raises:
        ValueError: no RMSNorm-like module inside the decoder layers (names the model's class);
            applying twice (names the module).

    Apply before or after ``fully_shard``/DDP, before or after ``apply_tiled_mlp`` and activation
    checkpointing: it patches only the norms' ``forward``.
    """
    norms: dict[int, tuple[str, nn.Module]] = {}
    names = {id(m): n for n, m in model.named_modules()}
    for layer in _decoder_layers(model):
        for m in layer.modules():
            if is_rms_norm(m):
                norms.setdefault(id(m), (names.get(id(m), type(m).__name__), m))
    if not norms:
        raise ValueError(
            f"{type(model).__name__} has no RMSNorm-like module inside its decoder layers (a class named "
            "*RMSNorm, or one with variance_epsilon and a 1-D weight): norm recompute has nothing to do; "
            "leave it off for this model"
        )
    for name, norm in norms.values():
        if getattr(norm.forward, "_ulysses_sp_norm_recompute", False):
            raise ValueError(f"{name} already recomputes: remove the previous handle before applying again")
    patched = []
    for name, norm in norms.values():
        previous = norm.__dict__.get("forward")
        norm.forward = _recompute_forward(norm.forward)
        patched.append((name, norm, previous))
    return NormRecomputeHandle(patched)


def _recompute_forward(forward: Callable) -> Callable:
    def recompute_forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)

    recompute_forward.__wrapped__ = forward  # type: ignore[attr-defined]
    recompute_forward._ulysses_sp_norm_recompute = True  # type: ignore[attr-defined]
    return recompute_forward
