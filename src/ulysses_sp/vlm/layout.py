"""A VLM batch's layout as host values: what the per-shard merge and the vision tower need, sync-free.

The per-shard forward (``merge``) needs, besides the device tensors, the sample's structure: which
merged visual rows this rank's placeholder tokens take, which frames its tower encodes and where the
rows go (``split.plan_frames``), the text positions' document layout for the SP attention
(``parallel.doc_layout``), and — inside Qwen2.5-VL's tower — the frames' rotary positions, attention
boundaries (``cu_seqlens``) and window order, which transformers computes from ``grid_thw`` with host
reads (``.tolist()``, ``.item()``: device syncs on a GPU, and values a fake tensor does not have).
All of it follows from the token ids and the grids, which the data adapter holds on the host before
the batch goes to the device. So the adapter computes a ``VLMLayout`` once per batch and rank
(``vlm_layout``: ``adapter.vlm_round``, ``train --rehearse``) and attaches it to the ``input_ids``
tensor the model gets (``VLMLayout.attach``); the merge reads it back (``layout_of``) and takes every
value from it: no host read of a device tensor between the embedding and the loss. Without one (a
model called directly) the merge computes the same from the device tensors (``merge``'s fallback).

The tower's metadata stays on the host (``cu_seqlens`` as CPU tensors: its sdpa path splits the
frames with ``lengths.tolist()``, now a host read of a host value) except what it indexes device
tensors with (rotary positions, window order: uploaded); with flash attention in the tower the
boundaries go to the device too (the kernel reads them there) and their maxima are given as ints.
The pixels stay on the host too (``host_keys``): each rank's tower uploads the rows of its own frames.
Qwen3-VL's tower takes no precomputed metadata for its position interpolation: it reads its grid
(``tower`` is ``None``).

Shape legend: ``B`` batch, ``S`` global (padded) sequence, ``N_l`` this rank's merged rows,
``N_p`` patches its tower encodes, ``F`` frames.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ulysses_sp.parallel.doc_layout import HostLayout, attach_layout, host_layout
from ulysses_sp.parallel.mesh_shape import shard_spans
from ulysses_sp.vlm.split import FramePlan, plan_frames

_ATTR = "_ulysses_sp_vlm_layout"
"""The attribute of an ``input_ids`` tensor holding ``(VLMLayout, tensor version)``."""
_KINDS = (("pixel_values", "image_grid_thw", "image_token_id"), ("pixel_values_videos", "video_grid_thw", "video_token_id"))


@dataclass(frozen=True)
class VLMLayout:
    """One rank's view of one VLM batch, as host values (module docstring)."""

    text: HostLayout
    """The full sequence's text positions (row 0 of ``position_ids [4, B, S]``): the SP attention's layout."""
    counts: tuple[int, ...]
    """Per modality present (images, then videos): this rank's merged rows ``N_l``."""
    plans: dict[bool, FramePlan]
    """``split`` (the tower's frames split over the SP group) -> this rank's frame plan."""
    tower: dict[bool, dict[str, Any]] | None
    """``split`` -> Qwen2.5-VL's tower metadata for the plan's frames (``tower_inputs``); ``None``: the tower reads its grid."""
    host_keys: tuple[str, ...] = ("pixel_values", "pixel_values_videos")
    """Batch entries the adapter leaves on the host: the whole batch's pixels, of which this rank's tower
    uploads only the rows it encodes (``split.encode``), not ``P`` times what one rank needs."""

    def attach(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Attach to ``batch["input_ids"]`` (the tensor the model gets); valid while it is unedited."""
        ids = batch["input_ids"]
        setattr(ids, _ATTR, (self, ids._version))
        return batch

    def attach_text(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Attach the text layout to this rank's ``[B, S_l]`` text positions (the attention finds it)."""
        return attach_layout(position_ids, self.text)


def shard_index(seq_len: int, sp_rank: int, sp_size: int, ring_size: int, device: Any) -> torch.Tensor:
    """``[S_l]`` ascending global indices of the tokens SP rank ``sp_rank`` holds."""
    spans = shard_spans(seq_len, sp_rank, sp_size, ring_size)
    return torch.cat([torch.arange(a, e, device=device) for a, e in spans])


def rows_by_rank(mask: torch.Tensor, indices: list[torch.Tensor]) -> list[torch.Tensor]:
    """For each rank, ``[N_k]`` the merged rows its tokens take (``mask [B, S]``: the placeholders)."""
    b, s = mask.shape
    row = mask.flatten().long().cumsum(0).view(b, s) - 1  # [B, S]: row of each placeholder among all
    return [row.index_select(1, i)[mask.index_select(1, i)] for i in indices]  # [B, S] -> [N_k]


def layout_of(input_ids: Any) -> VLMLayout | None:
    """The ``VLMLayout`` attached to ``input_ids``, or ``None`` (none, or the tensor edited since)."""
    found = getattr(input_ids, _ATTR, None)
    return found[0] if found is not None and found[1] == input_ids._version else None


def tower_inputs(vision_config: Any, grid: torch.Tensor) -> dict[str, Any]:
    """Qwen2.5-VL's tower metadata for the frames of ``grid [F, 3]`` (host), as its forward takes them
    precomputed (``transformers.vision_utils``): ``position_ids [N_p, 2]``, ``cu_seqlens``,
    ``window_index [N_p / merge]``, ``cu_window_seqlens`` and the maxima of both boundaries."""
    from transformers.vision_utils import (
        get_vision_cu_seqlens,
        get_vision_position_ids,
        get_vision_window_index,
    )

    v = vision_config
    cu = get_vision_cu_seqlens(grid)
    window, cu_window = get_vision_window_index(grid, spatial_merge_size=v.spatial_merge_size,
                                                window_size=v.window_size, patch_size=v.patch_size)  # fmt: skip
    return {"position_ids": get_vision_position_ids(grid, v.spatial_merge_size), "cu_seqlens": cu,
            "max_seqlen": int(cu.diff().max()), "window_index": window, "cu_window_seqlens": cu_window,
            "max_window_seqlen": int(cu_window.diff().max())}  # fmt: skip


def vlm_layout(config: Any, prepared: dict[str, Any], *, sp_rank: int, sp_size: int, ring_size: int = 1) -> VLMLayout:
    """The ``VLMLayout`` of SP rank ``sp_rank`` for ``prepared`` (``batch.prepare_vlm_batch``'s output,
    host tensors: ``input_ids [B, S]``, ``position_ids [4, B, S]``, the grids); ``config`` the VLM's."""
    ids, merge = prepared["input_ids"], int(config.vision_config.spatial_merge_size) ** 2
    indices = [shard_index(ids.shape[1], k, sp_size, ring_size, "cpu") for k in range(sp_size)]
    kinds = [(prepared[g].cpu(), getattr(config, t)) for p, g, t in _KINDS if prepared.get(p) is not None]
    per_kind = [rows_by_rank(ids == token, indices) for _, token in kinds]  # [kind][rank] -> [N_k]
    plans: dict[bool, FramePlan] = {}
    if kinds:
        first = [0, len(torch.cat(per_kind[0]))]  # video rows follow the image rows
        needed = [torch.cat([rows[k] + first[j] for j, rows in enumerate(per_kind)]) for k in range(sp_size)]
        grid = torch.cat([g for g, _ in kinds])
        plans = {split: plan_frames(grid, needed, sp_rank=sp_rank, merge=merge, split=split)
                 for split in ((False, True) if sp_size > 1 else (False,))}  # fmt: skip
    tower = None
    if config.model_type == "qwen2_5_vl":
        tower = {split: tower_inputs(config.vision_config, plan.grid) for split, plan in plans.items()}
    return VLMLayout(text=host_layout(prepared["position_ids"][0]), counts=tuple(len(r[sp_rank]) for r in per_kind),
                     plans=plans, tower=tower)  # fmt: skip
