"""``ulysses-sp train`` on a local Qwen2.5-VL / Qwen3-VL directory: what differs from a text run.

The model path is ``ulysses_sp.vlm`` (``initialize()`` installs the per-shard merge at ``sp > 1``,
the vision tower's frames split over the SP group); this module is the CLI's side of it:

- ``is_vlm_config``: whether a model's transformers config is an admitted VLM (``SUPPORTED_VLMS``);
- ``check_vlm_options``: the options a VLM run does not take, refused by flag with the reason,
  before anything is loaded;
- ``vlm_dataset``: ``--data`` chat JSONL with local image and video paths, read once in the launcher with
  the directory's tokenizer and processors (``vlm.data.load_vlm_chat``: image and video tokens count toward
  ``--seq-len``, ``--loss-on`` masks as for text chats (default ``all``), every bad sample is a
  ``ValueError`` naming it; ``--split-images on`` at ``--micro-batch-size 1``: a sample whose frames
  cannot be split over the SP group too);
- ``packs_vlm``/``vlm_shard``: ``--packing best-fit`` (``vlm.batch.pack_vlm_samples``: whole samples in rows
  of ``--seq-len``, documents apart, at sp 1 through the SP path too) and ``--split-images off``;
- ``collate_vlm``: a micro-batch of such samples (or rows) as one processor-style batch (right-padded);
- ``patches_per_rank``: the most patches one rank's vision tower encodes in a micro-step (the fit check's
  tower term, ``plan.vision``).

Shape legend: ``B`` micro-batch, ``S`` the batch's longest sample, ``N_p`` patches of the batch's images.
"""

from __future__ import annotations

from typing import Any

import torch

from ulysses_sp.run.config import RunConfig
from ulysses_sp.vlm import SUPPORTED_VLMS
from ulysses_sp.vlm.batch import SAMPLE_MEDIA

_UNTESTED = "has not been tested against the same model without SP for vision-language models"
_REFUSED_FLAGS: dict[str, str] = {
    "tiled_mlp": f"--tiled-mlp {_UNTESTED}",
    "tiled_loss": "--tiled-loss computes the loss from the text model's hidden states; a VLM's forward "
    "goes through its vision merge first",
    "offload_activations": f"--offload-activations {_UNTESTED}",
    "recompute_norms": f"--recompute-norms {_UNTESTED}",
    "offload_attention": f"--offload-attention {_UNTESTED}",
    "attn_chunk": f"--attn-chunk {_UNTESTED}",
    "tokenizer": "--tokenizer: a VLM run uses the model directory's own tokenizer and image processor",
}


def is_vlm_config(config: Any) -> bool:
    """``config`` (a transformers config) is one of ``vlm.SUPPORTED_VLMS``."""
    return getattr(config, "model_type", None) in SUPPORTED_VLMS


def check_vlm_options(cfg: RunConfig) -> None:
    """Refuse (``ValueError``, naming the flag) what a VLM run does not take."""
    where = f"--model {cfg.model!r} is a vision-language model"
    for name, why in _REFUSED_FLAGS.items():
        if getattr(cfg, name) not in (None, False):
            raise ValueError(f"{where}: {why}; drop the flag")
    if cfg.data == "recall":
        raise ValueError(f"{where}: --data recall is a text task; pass chat JSONL with image or video paths (README, "
                         "Vision-language models)")  # fmt: skip
    settings = {
        "data_format": (cfg.data_format, ("auto", "chat"), "the data is chat JSONL with image parts"),
        "chat_template": (cfg.chat_template, (None,), "the model directory's chat template renders the images"),
        "eval_split": (cfg.eval_split, (0, 0.0), "no held-out split is made from VLM data"),
    }  # fmt: skip
    for name, (value, allowed, why) in settings.items():
        if value not in allowed:
            flag = "--" + name.replace("_", "-")
            raise ValueError(
                f"{where}: {flag} {value!r} is not supported ({why}); use {allowed[-1]!r} or drop it"
            )
    if cfg.split_images == "on" and cfg.sp == 1:
        raise ValueError(f"{where}: --split-images on splits the vision tower's frames over the SP group, and "
                         "--sp 1 has none (one rank encodes every frame); drop the flag or raise --sp")  # fmt: skip
    if cfg.long_samples != "truncate":
        raise ValueError(f"{where}: --long-samples {cfg.long_samples!r} is not supported: a sample longer than "
                         "--seq-len is refused by name (its images cannot be cut); drop the flag")  # fmt: skip


def packs_vlm(cfg: RunConfig) -> bool:
    """``--packing best-fit`` for a VLM run: whole samples packed into rows (``None``/``none``: one a row)."""
    return cfg.packing == "best-fit"


def vlm_shard(cfg: RunConfig, model: Any, mesh: Any) -> list[Any]:
    """The per-shard merge installed before ``initialize()`` (which keeps it), its handle in a list:
    ``--split-images off`` at ``sp > 1`` (no group to split the tower's frames over:
    ``vlm.shard_vlm(split_images_over=None)``), and packed rows at ``sp 1`` (transformers' own VLM forward
    does not keep packed documents apart; the SP path on one rank does, with the SP attention
    ``model_checks.sp_attention_wanted`` registers). Else ``[]``: ``initialize()`` installs it with the SP group."""
    from ulysses_sp.vlm import shard_vlm, vlm_parts

    wanted = (cfg.split_images == "off" and cfg.sp > 1) or (cfg.sp == 1 and packs_vlm(cfg))
    if not wanted or vlm_parts(model) is None:
        return []
    return [shard_vlm(model, sp_rank=mesh.sp_rank, sp_size=mesh.sp_size, ring_size=mesh.ring_size)]


def vlm_dataset(cfg: RunConfig, config: Any) -> list[dict[str, torch.Tensor]]:
    """``cfg.data`` read with ``cfg.model``'s tokenizer and processors (module docstring)."""
    from ulysses_sp.vlm.data import load_vlm_chat
    from ulysses_sp.vlm.families import QWEN_VLMS

    family = getattr(config, "model_type", None)
    if family not in QWEN_VLMS:  # the chat reader makes Qwen's patch rows and grids, not this family's pixels
        raise ValueError(
            f"--model {cfg.model!r} is a {family} vision-language model: the CLI's chat data path reads images "
            f"with Qwen's image processor only ({', '.join(sorted(QWEN_VLMS))}); train a {family} model from "
            "Python (its own processor, vlm.prepare_vlm_batch, then initialize() or prepare(trainer)) as "
            "docs/readme/vlm.md shows"
        )
    samples = load_vlm_chat(cfg.data, cfg.model, config=config, seq_len=cfg.seq_len, loss_on=cfg.loss_on)
    if packs_vlm(cfg):  # whole samples into rows of --seq-len, documents apart (vlm.batch.pack_vlm_samples)
        from ulysses_sp.vlm.batch import pack_vlm_samples

        samples = pack_vlm_samples(samples, cfg.seq_len)
    if cfg.split_images == "on" and cfg.micro_batch_size == 1:  # a micro-batch is one sample: check them all now
        from ulysses_sp.vlm.split import check_split

        for i, sample in enumerate(samples):
            check_split(sample, cfg.sp, where=f"--data {cfg.data!r}, {'row' if packs_vlm(cfg) else 'sample'} {i},")
    return samples  # at --micro-batch-size > 1 the data round checks each micro-batch (VLMDataLoaderAdapter)


def patches_per_rank(samples: list[dict[str, torch.Tensor]], cfg: RunConfig) -> int:
    """The most patches one rank's vision tower encodes in a micro-step over ``samples`` (rows as the
    run feeds them), each modality's frames placed as ``vlm.split`` places them over the SP group
    (contiguous runs balanced by patch count: the busiest rank's share), or all of them where a rank
    may encode every frame (``--split-images off``, or too few frames to split: an upper bound of what
    the frames its shard touches hold). The largest over every sample alone (exact at
    ``--micro-batch-size 1``) and over the ``--micro-batch-size`` samples with the most patches
    together (at larger micro-batches an estimate: the sampler forms the batches)."""
    biggest = sorted(samples, key=lambda s: sum(int(_patches(s, k).sum()) for k in _GRIDS))[-cfg.micro_batch_size:]
    return max([_busiest(biggest, cfg)] + [_busiest([s], cfg) for s in samples])


_GRIDS = ("image_grid_thw", "video_grid_thw")


def _patches(sample: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    from ulysses_sp.vlm.split import frames

    grid = sample.get(key)
    return frames(grid.cpu(), 1)[1] if grid is not None else torch.zeros(0, dtype=torch.long)


def _busiest(batch: list[dict[str, torch.Tensor]], cfg: RunConfig) -> int:
    """The patches the busiest rank encodes for this micro-batch (summed over the modalities: each is
    encoded by its own tower call, and what the first keeps is alive during the second)."""
    from ulysses_sp.vlm.split import frame_owners

    total = 0
    for key in _GRIDS:
        patches = torch.cat([_patches(s, key) for s in batch]) if batch else torch.zeros(0, dtype=torch.long)
        split = cfg.sp > 1 and cfg.split_images != "off" and len(patches) >= cfg.sp
        owners = frame_owners(patches, cfg.sp) if split else None
        total += int(patches.sum()) if owners is None else int(torch.bincount(owners, patches, cfg.sp).max())
    return total


def collate_vlm(samples: list[dict[str, torch.Tensor]], *, pad_id: int) -> dict[str, torch.Tensor]:
    """``[1, S_i]`` samples -> ``input_ids``/``labels``/``mm_token_type_ids [B, S]`` right-padded
    (pad id, ``-100``, ``0``: causal attention keeps pads out of the real tokens), ``attention_mask [B, S]``
    (``False`` on the padding: the adapter counts the real tokens from it, then drops it) and the images'
    ``pixel_values [N_p, C*T*p*p]`` / ``image_grid_thw`` and the videos' ``pixel_values_videos`` /
    ``video_grid_thw`` / ``second_per_grid_ts`` concatenated in sample order; packed rows'
    ``position_ids [B, S]`` (restarting at each document) padded with positions continuing."""
    width = max(s["input_ids"].shape[1] for s in samples)
    fills = {"input_ids": pad_id, "labels": -100, "mm_token_type_ids": 0}
    out = {
        key: torch.cat(
            [torch.nn.functional.pad(s[key], (0, width - s[key].shape[1]), value=fill) for s in samples]
        )
        for key, fill in fills.items()
    }
    lengths = torch.tensor([s["input_ids"].shape[1] for s in samples])
    out["attention_mask"] = torch.arange(width)[None] < lengths[:, None]  # [B, S] bool: False on the padding
    if any("position_ids" in s for s in samples):  # packed rows: documents restart at 0; padding continues
        pos = [s.get("position_ids", torch.arange(n)[None]) for s, n in zip(samples, lengths.tolist())]
        out["position_ids"] = torch.cat([torch.cat([p, p[:, -1:] + torch.arange(1, width - p.shape[1] + 1)], dim=1)
                                         for p in pos])  # fmt: skip
    for key in SAMPLE_MEDIA:
        parts = [s[key] for s in samples if key in s]
        if parts:
            out[key] = torch.cat(parts)
    return out
