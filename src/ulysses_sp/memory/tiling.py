"""Sequence-tiled compute (ALST): tiled MLP and tiled logits+loss, for HuggingFace models.

Ulysses SP divides activations by ``P``; some per-token work is still far larger than the model's
hidden state: the MLP's intermediate ``[B, S_l, I]`` (``I`` is 3-4x ``h``) and the logits
``[B, S_l, V]`` (``V`` is 30-1000x ``h``). Both are token-local, so they can be computed over
``n`` tiles of the sequence, keeping for backward only the tile *inputs* and recomputing each tile
in backward. The big tensor then exists for one tile, ``1/n`` of it, at any time.

* ``apply_tiled_mlp(model, num_shards)`` -> ``TiledMLPHandle``: every MLP block (submodules named
  ``mlp``, or ``feed_forward`` as in Bamba, Falcon-H1, Llama 4; Nemotron-H's one-block layers' ``mixer`` that is
  an MLP) runs tiled; ``handle.remove()`` restores the original ``forward`` objects.
* ``TiledCausalLMLoss``: the engine's ``loss_fn``; the logits never exist for the whole shard.
* ``tiled_causal_lm_loss``: ``lm_head`` + cross-entropy per tile, with the same contract as
  ``ulysses_sp.parallel.loss.sp_causal_lm_loss``.
* ``TiledMLP.apply(fn, module, x, shards)``: DeepSpeed's entry point for a tiled MLP block.
* ``sequence_tiled_compute(fn, x, n, ...)``: the generic mechanism, for any token-local ``fn``.

Contract: ``fn`` must treat every position independently, and every tensor requiring grad that it
uses besides ``x`` must be passed in ``params`` (a missing one raises ``ValueError`` in backward).
The result and the gradients equal those of the untiled call. ``apply_tiled_mlp`` checks each MLP
is token-local before patching anything; models that transform their logits after ``lm_head``
(softcapping, logit scale) are refused by the tiled loss.

Where it sits in the step (DESIGN.md): applied to the bare model before wrapping; at run time
steps 3 (MLPs) and 5 (loss) of the forward, mirrored in backward. Tiles are local to the rank, so
ranks may use different tile counts; the only collective is ``sp_mean_loss``'s all-reduce.

Composition: parameter gradients are summed over the tiles and handed to autograd once, so
gradient hooks fire once per backward (DDP, FSDP2, ZeRO-1). Under FSDP2 the tiled module runs
inside its unit's forward, whose parameters are gathered once for all tiles (and once more for
backward). Under activation checkpointing the tiled block is recomputed with its layer.

Shape legend: ``B`` batch, ``S_l`` local sequence, ``h`` hidden, ``I`` MLP intermediate, ``V``
vocabulary, ``n`` number of tiles, ``T = ceil(S_l / n)`` tile length.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ulysses_sp.memory._tiled import (
    ForwardPatchHandle,
    TiledCompute,
    TileSpec,
    absorb_norm,
    auto_num_shards,
    check_num_shards,
    check_token_local,
    has_dropout,
)
from ulysses_sp.parallel.loss import IGNORE_INDEX, causal_lm_loss_parts, sp_mean_loss

__all__ = [
    "TiledCausalLMLoss",
    "TiledMLP",
    "TiledMLPHandle",
    "apply_tiled_mlp",
    "sequence_tiled_compute",
    "tiled_causal_lm_loss",
]


def sequence_tiled_compute(
    fn: Callable[..., torch.Tensor],
    x: torch.Tensor,
    num_shards: int,
    *,
    params: Iterable[torch.Tensor] = (),
    aux: Sequence[torch.Tensor] = (),
    seq_dim: int = 1,
    reduction: str | None = None,
    preserve_rng_state: bool = True,
) -> torch.Tensor:
    """Run a token-local ``fn`` over ``num_shards`` tiles of ``x``'s sequence dim, recomputing in backward.

    Args:
        fn: ``fn(x_tile, *aux_tiles) -> y_tile``; must treat every position independently.
        x: ``[B, S_l, ...]`` the differentiable input (tiled along ``seq_dim``).
        num_shards: number of tiles, ``1 <= num_shards <= x.shape[seq_dim]``.
        params: every tensor requiring grad that ``fn`` uses besides ``x`` (a module's
            ``parameters()``); their gradients are summed over tiles and returned to autograd once.
            A tensor missing here is detected in backward (``ValueError``).
        aux: non-differentiable tensors tiled along the same dim (e.g. labels ``[B, S_l]``).
        seq_dim: the sequence dim of ``x`` and of ``aux``.
        reduction: ``None`` concatenates the tile outputs along ``seq_dim``; ``"sum"`` adds them
            (for a scalar per tile, e.g. a loss sum).
        preserve_rng_state: replay the forward's RNG in the backward recompute (dropout).

    Returns:
        What ``fn(x, *aux)`` would return (the ``reduction`` of the tile outputs). Only ``x``,
        ``aux`` and the output are kept; one tile's intermediates exist at a time.
    """
    seq_dim %= x.dim()
    check_num_shards(num_shards, x.shape[seq_dim])
    if reduction not in (None, "sum"):
        raise ValueError(f"reduction must be None or 'sum', got {reduction!r}")
    for a in aux:
        if a.dim() <= seq_dim or a.shape[seq_dim] != x.shape[seq_dim]:
            raise ValueError(f"aux {tuple(a.shape)} does not match x {tuple(x.shape)} in dim {seq_dim}")
    spec = TileSpec(seq_dim, num_shards, len(aux), reduction == "sum", preserve_rng_state)
    return TiledCompute.apply(fn, spec, x, *aux, *params)


class TiledMLP:
    """DeepSpeed-compatible entry point: ``TiledMLP.apply(fn, self, x, shards, compute_params)``.

    Runs ``fn(module, x_tile)`` over ``shards`` tiles of ``x [B, S_l, h]`` (dim 1, or dim 0 for a
    2-D ``[T, h]``) with ``sequence_tiled_compute``; ``compute_params=None`` means all of
    ``module.parameters()``. Most users want ``apply_tiled_mlp(model)`` instead.
    """

    @staticmethod
    def apply(
        fn: Callable[[nn.Module, torch.Tensor], torch.Tensor],
        module: nn.Module,
        x: torch.Tensor,
        shards: int,
        compute_params: Iterable[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        params = list(module.parameters() if compute_params is None else compute_params)
        return sequence_tiled_compute(
            lambda t: fn(module, t),
            x,
            shards,
            params=params,
            seq_dim=x.dim() - 2,
            preserve_rng_state=has_dropout(module),
        )


class TiledMLPHandle(ForwardPatchHandle):
    """Undo handle of ``apply_tiled_mlp`` (``num_shards``: tiles per MLP call)."""


def apply_tiled_mlp(
    model: nn.Module, num_shards: int | None = None, *, mlp_name: str | tuple[str, ...] = ("mlp", "feed_forward")
) -> TiledMLPHandle:
    """Make every MLP block of ``model`` (submodules named ``mlp_name``, or any of its names) run tiled.

    Each block's ``forward`` is replaced, on the instance, by one that calls the original over
    ``num_shards`` tiles of the sequence with ``sequence_tiled_compute``: the ``[B, S_l, I]``
    intermediates never exist for the whole shard, only one ``[B, T, I]`` tile at a time.

    Args:
        model: an HF model (or any module) whose MLP blocks take and return ``[B, S_l, h]``.
        num_shards: tiles per call; ``None`` = ``auto_num_shards(S_l, h, B)`` at each call, i.e.
            tiles of about ``h`` tokens. A call whose ``S_l`` is below ``num_shards`` raises.
        mlp_name: attribute name(s) of the MLP blocks.

    Returns:
        A handle; ``handle.remove()`` restores the original ``forward`` objects.

    Raises:
        ValueError: ``num_shards < 1``; no module named ``mlp_name``; an MLP that is not
            token-local (names the module; the model is left untouched); applying twice.

    Composes with FSDP2 (apply before or after ``fully_shard``: the block still runs inside its
    unit's single all-gather), activation checkpointing (the tiled block is recomputed with its
    layer) and SP attention (MLPs are token-local, so SP does not change them).
    """
    if num_shards is not None:
        check_num_shards(num_shards, what="tiled MLP num_shards")
    names = (mlp_name,) if isinstance(mlp_name, str) else mlp_name
    mlps = [(n, m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in names or _block_mlp(n, m)]
    if not mlps:
        raise ValueError(f"{type(model).__name__} has no submodule named {' or '.join(map(repr, names))} to tile")
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    for name, mlp in mlps:
        if getattr(mlp.forward, "_ulysses_sp_tiled", False):
            raise ValueError(f"{name} is already tiled: remove the previous handle before applying again")
        check_token_local(name, mlp, hidden)
    patched = []
    for name, mlp in mlps:
        previous = mlp.__dict__.get("forward")
        mlp.forward = _tiled_forward(name, mlp, mlp.forward, num_shards)
        patched.append((name, mlp, previous))
    return TiledMLPHandle(patched, num_shards)


def _block_mlp(name: str, module: nn.Module) -> bool:
    """Nemotron-H's one-block layers name every block ``mixer`` (Mamba-2, attention, MLP): its MLP's class says."""
    return name.rsplit(".", 1)[-1] == "mixer" and type(module).__name__.endswith("MLP")


def _tiled_forward(name: str, mlp: nn.Module, forward: Callable, num_shards: int | None) -> Callable:
    preserve = has_dropout(mlp)

    def tiled_forward(x: torch.Tensor) -> torch.Tensor:
        seq_dim = x.dim() - 2  # [B, S_l, h] or [T, h]
        s_l = x.shape[seq_dim]
        b = x.shape[0] if x.dim() == 3 else 1
        n = auto_num_shards(s_l, x.shape[-1], b) if num_shards is None else num_shards
        check_num_shards(n, s_l, what=f"{name}: tiled MLP num_shards")
        fn, x, params = absorb_norm(x, forward, list(mlp.parameters()))  # x = norm(x0): mlp(norm(.)) over x0
        return sequence_tiled_compute(fn, x, n, params=params, seq_dim=seq_dim, preserve_rng_state=preserve)

    tiled_forward.__wrapped__ = forward  # type: ignore[attr-defined]
    tiled_forward._ulysses_sp_tiled = True  # type: ignore[attr-defined]
    return tiled_forward


def tiled_causal_lm_loss(
    hidden_states: torch.Tensor,
    lm_head: nn.Module,
    shift_labels: torch.Tensor,
    sp_group: dist.ProcessGroup | None,
    *,
    num_shards: int | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """``sp_causal_lm_loss(lm_head(hidden_states), shift_labels, sp_group)`` without the logits.

    The logits ``[B, S_l, V]`` and their gradient only ever exist for one ``[B, T, V]`` tile:
    forward computes each tile's fp32 cross-entropy sum and drops the tile; backward recomputes
    each tile's logits and back-propagates into ``hidden_states`` and ``lm_head``'s parameters.
    Every tile is computed, even one whose labels are all ``ignore_index`` (it adds exactly 0):
    deciding to skip it would read device values on the host.

    Args:
        hidden_states: ``[B, S_l, h]`` the final (normed) hidden states of this rank's shard.
        lm_head: the output projection (``model.get_output_embeddings()``), token-local; under
            FSDP2 it must belong to its parent's unit (the usual recipe), not be sharded alone.
        shift_labels: ``[B, S_l]`` labels already shifted over the full sequence.
        sp_group: the sequence-parallel group, ``None`` without SP.
        num_shards: tiles per shard; ``None`` = ``auto_num_shards(S_l, h, B)``.

    Returns:
        The global mean over valid tokens of the SP group (value identical on every SP rank,
        gradient this rank's share), exactly as ``ulysses_sp.parallel.loss.sp_causal_lm_loss``.
    """
    if hidden_states.dim() != 3 or hidden_states.shape[:2] != shift_labels.shape:
        raise ValueError(
            f"hidden_states {tuple(hidden_states.shape)} and shift_labels {tuple(shift_labels.shape)} "
            "disagree: expected hidden_states [B, S_l, h] and labels [B, S_l]"
        )
    if isinstance(lm_head, FSDPModule):
        raise ValueError(
            "tiled loss needs lm_head's parameters gathered by its parent FSDP unit: fully_shard the "
            "decoder layers and the whole model, not lm_head on its own"
        )
    b, s_l, h = hidden_states.shape
    n = auto_num_shards(s_l, h, b) if num_shards is None else num_shards
    check_num_shards(n, s_l, what="tiled loss num_shards")
    labels = shift_labels.to(hidden_states.device)
    head = lm_head.forward  # the module's own forward: hooks (FSDP, ours) ran for the whole call

    def tile_loss(h_tile: torch.Tensor, label_tile: torch.Tensor) -> torch.Tensor:
        # a tile without a valid token is computed too (its sum is 0): skipping it would read the
        # labels on the host, a device sync inside the step (DESIGN.md, "Scale without a GPU")
        # [B, T, h] -> [B, T, V] (one tile of logits) -> fp32 sum of token losses
        return causal_lm_loss_parts(head(h_tile), label_tile, ignore_index=ignore_index)[0]

    total = sequence_tiled_compute(
        tile_loss,
        hidden_states,
        n,
        params=list(lm_head.parameters()),
        aux=(labels,),
        reduction="sum",
        preserve_rng_state=False,
    )
    count = (labels != ignore_index).sum().to(torch.float32)
    return sp_mean_loss(total, count, sp_group)


@dataclass(frozen=True)
class TiledCausalLMLoss:
    """A ``loss_fn`` for the engine: ``loss_fn(model, batch, shift_labels, sp_group) -> output``.

    Runs ``model(**batch)`` through the model's own ``__call__`` (so FSDP2's root hooks gather the
    root's parameters and the decoder layers' hooks run as usual), but intercepts the
    ``lm_head`` call: its input hidden states ``[B, S_l, h]`` go to ``tiled_causal_lm_loss`` and
    ``lm_head`` itself only sees an empty ``[B, 0, h]`` slice. The returned HF output has the
    loss set (``out.loss`` and ``out["loss"]``) and empty ``logits [B, 0, V]``. ``batch`` holds the model's keyword inputs
    (``input_ids``, ``position_ids``, ...); ``labels``/``shift_labels`` entries are ignored.
    """

    num_shards: int | None = None
    """Tiles per shard; ``None`` = ``auto_num_shards``."""
    ignore_index: int = IGNORE_INDEX
    """Label value excluded from the loss."""

    def __post_init__(self) -> None:
        if self.num_shards is not None:
            check_num_shards(self.num_shards, what="tiled loss num_shards")

    @staticmethod
    def check_model(model: nn.Module) -> None:
        """Raise ``ValueError`` unless ``model``'s logits are its plain ``lm_head`` output (no softcapping
        or logit scale in its config); pure, so the launcher asks it of the model on the meta device."""
        config = getattr(model, "config", None)
        for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
            if getattr(config, attr, None) not in (None, 1, 1.0):
                raise ValueError(f"tiled loss computes plain lm_head logits; {attr} is not supported")

    def __call__(
        self, model: nn.Module, batch: dict[str, Any], shift_labels: torch.Tensor, sp_group: Any
    ) -> Any:
        inner = model  # DDP and similar wrappers: hooks go on the wrapped model, the call on the wrapper
        while not hasattr(inner, "get_output_embeddings") and isinstance(
            getattr(inner, "module", None), nn.Module
        ):
            inner = inner.module
        self.check_model(inner)
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
        if isinstance(out, MutableMapping):  # transformers ModelOutput: keep item and attribute in step
            out["loss"] = result["loss"]
        else:
            out.loss = result["loss"]
        return out
