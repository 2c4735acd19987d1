"""Tiled MLP and tiled loss for HuggingFace models: the ``ulysses_sp.tiling`` mechanism, applied.

* ``apply_tiled_mlp(model, num_shards)`` -> ``TiledMLPHandle``: replaces, on the instance, the
  ``forward`` of every MLP block (submodules named ``mlp``) by one that runs the original over
  tiles of the sequence with ``sequence_tiled_compute``. ``handle.remove()`` restores the original
  ``forward`` objects.
* ``TiledCausalLMLoss``: the engine's ``loss_fn`` that runs the model with ``lm_head``'s call
  intercepted and computes ``tiled_causal_lm_loss`` from its input hidden states, so the logits
  never exist for the whole shard.

Contract. Tiling is exact only for token-local blocks, so before patching anything
``apply_tiled_mlp`` checks every MLP: structurally (each leaf module is of a type known to act per
position: Linear, activations, norms, dropout) and, when the parameters are plain local tensors,
numerically (the block on two slices equals the block on the whole). A failing block raises
``ValueError`` naming it and leaves the model untouched; applying twice raises as well. The loss
equals ``ulysses_sp.loss.sp_causal_lm_loss`` on the untiled logits; models that transform their
logits after ``lm_head`` (softcapping, logit scale) are refused.

Where it sits in the step (DESIGN.md): applied to the bare model before wrapping (FSDP2, DDP);
at run time steps 3 (MLPs) and 5 (loss) of the forward, mirrored in backward. No communication
of its own (the loss's SP mean is ``tiled_causal_lm_loss``'s).

Shape legend: ``B`` batch, ``S_l`` local sequence, ``h`` hidden, ``I`` MLP intermediate, ``V``
vocabulary, ``T`` tile length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .loss import IGNORE_INDEX
from .tiling import auto_num_shards, check_num_shards, sequence_tiled_compute, tiled_causal_lm_loss

_TOKEN_LOCAL = (nn.Linear, nn.Identity, nn.LayerNorm, nn.RMSNorm, nn.modules.dropout._DropoutNd)


def _is_token_local_leaf(m: nn.Module) -> bool:
    """Module types that act on each position independently (over the last dim only)."""
    cls = type(m)
    if isinstance(m, _TOKEN_LOCAL) or cls.__name__.endswith("RMSNorm"):
        return True
    if cls.__module__ == "transformers.activations":
        return True
    return cls.__module__ == nn.modules.activation.__name__ and not isinstance(
        m, (nn.MultiheadAttention, nn.Softmax, nn.Softmin, nn.LogSoftmax, nn.Softmax2d)
    )


def _probe_token_local(name: str, mlp: nn.Module, forward: Callable, hidden: int) -> None:
    """Check numerically that position ``t`` of the output depends on position ``t`` only."""
    p = next(mlp.parameters(), None)
    if p is None or p.device.type == "meta" or type(p) not in (torch.Tensor, nn.Parameter):
        return  # meta or sharded (DTensor) parameters: the structural check has to do
    modes = {m: m.training for m in mlp.modules()}
    mlp.eval()  # dropout off for the probe
    try:
        with torch.no_grad():
            gen = torch.Generator(device=p.device).manual_seed(0)  # never the caller's RNG stream
            x = torch.randn(1, 6, hidden, device=p.device, dtype=p.dtype, generator=gen)
            whole = forward(x)
            parts = torch.cat([forward(x[:, :2]), forward(x[:, 2:])], dim=1)
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


def _check_token_local(name: str, mlp: nn.Module) -> None:
    for sub_name, sub in mlp.named_modules():
        if next(sub.children(), None) is None and not _is_token_local_leaf(sub):
            full = f"{name}.{sub_name}" if sub_name else name
            raise ValueError(
                f"cannot tile {name} ({type(mlp).__name__}): its submodule {full} "
                f"({type(sub).__name__}) is not known to be token-local. Tiled MLP recomputes the "
                "block on slices of the sequence, which is exact only when each token's output "
                "depends on that token alone (Linear, activations, norms, dropout)"
            )


class TiledMLPHandle:
    """Undo handle of ``apply_tiled_mlp``: ``remove()`` (or leaving a ``with`` block) restores
    every patched module's original ``forward`` object."""

    def __init__(self, patched: list[tuple[str, nn.Module, Any]], num_shards: int | None) -> None:
        self._patched = patched
        self.num_shards = num_shards
        """Tiles per MLP call; ``None`` = ``auto_num_shards`` per call."""

    @property
    def module_names(self) -> list[str]:
        """Qualified names of the tiled MLPs."""
        return [n for n, _, _ in self._patched]

    def remove(self) -> None:
        for _, mlp, previous in self._patched:
            if previous is None:
                del mlp.forward  # back to the class's forward
            else:
                mlp.forward = previous
        self._patched = []

    def __repr__(self) -> str:
        shards = "auto" if self.num_shards is None else self.num_shards
        return f"TiledMLPHandle(modules={len(self._patched)}, num_shards={shards})"

    def __enter__(self) -> TiledMLPHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def apply_tiled_mlp(
    model: nn.Module, num_shards: int | None = None, *, mlp_name: str = "mlp"
) -> TiledMLPHandle:
    """Make every MLP block of ``model`` (submodules named ``mlp_name``) run tiled.

    Each block's ``forward`` is replaced, on the instance, by one that calls the original over
    ``num_shards`` tiles of the sequence with ``sequence_tiled_compute``: the ``[B, S_l, I]``
    intermediates never exist for the whole shard, only one ``[B, T, I]`` tile at a time.

    Args:
        model: an HF model (or any module) whose MLP blocks take and return ``[B, S_l, h]``.
        num_shards: tiles per call; ``None`` = ``auto_num_shards(S_l, h, B)`` at each call, i.e.
            tiles of about ``h`` tokens. A call whose ``S_l`` is below ``num_shards`` raises.
        mlp_name: attribute name of the MLP blocks.

    Returns:
        A handle; ``handle.remove()`` restores the original ``forward`` objects.

    Raises:
        ValueError: ``num_shards < 1``; no module named ``mlp_name``; an MLP that is not
            token-local (names the module).

    Composes with FSDP2 (apply before or after ``fully_shard``: the block still runs inside its
    unit's single all-gather), activation checkpointing (the tiled block is recomputed with its
    layer) and ``apply``-ing SP attention (MLPs are token-local, so SP does not change them).
    """
    if num_shards is not None:
        check_num_shards(num_shards, what="tiled MLP num_shards")
    mlps = [(n, m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] == mlp_name]
    if not mlps:
        raise ValueError(f"{type(model).__name__} has no submodule named {mlp_name!r} to tile")
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    for name, mlp in mlps:
        if getattr(mlp.forward, "_ulysses_sp_tiled", False):
            raise ValueError(f"{name} is already tiled: remove the previous handle before applying again")
        _check_token_local(name, mlp)
        if hidden is not None:
            _probe_token_local(name, mlp, mlp.forward, hidden)
    patched = []
    for name, mlp in mlps:
        previous = mlp.__dict__.get("forward")
        mlp.forward = _tiled_forward(name, mlp, mlp.forward, num_shards)
        patched.append((name, mlp, previous))
    return TiledMLPHandle(patched, num_shards)


def _tiled_forward(name: str, mlp: nn.Module, forward: Callable, num_shards: int | None) -> Callable:
    preserve = any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in mlp.modules())

    def tiled_forward(x: torch.Tensor) -> torch.Tensor:
        seq_dim = x.dim() - 2  # [B, S_l, h] or [T, h]
        s_l = x.shape[seq_dim]
        b = x.shape[0] if x.dim() == 3 else 1
        n = auto_num_shards(s_l, x.shape[-1], b) if num_shards is None else num_shards
        check_num_shards(n, s_l, what=f"{name}: tiled MLP num_shards")
        return sequence_tiled_compute(
            forward, x, n, params=list(mlp.parameters()), seq_dim=seq_dim, preserve_rng_state=preserve
        )

    tiled_forward.__wrapped__ = forward  # type: ignore[attr-defined]
    tiled_forward._ulysses_sp_tiled = True  # type: ignore[attr-defined]
    return tiled_forward


@dataclass(frozen=True)
class TiledCausalLMLoss:
    """A ``loss_fn`` for the engine: ``loss_fn(model, batch, shift_labels, sp_group) -> output``.

    Runs ``model(**batch)`` through the model's own ``__call__`` (so FSDP2's root hooks gather the
    root's parameters and the decoder layers' hooks run as usual), but intercepts the
    ``lm_head`` call: its input hidden states ``[B, S_l, h]`` go to ``tiled_causal_lm_loss`` and
    ``lm_head`` itself only sees an empty ``[B, 0, h]`` slice. The returned HF output has
    ``.loss`` set and empty ``logits [B, 0, V]``. ``batch`` holds the model's keyword inputs
    (``input_ids``, ``position_ids``, ...); ``labels``/``shift_labels`` entries are ignored.
    """

    num_shards: int | None = None
    """Tiles per shard; ``None`` = ``auto_num_shards``."""
    ignore_index: int = IGNORE_INDEX
    """Label value excluded from the loss."""

    def __post_init__(self) -> None:
        if self.num_shards is not None:
            check_num_shards(self.num_shards, what="tiled loss num_shards")

    def __call__(
        self, model: nn.Module, batch: dict[str, Any], shift_labels: torch.Tensor, sp_group: Any
    ) -> Any:
        inner = model  # DDP and similar wrappers: hooks go on the wrapped model, the call on the wrapper
        while not hasattr(inner, "get_output_embeddings") and isinstance(
            getattr(inner, "module", None), nn.Module
        ):
            inner = inner.module
        config = getattr(inner, "config", None)
        for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
            if getattr(config, attr, None) not in (None, 1, 1.0):
                raise ValueError(f"tiled loss computes plain lm_head logits; {attr} is not supported")
        lm_head = inner.get_output_embeddings()
        result: dict[str, torch.Tensor] = {}

        def intercept(module: nn.Module, args: tuple) -> tuple | None:
            if "loss" in result:
                return None
            (hidden,) = args
            result["loss"] = tiled_causal_lm_loss(
                hidden,
                module,
                shift_labels,
                sp_group,
                num_shards=self.num_shards,
                ignore_index=self.ignore_index,
            )
            return (hidden[:, :0],)  # [B, S_l, h] -> [B, 0, h]: no logits materialised

        inputs = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}
        inputs.setdefault("use_cache", False)
        hook = lm_head.register_forward_pre_hook(intercept)
        try:
            out = model(**inputs)
        finally:
            hook.remove()
        if "loss" not in result:
            raise ValueError(f"{type(model).__name__}'s forward never called its output embeddings")
        out.loss = result["loss"]
        return out
