"""One rank's model inputs from a full-sequence VLM batch (the data side of ``shard``).

Text batches are cut before the model (``data.shard``); a VLM batch is not: every rank of the SP
group needs the whole sample (token ids for the placeholder merge, pixels, grids) because the merge
and the mrope positions are full-sequence operations. So ``prepare_vlm_batch`` keeps the model
inputs whole and cuts only the pre-shifted labels:

    {input_ids [B, S], position_ids [4, B, S], mm_token_type_ids [B, S], pixel_values, ...grids,
     shift_labels [B, S_l]}

(a LLaVA-style family, ``families.SCATTER_VLMS``: ``position_ids [B, S]``, no ``mm_token_type_ids``;
Gemma 3's ``token_type_ids [B, S]`` stay whole too, and their runs of 1, each image's bidirectional block,
are found here on the host and attached to ``position_ids`` as its ``HostLayout``'s spans:
``parallel/doc_layout.py``; GIT, ``families.PREFIX_VLMS``: ``prefix.prepare_prefix_batch``, its
sequence the image prefix and the text).

``S`` is padded to a multiple of ``P`` (``data.shard.prepare_batch``: pad ids, labels ``-100``,
positions continuing). The per-shard forward (``merge``) embeds and merges this rank's tokens only.

``pack_vlm_samples`` builds packed rows from whole samples for that (``train --packing best-fit``).

Shape legend: ``B`` batch, ``S`` global (padded) sequence, ``S_l = S/P``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ulysses_sp.data.shard import prepare_batch
from ulysses_sp.parallel.doc_layout import attach_layout, bidirectional_spans, host_layout
from ulysses_sp.parallel.mesh_shape import shard_spans
from ulysses_sp.vlm.families import VLMParts, vlm_parts
from ulysses_sp.vlm.positions import token_types, vlm_position_ids
from ulysses_sp.vlm.prefix import prepare_prefix_batch

_GRIDS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
_MEDIA = ("pixel_values", "pixel_values_videos", "image_patches")  # Fuyu's processor: image_patches (legacy name)
_PER_IMAGE = ("image_sizes",)  # LLaVA-style: Mistral 3's / LLaVA's image sizes [N_img, 2]
_PHI4 = ("image_pixel_values", "image_attention_mask", "audio_input_features", "audio_embed_sizes", "audio_attention_mask")
"""Phi-4-multimodal's per-image crops and masks, per-clip features, sizes and masks (not per token)."""
_AUDIO = ("input_features", "input_features_mask")  # Gemma 3n's clips: [N_clip, T, F] mel frames, [N_clip, T] valid
SAMPLE_MEDIA = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
"""A sample's per-image / per-video keys (``vlm.data``): concatenated in sample order when samples
are packed into a row or collated into a micro-batch."""


def prepare_vlm_batch(
    model: Any,
    batch: Mapping[str, Any],
    *,
    sp_rank: int,
    sp_size: int,
    ring_size: int = 1,
    pad_token_id: int = 0,
) -> dict[str, Any]:
    """The inputs of SP rank ``sp_rank`` for one full-sequence VLM batch (module docstring).

    ``batch`` is what the model's processor returns: Qwen-VL's (``input_ids``, ``pixel_values``,
    ``image_grid_thw``, ...) or a LLaVA-style family's (``input_ids``, ``pixel_values
    [N_img, C, H, W]``, Mistral 3's ``image_sizes``; its positions stay ``[B, S]``), optionally with
    ``labels`` and packed ``position_ids [B, S]``. Pass the same batch on every rank of the SP group.

    Raises:
        ValueError: malformed batch (``data.shard``'s checks) or placeholders that do not match
            the grids (``positions.check_placeholders``).
    """
    full, parts = dict(batch), _parts(model)
    if parts.prefix:  # GIT: the image prepended inside the model, the sequence N + S (``prefix``)
        return prepare_prefix_batch(parts, full, sp_rank=sp_rank, sp_size=sp_size, ring_size=ring_size,
                                    pad_token_id=pad_token_id)  # fmt: skip
    if parts.scatter is None and full.get("mm_token_type_ids") is None:
        full["mm_token_type_ids"] = token_types(parts.inner.config, full["input_ids"])
    # pixels and grids are per patch / per image, not per token: kept out of the per-token checks and padding
    # (a pixel_values [N_p, C] whose N_p or C happens to equal B or S would be taken for a per-token tensor)
    media = {k: full.pop(k) for k in (*_MEDIA, *_GRIDS, *_PER_IMAGE, *_AUDIO, *_PHI4) if k in full}
    prepared = {**prepare_batch(full, sp_size, pad_token_id=pad_token_id, ring_size=ring_size), **media}
    ids = prepared["input_ids"]
    if parts.scatter is None:  # Qwen: [B, S] -> [4, B, S] (text row + mrope rows); LLaVA-style: [B, S] as is
        prepared["position_ids"] = vlm_position_ids(
            model,
            ids,
            mm_token_type_ids=prepared["mm_token_type_ids"],
            position_ids=prepared["position_ids"],
            **{k: prepared[k] for k in _GRIDS if prepared.get(k) is not None},
        )
    key = parts.scatter.spans_key if parts.scatter is not None else None
    if key is not None and prepared.get(key) is not None:  # Gemma 3: each image's block, as host ints, once per batch
        pos = prepared["position_ids"].clone()  # not the caller's tensor
        prepared["position_ids"] = attach_layout(pos, host_layout(pos, spans=bidirectional_spans(prepared[key])))
    spans = shard_spans(ids.shape[1], sp_rank, sp_size, ring_size)
    labels = prepared["shift_labels"]
    prepared["shift_labels"] = torch.cat([labels[:, a:e] for a, e in spans], dim=1)  # [B, S] -> [B, S_l]
    return prepared


def _parts(model: Any) -> VLMParts:
    parts = vlm_parts(model)
    if parts is None:
        raise ValueError(f"{type(model).__name__} is not a VLM ulysses_sp.vlm supports (see SUPPORTED_VLMS)")
    return parts


def pack_vlm_samples(samples: list[dict[str, torch.Tensor]], seq_len: int) -> list[dict[str, torch.Tensor]]:
    """Whole VLM samples packed into rows of at most ``seq_len`` tokens (``data.bestfit``'s best-fit
    decreasing over the sample lengths; a row's samples in the plan's order).

    Each sample is a ``[1, S_i]`` ``input_ids``/``labels``/``mm_token_type_ids`` dict (``vlm.data``) with its
    images' and videos' ``SAMPLE_MEDIA``. A row concatenates its samples' tokens, restarts
    ``position_ids [1, S_row]`` at 0 at each (``prepare_vlm_batch`` then starts each document's mrope
    positions at 0, and the SP attention keeps the documents apart) and concatenates their images in
    the same order (videos likewise), so every image and video stays whole and its placeholders keep
    their order.

    Raises:
        ValueError: a sample longer than ``seq_len`` (it cannot be cut: its images would be).
    """
    import numpy as np

    from ulysses_sp.data.bestfit import plan_blocks

    lengths = np.array([s["input_ids"].shape[1] for s in samples], dtype=np.int64)
    if len(lengths) and int(lengths.max()) > seq_len:
        i = int(lengths.argmax())
        raise ValueError(f"sample {i} has {int(lengths[i])} tokens > seq_len {seq_len}: a VLM sample is packed whole")
    plan = plan_blocks(lengths, seq_len, packing="best-fit", long_samples="truncate")
    rows = []
    for b in range(len(plan)):
        docs = [samples[int(i)] for i in plan.sample[plan.offsets[b] : plan.offsets[b + 1]]]
        row = {k: torch.cat([d[k] for d in docs], dim=1) for k in ("input_ids", "labels", "mm_token_type_ids")}
        row["position_ids"] = torch.cat([torch.arange(d["input_ids"].shape[1]) for d in docs])[None]  # [1, S_row]
        for key in SAMPLE_MEDIA:
            parts = [d[key] for d in docs if key in d]
            if parts:
                row[key] = torch.cat(parts)  # [N_p, C] / [N_img, 3] / [N_vid]: in the row's document order
        rows.append(row)
    return rows
