"""Chat samples with local images for a VLM: the model directory's tokenizer and image processor.

A record is one chat (``{"messages": [{"role": ..., "content": [{"type": "image", "image":
"cat.png"}, {"type": "text", "text": "..."}]}, ...]}``), image paths relative to the JSONL file.
The chat template renders one ``<|image_pad|>`` per image; each is expanded to the image's merged
patch count (``grid_t * grid_h * grid_w / merge**2``), as the model's processor does — image
tokens count toward the sequence length like text tokens.

Why not the model's ``AutoProcessor``: in transformers 5.24 the Qwen-VL processors check their video
processor class, which needs ``torchvision``; the image side is served without it by
``Qwen2VLImageProcessorPil`` (PIL + numpy), which this module loads from the directory's
``preprocessor_config.json``. Videos are not read from files here (the model path takes them).

Every bad input is a ``ValueError`` naming the file and the sample, raised while building the
samples (before training): a missing image file, a file PIL cannot read (unsupported format), a
model directory without a tokenizer chat template or image processor, a sample whose image
placeholders do not match its images, a sample longer than ``seq_len``.

Shape legend: ``S`` sample length, ``N_p`` patches of the sample's images.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from ulysses_sp.vlm.positions import IMAGE, check_placeholders

PREPROCESSOR = "preprocessor_config.json"


def load_vlm_processor(model_dir: str) -> tuple[Any, Any]:
    """``(tokenizer, image_processor)`` of a local VLM directory, no torchvision needed.

    Raises:
        ValueError: the directory lacks a tokenizer, a chat template or ``preprocessor_config.json``.
    """
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if not os.path.isfile(os.path.join(model_dir, PREPROCESSOR)):
        raise ValueError(
            f"{model_dir!r} has no image processor ({PREPROCESSOR}): a VLM directory needs the processor "
            "files the model was published with (processor.save_pretrained(dir))"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"{model_dir!r}: no tokenizer could be loaded ({e})") from None
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{model_dir!r}: the tokenizer has no chat_template to render chat samples with images"
        )
    return tokenizer, Qwen2VLImageProcessorPil.from_pretrained(model_dir, local_files_only=True)


MEDIA_PARTS = ("image", "video")
"""Content part types that name a file (the resume fingerprint covers them; images are loaded here)."""


def _part_path(part: dict[str, Any], base_dir: str) -> str:
    rel = part.get(part.get("type")) or part.get("path") or part.get("url")
    return rel if os.path.isabs(str(rel)) else os.path.join(base_dir, str(rel))


def named_files(path: str) -> list[str]:
    """Every image or video file the chat JSONL ``path`` names (resolved against its directory, as
    ``load_vlm_chat`` reads them), each once, in order of first mention. Lines that do not parse
    are skipped (``load_vlm_chat`` names them)."""
    base = os.path.dirname(os.path.abspath(path))
    seen: dict[str, None] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line) if line.strip() else {}
            except json.JSONDecodeError:
                continue
            for message in record.get("messages", []) if isinstance(record, dict) else []:
                content = message.get("content") if isinstance(message, dict) else None
                for part in content if isinstance(content, list) else []:
                    if isinstance(part, dict) and part.get("type") in MEDIA_PARTS:
                        seen.setdefault(_part_path(part, base), None)
    return list(seen)


def _images(record: dict[str, Any], where: str, base_dir: str) -> list[Any]:
    from PIL import Image, UnidentifiedImageError

    out = []
    for message in record.get("messages", []):
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            if part.get("type") != "image":
                continue
            rel = part.get("image") or part.get("path") or part.get("url")
            path = rel if os.path.isabs(str(rel)) else os.path.join(base_dir, str(rel))
            if not os.path.isfile(path):
                raise ValueError(f"{where}: image file {rel!r} not found (looked at {path!r}); paths are relative "
                                 "to the data file")  # fmt: skip
            try:
                with Image.open(path) as img:
                    out.append(img.convert("RGB"))
            except (UnidentifiedImageError, OSError) as e:
                raise ValueError(f"{where}: image {rel!r} is not in a format PIL can read ({e}); use PNG, JPEG, "
                                 "WebP, GIF or BMP") from None  # fmt: skip
    return out


def vlm_chat_sample(
    record: dict[str, Any],
    *,
    where: str,
    base_dir: str,
    tokenizer: Any,
    image_processor: Any,
    config: Any,
    seq_len: int,
) -> dict[str, torch.Tensor]:
    """One record as model inputs: ``input_ids [1, S]``, ``labels [1, S]`` (placeholders ``-100``),
    ``mm_token_type_ids [1, S]``, and ``pixel_values [N_p, C*T*p*p]`` + ``image_grid_thw``."""
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
        raise ValueError(
            f"{where}: expected {{'messages': [...]}} (a chat with image parts), got {str(record)[:80]}"
        )
    images = _images(record, where, base_dir)
    ids = tokenizer.apply_chat_template(record["messages"], tokenize=True, return_dict=False)
    ids = torch.tensor(ids, dtype=torch.long).flatten()
    pad = int(config.image_token_id)
    batch: dict[str, torch.Tensor] = {}
    if images:
        vision = image_processor(images=images, return_tensors="pt")
        batch = {"pixel_values": vision["pixel_values"], "image_grid_thw": vision["image_grid_thw"]}
        merge = int(config.vision_config.spatial_merge_size) ** 2
        counts = (vision["image_grid_thw"].prod(dim=-1) // merge).tolist()
        slots = (ids == pad).nonzero().flatten().tolist()
        if len(slots) != len(counts):
            raise ValueError(f"{where}: the rendered chat has {len(slots)} image placeholders for {len(images)} "
                             "images: each image part must render exactly one placeholder (check the chat template)")  # fmt: skip
        pieces, start = [], 0
        for slot, n in zip(slots, counts):  # [S] -> [S + sum(n - 1)]: one token per merged patch
            pieces += [ids[start:slot], torch.full((n,), pad)]
            start = slot + 1
        ids = torch.cat([*pieces, ids[start:]])
    types = (ids == pad).int() * IMAGE
    try:
        check_placeholders(_Inner(config), types[None], batch.get("image_grid_thw"), None)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if ids.numel() > seq_len:
        raise ValueError(f"{where}: {ids.numel()} tokens ({int((ids == pad).sum())} of them image tokens) exceed "
                         f"seq_len {seq_len}; raise the sequence length or lower the image processor's max_pixels")  # fmt: skip
    labels = ids.masked_fill(types.bool(), -100)
    return {"input_ids": ids[None], "labels": labels[None], "mm_token_type_ids": types[None], **batch}


class _Inner:
    """``check_placeholders`` reads ``inner.config``."""

    def __init__(self, config: Any) -> None:
        self.config = config


def load_vlm_chat(path: str, model_dir: str, *, config: Any, seq_len: int) -> list[dict[str, torch.Tensor]]:
    """Every record of the chat JSONL ``path`` as a sample (``vlm_chat_sample``), all checked first."""
    tokenizer, image_processor = load_vlm_processor(model_dir)
    base = os.path.dirname(os.path.abspath(path))
    out = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no} (sample {len(out)})"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e})") from None
            out.append(vlm_chat_sample(record, where=where, base_dir=base, tokenizer=tokenizer,
                                       image_processor=image_processor, config=config, seq_len=seq_len))  # fmt: skip
    if not out:
        raise ValueError(f"{path}: no samples")
    return out
