"""The ALST memory techniques in the ``transformers.Trainer`` path: the options of ``prepare()``.

``prepare(trainer, sp_size=P, tiled_loss=..., tiled_mlp=..., offload_activations=...,
offload_attention=..., recompute_norms=...)`` builds one ``ALSTOptions`` and applies it with the library's own
machinery, the same the CLI uses (``memory.tiling``, ``memory.offload``,
``attention.kv_offload``):

* **tiled logits + loss** (``tiled_loss``): the model's ``lm_head`` call is intercepted (a forward
  pre-hook, removed after the call); its input hidden states ``[B, S_l, h]`` go through
  ``memory.tiling.sequence_tiled_compute`` tile by tile (``[B, T, V]`` logits, fp32 cross-entropy
  sum, recomputed in backward) and ``lm_head`` itself sees ``[B, 0, h]``. The result is the same
  ``(sum of token losses, count)`` as the untiled ``causal_lm_loss_parts``; the Trainer's
  normalisation (``num_items_in_batch``, the ``P`` / ``W`` factors of ``_trainer``) is unchanged.
  No full ``[B, S_l, V]`` logits exist, in train or eval.
* **tiled MLP** (``tiled_mlp``): ``memory.tiling.apply_tiled_mlp`` on the model, undone by
  ``remove()``.
* **activation checkpointing** is the Trainer's own ``TrainingArguments.gradient_checkpointing``;
  **its offload** (``offload_activations``) is ``memory.offload``'s handle on the checkpointed
  decoder layers (their inputs in host memory between forward and backward). It needs
  ``gradient_checkpointing=True``; the Trainer turns checkpointing on when ``train()`` starts, the
  hooks act on the layers that are checkpointed at each forward.
* **norm recompute** (``recompute_norms``): ``memory.norms.apply_norm_recompute`` on the model (the
  decoder layers' RMSNorms keep only input and output), undone by ``remove()``.
* **Ulysses-Offload** (``offload_attention``): the SP attention's blockwise core with the
  full-sequence K/V on the host (``attention.kv_offload``), passed to the registration.
* **bf16** is ``TrainingArguments(bf16=True)`` (the Trainer's autocast); nothing to add.

Where it sits in the step (DESIGN.md): the MLP and checkpoint offload in step 3 (mirrored in 6),
the tiled loss in step 5. No collective of its own.

Shape legend: ``B`` batch, ``S_l`` local sequence, ``h`` hidden, ``V`` vocabulary, ``T`` tile length.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ulysses_sp.attention.core import check_blockwise_options
from ulysses_sp.memory._tiled import auto_num_shards, check_num_shards
from ulysses_sp.memory.norms import NormRecomputeHandle, apply_norm_recompute
from ulysses_sp.memory.offload import ActivationOffloadHandle
from ulysses_sp.memory.tiling import TiledMLPHandle, apply_tiled_mlp, sequence_tiled_compute
from ulysses_sp.parallel.loss import IGNORE_INDEX, causal_lm_loss_parts

__all__ = ["ALSTHandle", "ALSTOptions", "loss_parts"]

_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def _tiles(value: bool | int, name: str) -> int | None:
    """``True`` -> ``None`` (auto tile count), an int -> that count (validated)."""
    return None if value is True else check_num_shards(value, what=f"prepare({name}=...)")


@dataclass(frozen=True)
class ALSTOptions:
    """The ALST techniques of ``prepare()`` (keyword-only, validated before anything is applied)."""

    tiled_loss: bool | int = False
    """Tiled logits + loss: ``True`` (auto tiles, about ``h`` tokens each) or a tile count."""
    tiled_mlp: bool | int = False
    """Tiled MLP blocks: ``True`` (auto tiles) or a tile count."""
    offload_activations: bool = False
    """Checkpointed layer inputs in host memory (needs ``gradient_checkpointing=True``)."""
    offload_attention: bool = False
    """Ulysses-Offload: the full-sequence K/V on the host between forward and backward (sdpa)."""
    recompute_norms: bool = False
    """The decoder layers' RMSNorms keep only input and output, recomputed in backward (``memory.norms``)."""

    def __post_init__(self) -> None:
        for name in ("tiled_loss", "tiled_mlp"):
            if getattr(self, name) is not False:
                _tiles(getattr(self, name), name)

    @property
    def loss_shards(self) -> int | None | bool:
        """``False``: untiled loss; else the tile count (``None`` = auto)."""
        return False if self.tiled_loss is False else _tiles(self.tiled_loss, "tiled_loss")

    def check(self, trainer: Any, core: str) -> None:
        """Refuse what cannot run, naming the fix (same configuration, same answer on every rank)."""
        check_blockwise_options(core, None, self.offload_attention)
        if self.offload_activations and not trainer.args.gradient_checkpointing:
            raise ValueError(
                "offload_activations=True moves the input each checkpointed layer keeps for backward to "
                "host memory; without checkpointing there is nothing to offload: set "
                "gradient_checkpointing=True in TrainingArguments"
            )
        if self.tiled_loss is not False:
            config = getattr(trainer.model, "config", None)
            for attr in _LOGIT_TRANSFORMS:
                if getattr(config, attr, None) not in (None, 1, 1.0):
                    raise ValueError(
                        f"tiled_loss computes plain lm_head logits; this model's config sets {attr}="
                        f"{getattr(config, attr)!r}: pass tiled_loss=False"
                    )

    def apply(self, model: nn.Module) -> ALSTHandle:
        """Patch the model (tiled MLP, checkpoint offload hooks); ``handle.remove()`` undoes it."""
        mlp = None if self.tiled_mlp is False else apply_tiled_mlp(model, _tiles(self.tiled_mlp, "tiled_mlp"))
        offload = ActivationOffloadHandle(model, min_bytes=1) if self.offload_activations else None
        norms = apply_norm_recompute(model) if self.recompute_norms else None
        return ALSTHandle(self, mlp, offload, norms)


class ALSTHandle:
    """What ``ALSTOptions.apply`` installed: ``mlp`` (``TiledMLPHandle``), ``offload``
    (``ActivationOffloadHandle``, with byte counters), ``norms`` (``NormRecomputeHandle``), each
    ``None`` when off; ``remove()``."""

    def __init__(self, options: ALSTOptions, mlp: TiledMLPHandle | None, offload: ActivationOffloadHandle | None,
                 norms: NormRecomputeHandle | None = None) -> None:  # fmt: skip
        self.options, self.mlp, self.offload, self.norms = options, mlp, offload, norms

    def remove(self) -> None:
        for h in (self.mlp, self.offload, self.norms):
            if h is not None:
                h.remove()
        self.mlp = self.offload = self.norms = None


def _output_embeddings(model: nn.Module) -> nn.Module:
    """The ``lm_head`` of a model behind DDP / accelerate / PEFT wrappers."""
    inner = model
    while not hasattr(inner, "get_output_embeddings") and isinstance(
        getattr(inner, "module", None), nn.Module
    ):
        inner = inner.module
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if head is None:
        raise ValueError(f"tiled_loss: {type(inner).__name__} has no output embeddings (lm_head) to tile")
    return head


def _tiled_sum(
    hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor, shards: int | None
) -> torch.Tensor:
    """Sum of token losses of ``head(hidden)`` against ``labels``, one ``[B, T, V]`` tile at a time."""
    b, s_l, h = hidden.shape
    n = auto_num_shards(s_l, h, b) if shards is None else check_num_shards(shards, s_l, what="tiled_loss")
    forward = head.forward  # the module's own forward: its hooks ran once for the whole call

    def tile(h_tile: torch.Tensor, label_tile: torch.Tensor) -> torch.Tensor:
        # a tile without tokens is computed too (it adds 0): no host read of the labels in the step
        return causal_lm_loss_parts(forward(h_tile), label_tile)[0]  # [B, T, h] -> [B, T, V] -> sum

    return sequence_tiled_compute(
        tile,
        hidden,
        n,
        params=list(head.parameters()),
        aux=(labels,),
        reduction="sum",
        preserve_rng_state=False,
    )


def loss_parts(
    model: nn.Module, inputs: Mapping[str, Any], shift_labels: torch.Tensor, shards: int | None | bool
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """``(outputs, sum of token losses, valid-token count)`` of this rank's shard.

    ``shards=False``: the model's own logits ``[B, S_l, V]`` and ``causal_lm_loss_parts``. Else the
    tiled loss (module docstring); ``outputs.logits`` is then ``[B, 0, V]``.
    """
    if shards is False:
        outputs = model(**inputs)
        total, count = causal_lm_loss_parts(outputs.logits, shift_labels)  # logits [B, S_l, V]
        return outputs, total, count
    head = _output_embeddings(model)
    labels = shift_labels
    result: dict[str, torch.Tensor] = {}

    def intercept(module: nn.Module, args: tuple) -> tuple | None:
        if "total" in result:
            return None
        (hidden,) = args
        result["total"] = _tiled_sum(hidden, module, labels.to(hidden.device), shards)
        return (hidden[:, :0],)  # [B, S_l, h] -> [B, 0, h]: no logits materialised

    hook = head.register_forward_pre_hook(intercept)
    try:
        outputs = model(**inputs)
    finally:
        hook.remove()
    if "total" not in result:
        raise ValueError(f"tiled_loss: {type(model).__name__}'s forward never called its lm_head")
    return outputs, result["total"], (labels != IGNORE_INDEX).sum().to(torch.float32)
