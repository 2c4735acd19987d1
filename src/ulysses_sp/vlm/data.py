"""Chat samples with local images and videos for a VLM: the model directory's tokenizer and processors.

A record is one chat (``{"messages": [{"role": ..., "content": [{"type": "image", "image":
"cat.png"}, {"type": "video", "video": "clip.mp4"}, {"type": "text", "text": "..."}]}, ...]}``),
media paths relative to the JSONL file (``vlm.media`` walks and checks the parts). The chat template
renders one ``<|image_pad|>`` per image and one ``<|video_pad|>`` per video; each is expanded as the
model's processor does: an image to its merged patch count (``grid_t * grid_h * grid_w /
merge**2``), a video to its tokens (``vlm.video.video_tokens``: Qwen3-VL's per-frame timestamps
included) — image and video tokens count toward the sequence length like text tokens. The loss is
on every text token by default; ``loss_on="assistant"``/``"completion"`` masks the rest the way text
chats are masked (``data.chat.turn_segments``: the chat cut at its template's turn boundaries, each
segment tokenized alone); image and video tokens, and the tokens a video's expansion inserts, are
always ``-100``.

Why not the model's ``AutoProcessor``: in transformers 5.24 the Qwen-VL processors and their video
processors need ``torchvision`` (whose wheels do not load on the CPU build of torch this project
pins); the image side is served without it by ``Qwen2VLImageProcessorPil`` (PIL + numpy), loaded
from the directory's ``preprocessor_config.json``, and the video side by ``vlm.video`` (transformers'
own ``load_video`` with PyAV, its ``smart_resize``, the video processor's settings).

Every bad input is a ``ValueError`` naming the file, line and sample, raised while building the
samples (before training): a media part with no path (or a URL, or a directory), a missing file, an
image PIL cannot read (unsupported format) or refuses as a decompression bomb (PIL's
``MAX_IMAGE_PIXELS`` guard, left as the user set it), a video PyAV cannot decode (or too short for
the processor's sampling), a part type not read here, a model directory without a tokenizer chat
template or image processor, a sample whose placeholders do not match its media, a sample longer
than ``seq_len``.

Shape legend: ``S`` sample length, ``N_p`` patches of the sample's images.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from ulysses_sp.vlm.media import media_file, media_parts, read_image
from ulysses_sp.vlm.positions import IMAGE, VIDEO, check_placeholders
from ulysses_sp.vlm.video import VIDEO_FAMILIES, VideoSettings, read_video, video_settings, video_tokens

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


def _media(record: dict[str, Any], where: str, base_dir: str, image_processor: Any,
           video: VideoSettings | None) -> list[tuple[str, Any]]:  # fmt: skip
    """``(kind, PIL image | Video)`` of the record's media parts in order; every bad part a ``ValueError``."""
    out = []
    for kind, at, part in media_parts(record, where):
        rel, path = media_file(kind, part, at, where, base_dir)
        if kind == "image":
            out.append((kind, read_image(rel, path, where, image_processor)))
        elif video is None:
            raise ValueError(f"{where}: {at} is a video part; video parts are read for {', '.join(VIDEO_FAMILIES)} "
                             "models (load_vlm_chat reads the directory's video processor settings)")  # fmt: skip
        else:
            out.append((kind, read_video(rel, path, where, video)))
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
    loss_on: str = "all",
    video: VideoSettings | None = None,
) -> dict[str, torch.Tensor]:
    """One record as model inputs: ``input_ids [1, S]``, ``labels [1, S]`` (placeholders ``-100``;
    ``loss_on`` ``assistant``/``completion``: also every token outside the assistant turns / the
    last one, segmented as text chats are, ``data.chat``), ``mm_token_type_ids [1, S]``, the images'
    ``pixel_values [N_p, C*T*p*p]`` + ``image_grid_thw`` and the videos' ``pixel_values_videos`` +
    ``video_grid_thw`` (+ ``second_per_grid_ts [N_vid]`` for Qwen2.5-VL); ``video``: the directory's
    video processor settings (``vlm.video.video_settings``)."""
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
        raise ValueError(
            f"{where}: expected {{'messages': [...]}} (a chat with image or video parts), got {str(record)[:80]}"
        )
    media = _media(record, where, base_dir, image_processor, video)
    if loss_on == "all":  # the chat rendered and tokenized whole, as the model's processor does
        ids = tokenizer.apply_chat_template(record["messages"], tokenize=True, return_dict=False)
        ids = torch.tensor(ids, dtype=torch.long).flatten()
        scored = torch.ones_like(ids, dtype=torch.bool)
    else:
        ids, scored = _scored_ids(record["messages"], where, tokenizer, loss_on)
    image_pad, video_pad = int(config.image_token_id), int(config.video_token_id)
    batch: dict[str, torch.Tensor] = {}
    fills: dict[int, list[torch.Tensor]] = {image_pad: [], video_pad: []}  # what replaces each placeholder
    images = [m for k, m in media if k == "image"]
    if images:
        vision = image_processor(images=images, return_tensors="pt")
        batch = {"pixel_values": vision["pixel_values"], "image_grid_thw": vision["image_grid_thw"]}
        merge = int(config.vision_config.spatial_merge_size) ** 2
        fills[image_pad] = [torch.full((n,), image_pad) for n in (vision["image_grid_thw"].prod(-1) // merge).tolist()]
    videos = [m for k, m in media if k == "video"]
    if videos:
        batch["pixel_values_videos"] = torch.cat([v.pixels for v in videos])
        batch["video_grid_thw"] = torch.cat([v.grid for v in videos])
        if video.family == "qwen2_5_vl":  # its 3-D mrope spaces the temporal positions by time
            batch["second_per_grid_ts"] = torch.tensor([v.second_per_grid for v in videos])
        fills[video_pad] = [video_tokens(v, video, config, tokenizer) for v in videos]
    ids, scored = _expand(ids, scored, fills, where)
    types = (ids == image_pad).int() * IMAGE + (ids == video_pad).int() * VIDEO
    try:
        check_placeholders(_Inner(config), types[None], batch.get("image_grid_thw"), batch.get("video_grid_thw"))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if ids.numel() > seq_len:
        n_video = int((types == VIDEO).sum())
        of = f"{int((types == IMAGE).sum())} of them image tokens" + (f", {n_video} video tokens" if videos else "")
        lower = " or the video processor's fps / max_pixels (video_preprocessor_config.json)" if videos else ""
        raise ValueError(f"{where}: {ids.numel()} tokens ({of}) exceed seq_len {seq_len}; raise the sequence "
                         f"length or lower the image processor's max_pixels{lower}")  # fmt: skip
    labels = ids.masked_fill(types.bool() | ~scored, -100)
    return {"input_ids": ids[None], "labels": labels[None], "mm_token_type_ids": types[None], **batch}


def _expand(
    ids: torch.Tensor, scored: torch.Tensor, fills: dict[int, list[torch.Tensor]], where: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids [S]`` with each placeholder token replaced by its medium's tokens (``fills[token]``, in
    order), unscored: ``[S] -> [S + sum(len(fill) - 1)]``."""
    for (token, fill), kind in zip(fills.items(), ("image", "video")):
        slots = int((ids == token).sum())
        if slots != len(fill):
            raise ValueError(f"{where}: the rendered chat has {slots} {kind} placeholders for {len(fill)} {kind}s: "
                             f"each {kind} part must render exactly one placeholder (check the chat template)")  # fmt: skip
    queues = {token: iter(fill) for token, fill in fills.items()}
    pieces, flags, start = [], [], 0
    for slot in torch.isin(ids, torch.tensor(list(fills))).nonzero().flatten().tolist():
        fill = next(queues[int(ids[slot])])
        pieces += [ids[start:slot], fill]
        flags += [scored[start:slot], torch.zeros(len(fill), dtype=torch.bool)]
        start = slot + 1
    return torch.cat([*pieces, ids[start:]]), torch.cat([*flags, scored[start:]])


def _scored_ids(
    messages: list[dict[str, Any]], where: str, tokenizer: Any, loss_on: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [S], scored [S] bool)`` of a chat cut at its turns (``data.chat.turn_segments``)."""
    from ulysses_sp.data.chat import ChatTemplateError, chat_template_of, score_segments, turn_segments

    try:
        segments = turn_segments(tokenizer, chat_template_of(tokenizer, None), messages)
    except ChatTemplateError as e:
        raise ValueError(f"{where}: the model directory's chat template {e}") from None
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    ids, scored = score_segments(tokenizer, segments, loss_on)
    return torch.tensor(ids, dtype=torch.long), torch.tensor(scored, dtype=torch.bool)


class _Inner:
    """``check_placeholders`` reads ``inner.config``."""

    def __init__(self, config: Any) -> None:
        self.config = config


def load_vlm_chat(
    path: str, model_dir: str, *, config: Any, seq_len: int, loss_on: str | None = None
) -> list[dict[str, torch.Tensor]]:
    """Every record of the chat JSONL ``path`` as a sample (``vlm_chat_sample``), all checked first.
    ``loss_on``: ``all`` (``None``: every text token), ``assistant`` or ``completion`` (``--loss-on``).

    Raises:
        ValueError: a bad record (named by line), an unknown ``loss_on``, or no token scored at all.
    """
    from ulysses_sp.data.chat import resolve_loss_on

    loss_on = "all" if loss_on is None else resolve_loss_on("chat", loss_on)
    tokenizer, image_processor = load_vlm_processor(model_dir)
    family = getattr(config, "model_type", None)
    video = video_settings(model_dir, family) if family in VIDEO_FAMILIES else None
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
                                       image_processor=image_processor, config=config, seq_len=seq_len,
                                       loss_on=loss_on, video=video))  # fmt: skip
    if not out:
        raise ValueError(f"{path}: no samples")
    if all(bool((s["labels"] == -100).all()) for s in out):
        raise ValueError(f"--data {path!r}: no token is scored, so training would learn nothing (loss 0): "
                         f"--loss-on {loss_on} found no such tokens; check the data's roles, or --loss-on all")  # fmt: skip
    return out
