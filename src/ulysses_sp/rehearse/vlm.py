"""``train --rehearse`` of a Qwen-VL run with images: the synthetic image batch and each rank's share of it.

Without ``--data`` a VLM run is rehearsed on a synthetic batch shaped as the run's VLM data makes it
(``run.vlm.collate_vlm`` of ``vlm.data`` samples): each row of ``--seq-len`` tokens holds ``images``
images of ``image_size`` pixels, spread evenly (each of the row's ``images`` equal parts opens with
one: ``<vision_start>``, one placeholder per merged patch, ``<vision_end>``, then text), the images'
``pixel_values [N_p, C*T*p*p]`` (fp32, as the processor returns them) and ``image_grid_thw``. An image
is resized as Qwen's processor does (each side rounded to a multiple of ``patch * merge`` pixels).

``rank_batch`` cuts it for one SP rank exactly as ``VLMDataLoaderAdapter`` does: ``prepare_vlm_batch``
(full-sequence ``[4, B, S]`` positions, this rank's ``shift_labels``) and the host layout
(``vlm.layout.vlm_layout``: the frame plan, the placeholder rows, the tower's ``cu_seqlens`` and window
order), so the rehearsed step is ``train``'s per-shard forward reading no device value. The pixels are
an expanded single value (no host memory at the mission's sizes); the upload to the device makes the
full ``[N_p, C*T*p*p]`` tensor every rank of the group receives, as the adapter's does.

``busiest_rank``: the SP rank whose tower encodes the most patches (``run.vlm.patches_per_rank``'s
placement), the rank a VLM rehearsal adds to the ones it reports.

Shape legend: ``B`` micro-batch, ``S`` sequence, ``N_p`` patches of the batch's images.
"""

from __future__ import annotations

from typing import Any

import torch

from ulysses_sp.run.config import RunConfig

DEFAULT_IMAGE_SIZE = (1344, 1344)
"""Pixels (height, width) of a synthetic image: a high-resolution document page or photo."""
TOKENS_PER_IMAGE = 8192
"""Default load: one image per this many tokens of ``--seq-len``."""


def image_grid(config: Any, size: tuple[int, int]) -> tuple[int, int]:
    """``(h, w)`` patches of an image of ``size`` pixels, each side rounded to a multiple of
    ``patch * merge`` pixels (at least one merged patch), as Qwen's image processor resizes it."""
    v = config.vision_config
    unit = v.patch_size * v.spatial_merge_size
    return tuple(max(unit, round(x / unit) * unit) // v.patch_size for x in size)  # type: ignore[return-value]


def synthetic_vlm_batch(cfg: RunConfig, config: Any, *, images: int | None = None,
                        image_size: tuple[int, int] | None = None, seed: int = 0) -> dict[str, torch.Tensor]:  # fmt: skip
    """The full ``[B, S]`` batch of the module docstring; ``images``: per row (default one per
    ``TOKENS_PER_IMAGE`` tokens, at least one); ``image_size``: pixels (default ``DEFAULT_IMAGE_SIZE``).
    Raises ``ValueError`` when the images' placeholders do not fit in ``--seq-len``."""
    b, s = cfg.micro_batch_size, cfg.seq_len
    images = max(1, s // TOKENS_PER_IMAGE) if images is None else images
    h, w = image_grid(config, image_size or DEFAULT_IMAGE_SIZE)
    v = config.vision_config
    per_image = h * w // v.spatial_merge_size**2
    part = s // max(images, 1)
    if images < 0 or (images and per_image + 2 > part):
        raise ValueError(
            f"{images} image(s) of {h * v.patch_size}x{w * v.patch_size} pixels take {per_image} placeholder tokens "
            f"each (+2 for its start and end), more than the {part} tokens of --seq-len {s} each may use; raise "
            "--seq-len, lower --images or --image-size"
        )
    specials = [config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, min(specials), (b, s), generator=g)
    for i in range(images):
        a = i * part
        ids[:, a] = config.vision_start_token_id
        ids[:, a + 1 : a + 1 + per_image] = config.image_token_id
        ids[:, a + 1 + per_image] = config.vision_end_token_id
    patches, dim = b * images * h * w, v.in_channels * v.temporal_patch_size * v.patch_size**2
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(s).repeat(b, 1),
             "image_grid_thw": torch.tensor([[1, h, w]] * (b * images))}  # fmt: skip
    if images:
        batch["pixel_values"] = torch.zeros(1).expand(patches, dim)  # [N_p, C*T*p*p]: no memory, shape only
    else:
        del batch["image_grid_thw"]
    return batch


def meta_model(config: Any, attn: str) -> Any:
    """The VLM on the meta device (no memory): what ``prepare_vlm_batch`` needs of it (its rope index)."""
    from ulysses_sp.state.loading import empty_model_from_config

    return empty_model_from_config(config, attn_implementation=attn)


def rank_batch(cfg: RunConfig, model: Any, batch: dict[str, torch.Tensor], sp_rank: int) -> dict[str, Any]:
    """SP rank ``sp_rank``'s inputs for ``batch``, as ``VLMDataLoaderAdapter`` yields them (module docstring),
    with the host layout under ``"_layout"`` (the rehearsal attaches it to the uploaded ``input_ids``)."""
    from ulysses_sp.vlm.batch import prepare_vlm_batch
    from ulysses_sp.vlm.layout import vlm_layout

    out = prepare_vlm_batch(model, batch, sp_rank=sp_rank, sp_size=cfg.sp, ring_size=_ring(cfg, model.config))
    out["_layout"] = vlm_layout(model.config, out, sp_rank=sp_rank, sp_size=cfg.sp, ring_size=_ring(cfg, model.config))
    return out


def _ring(cfg: RunConfig, config: Any) -> int:
    from ulysses_sp.parallel.mesh_shape import head_counts, resolve_ring_size_for_layers

    return resolve_ring_size_for_layers(cfg.sp, head_counts(config), cfg.ring_size) if cfg.sp > 1 else 1


def busiest_rank(cfg: RunConfig, batch: dict[str, torch.Tensor]) -> int:
    """The SP rank whose tower encodes the most patches of ``batch`` (frames split over the group as
    ``vlm.split`` places them; unsplit: rank 0, whose shard opens with the first image)."""
    from ulysses_sp.vlm.split import frame_owners, frames

    grid = batch.get("image_grid_thw")
    if grid is None or cfg.sp == 1:
        return 0
    patches = frames(grid, 1)[1]
    owners = frame_owners(patches, cfg.sp) if cfg.split_images != "off" else None
    return 0 if owners is None else int(torch.bincount(owners, patches, cfg.sp).argmax())  # rank 0: the first image


def vision_patches(cfg: RunConfig, batch: dict[str, torch.Tensor]) -> int:
    """The most patches one rank's tower encodes for ``batch`` (``run.vlm.patches_per_rank``)."""
    from ulysses_sp.run.vlm import patches_per_rank

    return patches_per_rank([batch], cfg)


def describe(cfg: RunConfig, config: Any, batch: dict[str, torch.Tensor]) -> str:
    """The report's line on the image load: images, their size, and the rank whose tower is busiest."""
    grid = batch.get("image_grid_thw")
    if grid is None:
        return "images: none (the vision tower is not run)"
    t, h, w = grid[0].tolist()
    p, merge = config.vision_config.patch_size, config.vision_config.spatial_merge_size**2
    split = "split over the SP group" if cfg.sp > 1 and cfg.split_images != "off" else "encoded where their tokens are"
    return (f"images: {len(grid) // cfg.micro_batch_size} per sample of {h * p}x{w * p} pixels ({h * w:,} patches, "
            f"{h * w // merge:,} tokens each), {split}; the busiest tower is rank {busiest_rank(cfg, batch)}'s, "
            f"{vision_patches(cfg, batch):,} patches (the planner's vision term)")  # fmt: skip
