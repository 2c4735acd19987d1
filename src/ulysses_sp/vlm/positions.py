"""Full-sequence positions of a VLM batch: the text row and the 3-D multimodal rotary rows.

Qwen-VL language models take ``position_ids [4, B, S]``: row 0 the text positions (what the mask
and the SP attention read: packed documents restart at 0), rows 1-3 the mrope positions (temporal,
height, width), which the model's ``get_rope_index`` computes from the token types and the
image/video grids. Under SP they must be computed over the **full** sequence before sharding: a
shard cannot know how many image rows or frames precede it.

Packed samples: ``get_rope_index`` numbers one row continuously; each document's mrope positions
are the row's minus the value at the document's first token (``get_rope_index`` shifts all three
rows of a text run or an image by the same running offset, and a document's first token — text,
or the first patch of an image — carries exactly that offset), so every document starts at 0 as it
would alone.

Shape legend: ``B`` batch, ``S`` sequence, ``N_img``/``N_vid`` images/videos of the batch.
"""

from __future__ import annotations

from typing import Any

import torch

from ulysses_sp.vlm.families import vlm_parts

TEXT, IMAGE, VIDEO = 0, 1, 2
"""``mm_token_type_ids`` values (the processors' convention)."""


def token_types(config: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` int: ``IMAGE`` at the config's image token, ``VIDEO`` at its video token, else ``TEXT``."""
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types[input_ids == config.image_token_id] = IMAGE
    types[input_ids == config.video_token_id] = VIDEO
    return types


def vlm_position_ids(
    model: Any,
    input_ids: torch.Tensor,
    *,
    mm_token_type_ids: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[4, B, S]`` positions of a full-sequence VLM batch (see the module docstring).

    Args:
        model: an admitted VLM (``families.SUPPORTED_VLMS``).
        input_ids: ``[B, S]`` with the image/video placeholder tokens.
        mm_token_type_ids: ``[B, S]`` (0 text, 1 image, 2 video); ``None``: from the placeholder ids.
        image_grid_thw: ``[N_img, 3]``; video_grid_thw: ``[N_vid, 3]``; second_per_grid_ts:
            ``[N_vid]`` (Qwen2.5-VL): as the processor returns them.
        position_ids: ``[B, S]`` text positions (packed documents restart at 0); ``None``: ``arange(S)``.

    Raises:
        ValueError: the model is not an admitted VLM, or the placeholders do not match the grids.
    """
    parts = vlm_parts(model)
    if parts is None:
        raise ValueError(f"{type(model).__name__} is not a VLM ulysses_sp.vlm supports (see SUPPORTED_VLMS)")
    if parts.scatter is not None:
        raise ValueError(
            f"{parts.inner.config.model_type} is a LLaVA-style VLM: its positions are the text's [B, S] "
            "(no mrope rows); pass position_ids [B, S] (or none) and no vlm_position_ids"
        )
    b, s = input_ids.shape
    types = token_types(parts.inner.config, input_ids) if mm_token_type_ids is None else mm_token_type_ids
    text = torch.arange(s, device=input_ids.device).repeat(b, 1) if position_ids is None else position_ids
    if tuple(text.shape) != (b, s):
        raise ValueError(f"position_ids has shape {tuple(text.shape)}; expected [B, S] = [{b}, {s}]")
    check_placeholders(parts.inner, types, image_grid_thw, video_grid_thw)
    extra = {} if second_per_grid_ts is None else {"second_per_grid_ts": second_per_grid_ts}
    if image_grid_thw is None and video_grid_thw is None:
        mrope = text[None].expand(3, b, s)
    else:
        mrope, _ = parts.inner.get_rope_index(
            input_ids,
            mm_token_type_ids=types,
            image_grid_thw=image_grid_thw,
            video_grid_thw=video_grid_thw,
            **extra,
        )
        # each document's positions from 0: subtract the value at its first token (module docstring)
        doc = (text == 0).long().cumsum(
            dim=1
        ) - 1  # [B, S] document index of each token (-1: before the first start)
        first = torch.zeros_like(mrope)
        for row in range(b):
            starts = (text[row] == 0).nonzero().flatten()
            if starts.numel() == 0:
                continue
            # [3, n_docs] -> [3, S]: each token gets its document's offset
            first[:, row] = mrope[:, row, starts][:, doc[row].clamp(min=0)]
            first[:, row, doc[row] < 0] = 0
        mrope = mrope - first
    return torch.cat([text[None].to(mrope.dtype), mrope], dim=0)  # [1+3, B, S]


def check_placeholders(
    inner: Any, types: torch.Tensor, image_grid_thw: torch.Tensor | None, video_grid_thw: torch.Tensor | None
) -> None:
    """Raise ``ValueError`` unless the batch has one placeholder token per merged visual token."""
    merge = int(inner.config.vision_config.spatial_merge_size) ** 2
    for kind, code, grid in (("image", IMAGE, image_grid_thw), ("video", VIDEO, video_grid_thw)):
        tokens = int((types == code).sum())
        wanted = 0 if grid is None else int(grid.prod(dim=-1).sum()) // merge
        if tokens != wanted:
            raise ValueError(
                f"the batch has {tokens} {kind} placeholder tokens but its {kind}_grid_thw "
                f"({None if grid is None else grid.tolist()}) makes {wanted} {kind} embeddings: the text "
                f"must hold exactly one placeholder per merged patch (build samples with the model's processor)"
            )
