"""Shard a VLM's language model input after the merge: a forward pre-hook on the language model.

``shard_vlm(model, mesh, core)`` installs, on an admitted VLM (``families``):

- a forward pre-hook on its language model that replaces the full-sequence keyword inputs the
  model's own forward built — ``inputs_embeds [B, S, Hd]`` (text embeddings with the visual ones
  scattered in), ``position_ids [4, B, S]``, and Qwen3-VL's ``visual_pos_masks [B, S]`` and
  ``deepstack_visual_embeds`` (``[N_v, Hd]`` per deepstack layer) — by this rank's tokens
  (``parallel.mesh_shape.shard_spans``: ``[k*S/P, (k+1)*S/P)``, or its zigzag pieces with a ring);
- the vision tower's attention back on the core attention: ``register_with_transformers`` points
  every sub-config at the SP attention, but the vision tower runs whole on every rank.

Slicing is differentiable: the gradient of this rank's tokens flows back through the merge into the
vision tower and the token embeddings; summed over the SP group (the sharding engine sums every
gradient over SP) that is the full-sequence gradient, as for the text embeddings.

Where the vision tower runs: on every rank of the SP group, over all the sample's images. Its
compute and activations are replicated ``P`` times. The alternative, ``split_images_over=``
(``vlm.split``), splits whole images over the group and sums the embeddings over it: less compute
and memory per rank, at the price of an uneven split and one collective per encoder call. ``bench/vlm_memory.py`` reports the tower's peak
apart from the language model's.

Shape legend: ``B`` batch, ``S`` global sequence, ``S_l = S/P``, ``Hd`` hidden, ``N_v`` visual tokens.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ulysses_sp.attention.registration import ATTN_NAME
from ulysses_sp.parallel.mesh_shape import shard_spans
from ulysses_sp.vlm.families import vlm_parts
from ulysses_sp.vlm.split import split_vision

INSTALLED = "_ulysses_sp_vlm_shard"
"""The language model's attribute holding its ``VLMShardHandle`` while installed."""


class VLMShardHandle:
    """What ``shard_vlm`` returns; ``remove()`` restores the language model and the vision attention."""

    def __init__(
        self, model: nn.Module, language_model: nn.Module, hook: Any, vision_config: Any, prev: Any, undo: Any
    ) -> None:
        self.model, self.language_model = model, language_model
        self._hook, self._vision_config, self._prev, self._undo = hook, vision_config, prev, undo

    def remove(self) -> None:
        if self._hook is None:
            return
        if self._undo is not None:
            self._undo()
        self._hook.remove()
        self.language_model.__dict__.pop(INSTALLED, None)
        self._hook = None
        self._vision_config._attn_implementation = self._prev


def shard_vlm(
    model: nn.Module,
    *,
    sp_rank: int,
    sp_size: int,
    ring_size: int = 1,
    core: str | None = None,
    split_images_over: Any = None,
) -> VLMShardHandle:
    """Install the language-model pre-hook and keep the vision tower on ``core`` attention.

    Call it after ``register_with_transformers`` (which points the whole model at the SP attention);
    ``core=None``: the core attention of that registration. ``initialize`` and ``prepare`` call it.
    ``split_images_over``: the SP group, to split the sample's images over its ranks instead of
    encoding all of them on every rank (``vlm.split``); ``None``: every rank encodes every image.

    Raises:
        ValueError: ``model`` is not an admitted VLM (``families.SUPPORTED_VLMS``).
    """
    parts = vlm_parts(model)
    if parts is None:
        raise ValueError(f"{type(model).__name__} is not a VLM ulysses_sp.vlm supports (see SUPPORTED_VLMS)")
    if core is None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        core = getattr(ALL_ATTENTION_FUNCTIONS.get(ATTN_NAME), "core", None)
        if core is None:
            raise ValueError("shard_vlm needs register_with_transformers(...) first (or core='sdpa')")
    if INSTALLED in parts.language_model.__dict__:
        raise ValueError(
            f"{type(model).__name__} is sharded for SP already (shard_vlm was called); remove() it first"
        )
    vision_config = parts.vision.config
    prev = vision_config._attn_implementation
    vision_config._attn_implementation = core  # the tower's own attention over its whole images

    def before(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        return args, shard_language_model_inputs(
            kwargs, sp_rank=sp_rank, sp_size=sp_size, ring_size=ring_size
        )

    hook = parts.language_model.register_forward_pre_hook(before, with_kwargs=True)
    undo = None
    if split_images_over is not None and sp_size > 1:
        merge = int(vision_config.spatial_merge_size) ** 2
        undo = split_vision(
            parts.vision, group=split_images_over, sp_rank=sp_rank, sp_size=sp_size, merge=merge
        )
    handle = VLMShardHandle(model, parts.language_model, hook, vision_config, prev, undo)
    parts.language_model.__dict__[INSTALLED] = handle
    return handle


def installed(model: nn.Module) -> VLMShardHandle | None:
    """The ``shard_vlm`` handle installed on ``model`` (an admitted VLM), else ``None``."""
    parts = vlm_parts(model)
    return None if parts is None else parts.language_model.__dict__.get(INSTALLED)


def shard_language_model_inputs(
    kwargs: dict[str, Any], *, sp_rank: int, sp_size: int, ring_size: int = 1
) -> dict[str, Any]:
    """This rank's share of the language model's full-sequence keyword inputs (module docstring)."""
    embeds, pos = kwargs.get("inputs_embeds"), kwargs.get("position_ids")
    if embeds is None or kwargs.get("input_ids") is not None:
        raise ValueError(
            "under sequence parallelism the VLM's language model must be called with inputs_embeds (the "
            "model's forward merges the visual embeddings first); call the VLM itself with the full sample"
        )
    b, s = embeds.shape[:2]
    if pos is None or pos.dim() != 3 or tuple(pos.shape) != (4, b, s):
        got = None if pos is None else tuple(pos.shape)
        raise ValueError(
            f"a VLM under sequence parallelism needs position_ids [4, B, S] = [4, {b}, {s}] over the full "
            f"sequence (text row + 3-D mrope rows), got {got}: pass position_ids="
            "ulysses_sp.vlm.vlm_position_ids(...) (prepare_vlm_batch does)"
        )
    if torch.is_tensor(kwargs.get("attention_mask")):
        raise ValueError(
            "a VLM under sequence parallelism takes no attention_mask (the SP attention builds the causal, "
            "per-document mask from position_ids); drop it, pad on the right"
        )
    spans = shard_spans(s, sp_rank, sp_size, ring_size)
    idx = torch.cat([torch.arange(a, e, device=embeds.device) for a, e in spans])  # [S_l] global token index
    out = dict(kwargs)
    out["inputs_embeds"] = embeds.index_select(1, idx)  # [B, S, Hd] -> [B, S_l, Hd]
    out["position_ids"] = pos.index_select(2, idx.to(pos.device))  # [4, B, S] -> [4, B, S_l]
    visual = kwargs.get("visual_pos_masks")
    if visual is not None:
        visual = visual.to(embeds.device)
        row = visual.flatten().long().cumsum(0).view(b, s) - 1  # [B, S]: row of each visual token in N_v
        local = visual.index_select(1, idx)  # [B, S] -> [B, S_l]
        rows = row.index_select(1, idx)[local]  # [N_v_local]
        out["visual_pos_masks"] = local
        deep = kwargs.get("deepstack_visual_embeds")
        if deep is not None:
            out["deepstack_visual_embeds"] = [
                d.index_select(0, rows.to(d.device)) for d in deep
            ]  # [N_v, Hd] -> [N_v_l, Hd]
    return out
