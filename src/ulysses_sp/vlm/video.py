"""Video parts of a VLM chat: frames read from a file and made into the model's video inputs.

A ``{"type": "video", "video": "clip.mp4"}`` part is decoded by transformers' own loader
(``transformers.video_utils.load_video``, backend ``pyav``: PyAV, ``pip install 'ulysses-sp[video]'``),
its frames sampled as the model's video processor samples them, from the directory's
``video_preprocessor_config.json`` (else ``preprocessor_config.json``, as transformers falls back),
keys it lacks taken from transformers 5.24's class defaults:

- Qwen2.5-VL (``Qwen2VLVideoProcessor``): every frame unless ``do_sample_frames``; then ``num_frames``
  or ``fps`` frames a second (``min_frames``..``max_frames``), rounded to ``temporal_patch_size``;
- Qwen3-VL (``Qwen3VLVideoProcessor``): ``fps`` (default 2) frames a second, ``min_frames``..``max_frames``,
  spread evenly (``linspace``) over the clip.

Each frame is resized to the processor's ``smart_resize`` size (transformers' own function: the
pixel budget ``size.shortest_edge``..``size.longest_edge``, per frame for Qwen2.5-VL, per clip for
Qwen3-VL; ``cap_pixels_per_frame`` as there), rescaled and normalized, and ``temporal_patch_size``
frames make a temporal patch (the last frame repeated to fill one), flattened as the processor does:
``pixel_values_videos [T*h*w, C*t*p*p]``, ``video_grid_thw [1, 3]``. Resizing uses PIL's bicubic
filter, as the image side (``Qwen2VLImageProcessorPil``) does, where transformers' video processors
use torchvision's (which this CPU install cannot load): same frames, sizes and grids, pixel values
within resampling noise.

The model's positions need the clip's time: Qwen2.5-VL's 3-D mrope reads ``second_per_grid_ts``
(``temporal_patch_size / sampled fps``, as its processor computes it); Qwen3-VL's processor writes
each temporal patch as ``<{t:.1f} seconds><|vision_start|>`` + its tokens + ``<|vision_end|>``, with
``t`` the mean time of the patch's frames (``video_tokens``). Those inserted tokens are not scored.

Shape legend: ``T`` temporal patches, ``h``/``w`` patches per frame side, ``C`` channels,
``t`` ``temporal_patch_size``, ``p`` ``patch_size``.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

VIDEO_PREPROCESSOR = "video_preprocessor_config.json"
_CLIP, _HALF = ([0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]), ([0.5] * 3, [0.5] * 3)
_DEFAULTS: dict[str, dict[str, Any]] = {  # transformers 5.24's video processor class attributes
    "qwen2_5_vl": dict(size={"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}, image_mean=_CLIP[0],
                       image_std=_CLIP[1], patch_size=14, do_sample_frames=False, fps=None, max_video_tokens=128000),
    "qwen3_vl": dict(size={"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}, image_mean=_HALF[0],
                     image_std=_HALF[1], patch_size=16, do_sample_frames=True, fps=2, max_video_tokens=768),
}  # fmt: skip
VIDEO_FAMILIES = tuple(_DEFAULTS)
"""The model types whose video parts are read (their processors' sampling and placeholders)."""
_COMMON = dict(temporal_patch_size=2, merge_size=2, min_frames=4, max_frames=768, num_frames=None,
               rescale_factor=1 / 255, cap_pixels_per_frame=False)  # fmt: skip


@dataclass(frozen=True)
class VideoSettings:
    """What the model's video processor does to a clip (the module docstring)."""

    family: str
    """``qwen2_5_vl`` or ``qwen3_vl``: which processor's sampling, resizing and placeholders."""
    min_pixels: int
    """``size.shortest_edge``: the least pixels a frame (Qwen3-VL: the clip) is scaled to."""
    max_pixels: int
    """``size.longest_edge``: the most pixels a frame (Qwen3-VL: the clip) is scaled to."""
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    rescale_factor: float
    do_sample_frames: bool
    """``False``: every frame of the file."""
    fps: float | None
    """Frames sampled a second (``None``: by ``num_frames``, else every frame)."""
    num_frames: int | None
    min_frames: int
    max_frames: int
    cap_pixels_per_frame: bool
    max_video_tokens: int


def video_settings(model_dir: str, family: str) -> VideoSettings:
    """The video processor settings of the local VLM directory ``model_dir`` (module docstring)."""
    own = os.path.isfile(os.path.join(model_dir, VIDEO_PREPROCESSOR))
    with open(os.path.join(model_dir, VIDEO_PREPROCESSOR if own else "preprocessor_config.json"), encoding="utf-8") as f:
        saved = {k: v for k, v in json.load(f).items() if v is not None or k in ("fps", "num_frames")}
    cfg = {**_COMMON, **_DEFAULTS[family], **saved}
    size = dict(cfg["size"])
    size["shortest_edge"] = cfg.get("min_pixels") or size.get("shortest_edge")
    size["longest_edge"] = cfg.get("max_pixels") or size.get("longest_edge")
    return VideoSettings(
        family=family, min_pixels=int(size["shortest_edge"]), max_pixels=int(size["longest_edge"]),
        patch_size=int(cfg["patch_size"]), temporal_patch_size=int(cfg["temporal_patch_size"]),
        merge_size=int(cfg["merge_size"]), mean=tuple(cfg["image_mean"]), std=tuple(cfg["image_std"]),
        rescale_factor=float(cfg["rescale_factor"]), do_sample_frames=bool(cfg["do_sample_frames"]),
        fps=cfg["fps"], num_frames=cfg["num_frames"], min_frames=int(cfg["min_frames"]),
        max_frames=int(cfg["max_frames"]), cap_pixels_per_frame=bool(cfg["cap_pixels_per_frame"]),
        max_video_tokens=int(cfg["max_video_tokens"]),
    )  # fmt: skip


def _count_frames(path: str) -> int:
    """Frames of the first video stream of ``path``, counted by demuxing (no decoding): for containers
    whose header holds no frame count, which transformers' PyAV reader reads as 0."""
    import av

    with av.open(path) as container:
        return sum(1 for packet in container.demux(video=0) if packet.size)


class _Sampling(Exception):
    """A clip the processor's sampling cannot take (raised inside ``load_video``)."""


def frame_indices(s: VideoSettings, total: int, fps: float | None) -> np.ndarray:
    """``[n]`` the frames of a ``total``-frame clip at ``fps`` the processor samples (module docstring)."""
    if total <= 0:
        raise _Sampling("has no video frames")
    if not s.do_sample_frames:
        return np.arange(total)
    t, num = s.temporal_patch_size, s.num_frames
    if s.family == "qwen3_vl":
        if num is None and s.fps is not None:
            num = min(max(int(total / (fps or 24) * s.fps), s.min_frames), s.max_frames, total)
        num = min(max(total, s.min_frames), s.max_frames) if num is None else num
        return np.linspace(0, total - 1, num).round().astype(int)
    if num is not None:
        num = round(num / t) * t
    elif s.fps is not None:
        most = (min(s.max_frames, total) // t) * t
        num = int(min(max(total / fps * s.fps, s.min_frames), most, total) // t) * t if fps else None
    if num is not None and not 0 < num <= total:
        raise _Sampling(f"has {total} frames, and the video processor samples {num} (num_frames/fps, in "
                        f"multiples of temporal_patch_size {t}); use a longer clip or change the processor's "
                        "fps / num_frames")  # fmt: skip
    return np.arange(total) if num is None else torch.arange(0, total, total / num).int().numpy()


def _target_size(s: VideoSettings, frames: int, height: int, width: int) -> tuple[int, int]:
    """``(height, width)`` in pixels of the resized frames (the processor's ``smart_resize``)."""
    factor, t = s.patch_size * s.merge_size, s.temporal_patch_size
    most = s.max_pixels
    if s.family == "qwen3_vl":
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

        if s.cap_pixels_per_frame:
            per_frame = max(min(s.max_video_tokens * factor**2, most // frames), int(s.min_pixels * 1.05))
            most = per_frame * frames
        return smart_resize(frames, height, width, temporal_factor=t, factor=factor, min_pixels=s.min_pixels,
                            max_pixels=most)  # fmt: skip
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    if s.cap_pixels_per_frame:
        most = max(min(most, int(s.max_video_tokens * factor * factor * 0.9) * t // frames), int(s.min_pixels * 1.05))
    return smart_resize(height, width, factor=factor, min_pixels=s.min_pixels, max_pixels=most)


def video_inputs(s: VideoSettings, frames: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """``frames [F, H, W, 3]`` uint8 RGB -> ``pixel_values_videos [T*h*w, C*t*p*p]``, ``video_grid_thw [1, 3]``."""
    from PIL import Image

    f, height, width = frames.shape[:3]
    rh, rw = _target_size(s, f, height, width)
    resized = np.stack([np.asarray(Image.fromarray(x).resize((rw, rh), Image.Resampling.BICUBIC)) for x in frames])
    x = (resized.astype(np.float32) * s.rescale_factor - np.float32(s.mean)) / np.float32(s.std)  # [F, rh, rw, C]
    x = x.transpose(0, 3, 1, 2)  # [F, rh, rw, C] -> [F, C, rh, rw]
    t, p, m = s.temporal_patch_size, s.patch_size, s.merge_size
    if pad := -f % t:  # the last frame repeated to fill the last temporal patch
        x = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)])
    gt, gh, gw = x.shape[0] // t, rh // p, rw // p
    x = x.reshape(gt, t, 3, gh // m, m, p, gw // m, m, p)  # [T, t, C, h/m, m, p, w/m, m, p]
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # -> [T, h/m, w/m, m, m, C, t, p, p]: merge blocks adjacent
    pixels = torch.from_numpy(np.ascontiguousarray(x).reshape(gt * gh * gw, 3 * t * p * p))
    return pixels, torch.tensor([[gt, gh, gw]])


@dataclass(frozen=True)
class Video:
    """One decoded clip as model inputs (``read_video``)."""

    pixels: torch.Tensor
    """``[T*h*w, C*t*p*p]`` float32."""
    grid: torch.Tensor
    """``[1, 3]`` ``(T, h, w)``."""
    second_per_grid: float
    """Seconds a temporal patch spans (``temporal_patch_size / sampled fps``)."""
    timestamps: list[float]
    """``[T]`` mean time in seconds of each temporal patch's frames (Qwen3-VL's placeholders)."""


def read_video(rel: str, path: str, where: str, s: VideoSettings) -> Video:
    """The video file ``path`` (written ``rel``) decoded and sampled (module docstring); a
    ``ValueError`` naming it when PyAV is missing or cannot decode it, or the sampling cannot take it."""
    if importlib.util.find_spec("av") is None:
        raise ValueError(f"{where}: video {rel!r}: reading video parts needs PyAV, which is not installed; "
                         "pip install 'ulysses-sp[video]' (or pip install av)")  # fmt: skip
    import av
    from transformers.video_utils import load_video

    def sample(metadata: Any, **_: Any) -> np.ndarray:
        if metadata.total_num_frames <= 0:  # no count in the header (WebM, MKV, an image): count the packets
            metadata.total_num_frames = _count_frames(path)
        return frame_indices(s, int(metadata.total_num_frames), metadata.fps)

    try:
        frames, meta = load_video(path, backend="pyav", sample_indices_fn=sample)
    except _Sampling as e:
        raise ValueError(f"{where}: video {rel!r} {e}") from None
    except IndexError:
        raise ValueError(f"{where}: video {rel!r} has no video stream (PyAV opened it but found no video in "
                         "it); name a video file (MP4, WebM, MKV, AVI, MOV)") from None  # fmt: skip
    except (av.FFmpegError, OSError, ValueError, ZeroDivisionError) as e:
        raise ValueError(f"{where}: video {rel!r} could not be decoded by PyAV ({type(e).__name__}: "
                         f"{str(e)[:120]}); is it a video file (MP4, WebM, MKV, AVI, MOV) and whole?") from None  # fmt: skip
    wanted = len(set(int(i) for i in meta.frames_indices))
    if len(frames) < wanted:  # the stream ends before the frame count its header gives
        raise ValueError(f"{where}: video {rel!r} ends early: {len(frames)} of the {wanted} frames sampled from "
                         f"its header's {meta.total_num_frames} decode; re-encode it (e.g. ffmpeg -i in.mp4 out.mp4)")  # fmt: skip
    try:
        pixels, grid = video_inputs(s, frames)
    except ValueError as e:  # smart_resize: too few frames for a temporal patch, or an extreme aspect ratio
        raise ValueError(f"{where}: video {rel!r} ({len(frames)} frames sampled, {frames.shape[2]}x"
                         f"{frames.shape[1]} pixels) cannot be processed: {e}; a clip needs at least "
                         f"temporal_patch_size ({s.temporal_patch_size}) sampled frames and an aspect ratio under "
                         "200") from None  # fmt: skip
    fps, t = float(meta.fps or 24), s.temporal_patch_size
    indices = [int(i) for i in meta.frames_indices]
    indices += indices[-1:] * (-len(indices) % t)  # as the processor: the last frame fills the last patch
    times = [(indices[k] + indices[k + t - 1]) / 2 / fps for k in range(0, len(indices), t)]
    return Video(pixels, grid, t / meta.sampled_fps, times)


def video_tokens(video: Video, s: VideoSettings, config: Any, tokenizer: Any) -> torch.Tensor:
    """``[n]`` the token ids the processor writes in place of the clip's one ``<|video_pad|>``:
    one pad per merged patch, and for Qwen3-VL each temporal patch after its timestamp, between
    ``<|vision_start|>`` and ``<|vision_end|>`` (module docstring)."""
    pad = int(config.video_token_id)
    gt, gh, gw = (int(v) for v in video.grid[0])
    per_frame = gh * gw // s.merge_size**2
    if s.family != "qwen3_vl":
        return torch.full((gt * per_frame,), pad)
    start, end = int(config.vision_start_token_id), int(config.vision_end_token_id)
    ids: list[int] = []
    for t in video.timestamps:
        stamp = tokenizer(f"<{t:.1f} seconds>", add_special_tokens=False)["input_ids"]
        ids += [*stamp, start, *[pad] * per_frame, end]
    return torch.tensor(ids, dtype=torch.long)
