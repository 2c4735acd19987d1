"""One rank's model inputs from a full-sequence VLM batch (the data side of ``shard``).

Text batches are cut before the model (``data.shard``); a VLM batch is not: every rank of the SP
group needs the whole sample (token ids for the placeholder merge, pixels, grids) because the merge
and the mrope positions are full-sequence operations. So ``prepare_vlm_batch`` keeps the model
inputs whole and cuts only the pre-shifted labels:

    {input_ids [B, S], position_ids [4, B, S], mm_token_type_ids [B, S], pixel_values, ...grids,
     shift_labels [B, S_l]}

``S`` is padded to a multiple of ``P`` (``data.shard.prepare_batch``: pad ids, labels ``-100``,
positions continuing). The per-shard forward (``merge``) embeds and merges this rank's tokens only.

Shape legend: ``B`` batch, ``S`` global (padded) sequence, ``S_l = S/P``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ulysses_sp.data.shard import prepare_batch
from ulysses_sp.parallel.mesh_shape import shard_spans
from ulysses_sp.vlm.families import vlm_parts
from ulysses_sp.vlm.positions import token_types, vlm_position_ids

_GRIDS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")


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

    ``batch`` is what a Qwen-VL processor returns (``input_ids``, ``pixel_values``,
    ``image_grid_thw``, ...), optionally with ``labels`` and packed ``position_ids [B, S]``.
    Pass the same batch on every rank of the SP group.

    Raises:
        ValueError: malformed batch (``data.shard``'s checks) or placeholders that do not match
            the grids (``positions.check_placeholders``).
    """
    full = dict(batch)
    if full.get("mm_token_type_ids") is None:
        full["mm_token_type_ids"] = token_types(_inner_config(model), full["input_ids"])
    prepared = prepare_batch(full, sp_size, pad_token_id=pad_token_id, ring_size=ring_size)
    ids = prepared["input_ids"]
    prepared["position_ids"] = vlm_position_ids(
        model,
        ids,
        mm_token_type_ids=prepared["mm_token_type_ids"],
        position_ids=prepared["position_ids"],
        **{k: prepared[k] for k in _GRIDS if prepared.get(k) is not None},
    )
    spans = shard_spans(ids.shape[1], sp_rank, sp_size, ring_size)
    labels = prepared["shift_labels"]
    prepared["shift_labels"] = torch.cat([labels[:, a:e] for a, e in spans], dim=1)  # [B, S] -> [B, S_l]
    return prepared


def _inner_config(model: Any) -> Any:
    parts = vlm_parts(model)
    if parts is None:
        raise ValueError(f"{type(model).__name__} is not a VLM ulysses_sp.vlm supports (see SUPPORTED_VLMS)")
    return parts.inner.config
