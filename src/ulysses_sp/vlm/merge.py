"""The per-shard merge: a VLM's forward that builds only this rank's ``[B, S_l, Hd]`` input.

Without SP, a Qwen-VL model's forward embeds all ``S`` tokens, encodes every image, scatters the
visual rows into the ``[B, S, Hd]`` embeddings and calls its language model. Under SP,
``sharded_forward`` replaces that forward (of ``VLMParts.inner``) on each rank:

1. this rank's token indices (``parallel.mesh_shape.shard_spans``: ``[k*S/P, (k+1)*S/P)``, or its
   zigzag pieces with a ring) cut the full ``input_ids [B, S]`` and ``position_ids [4, B, S]``
   (computed for the whole sample from metadata by ``prepare_vlm_batch``);
2. the text embedding runs on the ``[B, S_l]`` ids only;
3. for images and videos, the merged row of each placeholder is known from the ids (its rank among
   the placeholders): ``split.plan_frames`` assigns the frames to encode and ``split.encode``
   returns exactly the rows of this shard (after one all-to-all when the tower's work is split
   over the group), which are scattered into the ``[B, S_l, Hd]`` embeddings;
4. Qwen3-VL's ``visual_pos_masks`` and deepstack rows are built for the shard the same way;
5. the language model runs on ``S_l`` tokens with the Ulysses attention.

No tensor of ``[B, S, Hd]`` exists on any rank; the largest visual tensor is this rank's share of
the tower's work. Gradients reach the tower through the rows (and the exchange's inverse); summed
over the SP group they are those of the model without SP.

Shape legend: ``B`` batch, ``S`` global sequence, ``S_l = S/P``, ``Hd`` hidden, ``N_l`` this rank's
visual rows, ``P`` sp size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ulysses_sp.vlm.families import VLMParts
from ulysses_sp.vlm.layout import layout_of, rows_by_rank, shard_index
from ulysses_sp.vlm.split import FramePlan, encode, plan_frames


def check_inputs(input_ids: Any, attention_mask: Any, inputs_embeds: Any, encoded: Any) -> None:
    """Raise ``ValueError`` for what a per-shard VLM forward cannot take (both paths)."""
    if input_ids is None or inputs_embeds is not None or encoded:
        raise ValueError(
            "under sequence parallelism a VLM is called with the full sample's input_ids and pixels (each "
            "rank embeds and merges its own shard); inputs_embeds and mm_encoder_outputs are not supported"
        )
    if torch.is_tensor(attention_mask):
        raise ValueError(
            "a VLM under sequence parallelism takes no attention_mask (the SP attention builds the causal, "
            "per-document mask from position_ids); drop it, pad on the right"
        )


def _check(input_ids: Any, position_ids: Any, attention_mask: Any, inputs_embeds: Any, encoded: Any) -> None:
    check_inputs(input_ids, attention_mask, inputs_embeds, encoded)
    b, s = input_ids.shape
    if position_ids is None or position_ids.dim() != 3 or tuple(position_ids.shape) != (4, b, s):
        got = None if position_ids is None else tuple(position_ids.shape)
        raise ValueError(
            f"a VLM under sequence parallelism needs position_ids [4, B, S] = [4, {b}, {s}] over the full "
            f"sequence (text row + 3-D mrope rows), got {got}: pass position_ids="
            "ulysses_sp.vlm.vlm_position_ids(...) (prepare_vlm_batch does)"
        )


def _placeholders(input_ids: torch.Tensor, grid: torch.Tensor, token: int, merge: int) -> torch.Tensor:
    """``[B, S]`` bool: the placeholder tokens of one modality, checked against its grids."""
    full = input_ids == token
    wanted = int(grid.prod(dim=-1).sum()) // merge
    if int(full.sum()) != wanted:
        raise ValueError(
            f"the batch has {int(full.sum())} placeholder tokens (id {token}) but its grids ({grid.tolist()}) "
            f"make {wanted} visual embeddings: the text must hold one placeholder per merged patch (build "
            "samples with the model's processor)"
        )
    return full


def sharded_forward(
    parts: VLMParts, *, sp_rank: int, sp_size: int, ring_size: int, group: dist.ProcessGroup | None
) -> Any:
    """The replacement of ``parts.inner.forward`` (module docstring). ``group``: the SP group to split
    the tower's work over; ``None``: each rank encodes the frames its shard needs."""
    inner, deepstack = parts.inner, hasattr(parts.language_model, "_deepstack_process")
    config = inner.config
    merge = int(config.vision_config.spatial_merge_size) ** 2

    def forward(input_ids: torch.Tensor | None = None, attention_mask: Any = None,
                position_ids: torch.Tensor | None = None, cache: Any = None, inputs_embeds: Any = None,
                use_cache: bool | None = None, pixel_values: torch.Tensor | None = None,
                pixel_values_videos: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                video_grid_thw: torch.Tensor | None = None, mm_token_type_ids: Any = None,
                second_per_grid_ts: Any = None, mm_encoder_outputs: Any = None, **kwargs: Any) -> Any:  # fmt: skip
        _check(input_ids, position_ids, attention_mask, inputs_embeds, mm_encoder_outputs)
        s = input_ids.shape[1]
        indices = [shard_index(s, k, sp_size, ring_size, input_ids.device) for k in range(sp_size)]
        idx = indices[sp_rank]
        embeds = inner.get_input_embeddings()(input_ids.index_select(1, idx))  # [B, S_l] -> [B, S_l, Hd]
        kinds = [(p, g, t) for p, g, t in ((pixel_values, image_grid_thw, config.image_token_id),
                 (pixel_values_videos, video_grid_thw, config.video_token_id)) if p is not None]  # fmt: skip
        masks, deep = [], []
        host = layout_of(input_ids)  # the adapter's host values (vlm.layout): no read of a device tensor
        if kinds:  # images and video frames as one list of frames: one plan, at most one exchange
            if host is not None:
                plan, tower, counts = host.plans[group is not None], host.tower, host.counts
                tower = None if tower is None else tower[group is not None]
            else:  # a model called directly: the same values from the device tensors (host reads)
                plan, counts, tower = *_device_plan(input_ids, kinds, indices, sp_rank, merge, group), None
            rows, layers = encode(parts.vision, [p for p, _, _ in kinds], plan, group, tower=tower)  # [N_l, Hd] each
            start = 0
            for (_, _, token), n in zip(kinds, counts):
                part = slice(start, start + n)  # this kind's rows, in the shard's token order
                start = part.stop
                local = input_ids.index_select(1, idx) == token  # [B, S] -> [B, S_l] placeholders
                embeds = embeds.masked_scatter(local[..., None], rows[part].to(embeds.device, embeds.dtype))
                masks.append(local)
                deep.append([d[part] for d in layers])
        lm_kwargs: dict[str, Any] = {}
        if deepstack:
            lm_kwargs["visual_pos_masks"], lm_kwargs["deepstack_visual_embeds"] = _deepstack(masks, deep, embeds)
        local_pos = position_ids.index_select(2, idx.to(position_ids.device))  # [4, B, S] -> [4, B, S_l]
        text_pos = host.attach_text(local_pos[0]) if host is not None else None  # kept alive: the attention finds it
        outputs = parts.language_model(
            input_ids=None,
            position_ids=local_pos,
            attention_mask=None,
            cache=cache,
            inputs_embeds=embeds,
            use_cache=use_cache,
            **lm_kwargs,
            **kwargs,
        )
        from transformers.modeling_outputs import MultimodalBaseModelOutputWithPast

        del text_pos
        return MultimodalBaseModelOutputWithPast(**outputs)

    return forward


def _device_plan(input_ids: torch.Tensor, kinds: list, indices: list[torch.Tensor], sp_rank: int, merge: int,
                 group: Any) -> tuple[FramePlan, list[int]]:  # fmt: skip
    """Without the adapter's layout: this rank's frame plan and rows per modality, from the device ids."""
    fulls = [_placeholders(input_ids, grid, token, merge) for _, grid, token in kinds]  # [B, S] each
    per_kind = [rows_by_rank(full, indices) for full in fulls]  # [kind][rank] -> [N_k] rows
    first = [0, int(fulls[0].sum())]  # video rows follow the image rows
    needed = [torch.cat([rows[k] + first[j] for j, rows in enumerate(per_kind)]) for k in range(len(indices))]
    grid = torch.cat([g for _, g, _ in kinds])
    plan = plan_frames(grid, needed, sp_rank=sp_rank, merge=merge, split=group is not None)
    return plan, [len(rows[sp_rank]) for rows in per_kind]


def _deepstack(
    masks: list[torch.Tensor], deep: list[list[torch.Tensor]], embeds: torch.Tensor
) -> tuple[torch.Tensor | None, list[torch.Tensor] | None]:
    """Qwen3-VL's ``visual_pos_masks [B, S_l]`` and deepstack rows ``[N_l, Hd]`` per layer for this
    shard: image and video rows placed at their tokens' places among the shard's visual tokens."""
    if not masks:
        return None, None
    visual = masks[0] if len(masks) == 1 else masks[0] | masks[1]
    if len(masks) == 1:
        return visual, [d.to(embeds.device, embeds.dtype) for d in deep[0]]
    out = []
    for img, vid in zip(*deep):
        joint = img.new_zeros(int(visual.sum()), img.shape[-1])  # [N_l images + videos, Hd]
        joint[masks[0][visual]] = img
        joint[masks[1][visual]] = vid
        out.append(joint.to(embeds.device, embeds.dtype))
    return visual, out


def install(parts: VLMParts, forward: Any) -> Any:
    """Put ``forward`` on ``parts.inner``; returns the undo function."""
    module: nn.Module = parts.inner
    module.forward = forward

    def undo() -> None:
        if module.__dict__.get("forward") is forward:
            del module.forward

    return undo
