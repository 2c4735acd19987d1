"""Chat samples with local images for a VLM: the model directory's tokenizer and image processor.

A record is one chat (``{"messages": [{"role": ..., "content": [{"type": "image", "image":
"cat.png"}, {"type": "text", "text": "..."}]}, ...]}``), image paths relative to the JSONL file.
The chat template renders one ``<|image_pad|>`` per image; each is expanded to the image's merged
patch count (``grid_t * grid_h * grid_w / merge**2``), as the model's processor does — image
tokens count toward the sequence length like text tokens. The loss is on every text token by
default; ``loss_on="assistant"``/``"completion"`` masks the rest the way text chats are masked
(``data.chat.turn_segments``: the chat cut at its template's turn boundaries, each segment
tokenized alone), image tokens always ``-100``.

Why not the model's ``AutoProcessor``: in transformers 5.24 the Qwen-VL processors check their video
processor class, which needs ``torchvision``; the image side is served without it by
``Qwen2VLImageProcessorPil`` (PIL + numpy), which this module loads from the directory's
``preprocessor_config.json``. Videos are not read from files here (the model path takes them): a
video part is refused by name rather than rendered as text.

Every bad input is a ``ValueError`` naming the file, line and sample, raised while building the
samples (before training): an image part with no path (or a URL, or a directory), a missing image
file, a file PIL cannot read (unsupported format) or refuses as a decompression bomb (PIL's
``MAX_IMAGE_PIXELS`` guard, left as the user set it), a video part or a part type not read here,
a model directory without a tokenizer chat template or image processor, a sample whose image
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
"""Content part types that name a file (the resume fingerprint covers them; images are loaded here,
video parts are refused by name)."""
PATH_KEYS = ("path", "url")
"""Keys that may hold a media part's file besides the part's type (``{"type": "image", "image": ...}``)."""
_URL = ("http://", "https://", "data:")


def _reference(part: dict[str, Any]) -> Any:
    """What a media part names: its ``part[type]``, else ``path``, else ``url`` (``None``: nothing)."""
    return part.get(part.get("type")) or next((part[k] for k in PATH_KEYS if part.get(k)), None)


def _resolve(rel: str, base_dir: str) -> str:
    return rel if os.path.isabs(rel) else os.path.join(base_dir, rel)


def named_files(path: str) -> list[str]:
    """Every image or video file the chat JSONL ``path`` names (resolved against its directory, as
    ``load_vlm_chat`` reads them), each once, in order of first mention. Lines that do not parse and
    parts that name no local file (no path, a URL) are skipped (``load_vlm_chat`` refuses them)."""
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
                        rel = _reference(part)
                        if isinstance(rel, str) and not rel.startswith(_URL):
                            seen.setdefault(_resolve(rel, base), None)
    return list(seen)


def _image_parts(record: dict[str, Any], where: str) -> list[tuple[str, dict[str, Any]]]:
    """``(where in the record, part)`` of each image part, in order; malformed messages and parts,
    video parts and part types this loader does not read are refused (``ValueError``)."""
    out = []
    for m, message in enumerate(record["messages"]):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"{where}: message {m} is {str(message)[:40]!r}, not an object with a string 'role' "
                             "and a 'content'")  # fmt: skip
        content = message.get("content")
        for k, part in enumerate(content if isinstance(content, list) else []):
            at = f"message {m}, content part {k}"
            kind = part.get("type") if isinstance(part, dict) else None
            if not isinstance(part, dict) or (kind is not None and not isinstance(kind, str)):
                raise ValueError(f"{where}: {at} is {str(part)[:40]!r}, not a part such as {{'type': 'text', "
                                 "'text': ...} or {'type': 'image', 'image': 'cat.png'}")  # fmt: skip
            if kind == "video" or "video" in part:
                raise ValueError(f"{where}: {at} is a video part; video parts are not supported yet (the chat "
                                 "loader reads image files only); drop the part, or build the samples with the "
                                 "model's processor and train through ulysses_sp.vlm from Python")  # fmt: skip
            if kind is None and "image" in part:
                raise ValueError(f"{where}: {at} has an 'image' but no 'type'; write it as {{'type': 'image', "
                                 "'image': 'cat.png'}")  # fmt: skip
            if kind not in (None, "text", "image"):
                raise ValueError(f"{where}: {at} has type {kind!r}, which this loader does not read (it reads "
                                 "'text' and 'image' parts); write an image as {'type': 'image', 'image': "
                                 "'cat.png'}")  # fmt: skip
            if kind == "image":
                out.append((at, part))
    return out


def _image_file(part: dict[str, Any], at: str, where: str, base_dir: str) -> tuple[str, str]:
    """``(as written, resolved path)`` of an image part's local file; ``ValueError`` naming what is wrong."""
    rel = _reference(part)
    if rel is None:
        raise ValueError(f"{where}: the image part ({at}) has no path; name the file under 'image', 'path' or "
                         "'url', relative to the data file, e.g. {'type': 'image', 'image': 'cat.png'}")  # fmt: skip
    if not isinstance(rel, str):
        raise ValueError(f"{where}: the image part ({at}) names {str(rel)[:40]!r} where a file path (a string "
                         "under 'image', 'path' or 'url') is expected; embedded images are not read, save them "
                         "as files")  # fmt: skip
    if rel.startswith(_URL):
        raise ValueError(f"{where}: image {rel[:60]!r} is a URL; ulysses-sp reads local image files only and "
                         "downloads nothing: save the image next to the data file and give its path")  # fmt: skip
    path = _resolve(rel, base_dir)
    if os.path.isdir(path):
        raise ValueError(f"{where}: image path {rel!r} is a directory ({path!r}), not an image file; name the "
                         "file itself (paths are relative to the data file)")  # fmt: skip
    if not os.path.isfile(path):
        raise ValueError(f"{where}: image file {rel!r} not found (looked at {path!r}); paths are relative "
                         "to the data file")  # fmt: skip
    return rel, path


def _header_size(path: str) -> tuple[int, int] | None:
    """``(width, height)`` from the header of the image file ``path``, read by the PIL plugin that
    accepts it, the way ``Image.open`` does but without its decompression-bomb check; ``None``
    where no plugin reads it."""
    from PIL import Image

    Image.init()
    with open(path, "rb") as fp:
        prefix = fp.read(16)
        for fmt in Image.ID:
            factory, accept = Image.OPEN[fmt]
            if accept is not None and not accept(prefix):
                continue
            fp.seek(0)
            try:
                return tuple(factory(fp, path).size)  # type: ignore[return-value]
            except Exception:  # noqa: BLE001 — a plugin that does not read it: try the next, as Image.open does
                continue
    return None


def _too_many_pixels(rel: str, path: str, error: Exception, max_pixels: int | None) -> str:
    from PIL import Image

    size = _header_size(path)
    dims = f"{size[0]} x {size[1]} pixels" if size else f"too large ({error})"
    shrink = f" (the image processor resizes every image to at most {max_pixels} pixels anyway)" if max_pixels else ""
    return (f"image {rel!r} is {dims}, over PIL's safety limit of {2 * Image.MAX_IMAGE_PIXELS} pixels (a "
            f"decompression-bomb guard: 2 x PIL.Image.MAX_IMAGE_PIXELS), so PIL refuses to decode it; downscale "
            f"the file{shrink}, or, if you trust it, raise PIL.Image.MAX_IMAGE_PIXELS in Python before "
            "load_vlm_chat")  # fmt: skip


def _images(record: dict[str, Any], where: str, base_dir: str, image_processor: Any = None) -> list[Any]:
    """The record's images (PIL, RGB) in order of their parts; every bad part a ``ValueError``."""
    from PIL import Image, UnidentifiedImageError

    size = getattr(image_processor, "size", None)
    max_pixels = getattr(size, "longest_edge", None) or getattr(image_processor, "max_pixels", None)
    out = []
    for at, part in _image_parts(record, where):
        rel, path = _image_file(part, at, where, base_dir)
        try:
            with Image.open(path) as img:
                out.append(img.convert("RGB"))
        except Image.DecompressionBombError as e:
            raise ValueError(f"{where}: {_too_many_pixels(rel, path, e, max_pixels)}") from None
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
    loss_on: str = "all",
) -> dict[str, torch.Tensor]:
    """One record as model inputs: ``input_ids [1, S]``, ``labels [1, S]`` (placeholders ``-100``;
    ``loss_on`` ``assistant``/``completion``: also every token outside the assistant turns / the
    last one, segmented as text chats are, ``data.chat``), ``mm_token_type_ids [1, S]``, and
    ``pixel_values [N_p, C*T*p*p]`` + ``image_grid_thw``."""
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
        raise ValueError(
            f"{where}: expected {{'messages': [...]}} (a chat with image parts), got {str(record)[:80]}"
        )
    images = _images(record, where, base_dir, image_processor)
    if loss_on == "all":  # the chat rendered and tokenized whole, as the model's processor does
        ids = tokenizer.apply_chat_template(record["messages"], tokenize=True, return_dict=False)
        ids = torch.tensor(ids, dtype=torch.long).flatten()
        scored = torch.ones_like(ids, dtype=torch.bool)
    else:
        ids, scored = _scored_ids(record["messages"], where, tokenizer, loss_on)
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
        pieces, flags, start = [], [], 0
        for slot, n in zip(slots, counts):  # [S] -> [S + sum(n - 1)]: one token per merged patch
            pieces += [ids[start:slot], torch.full((n,), pad)]
            flags += [scored[start:slot], torch.zeros(n, dtype=torch.bool)]
            start = slot + 1
        ids, scored = torch.cat([*pieces, ids[start:]]), torch.cat([*flags, scored[start:]])
    types = (ids == pad).int() * IMAGE
    try:
        check_placeholders(_Inner(config), types[None], batch.get("image_grid_thw"), None)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if ids.numel() > seq_len:
        raise ValueError(f"{where}: {ids.numel()} tokens ({int((ids == pad).sum())} of them image tokens) exceed "
                         f"seq_len {seq_len}; raise the sequence length or lower the image processor's max_pixels")  # fmt: skip
    labels = ids.masked_fill(types.bool() | ~scored, -100)
    return {"input_ids": ids[None], "labels": labels[None], "mm_token_type_ids": types[None], **batch}


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
                                       loss_on=loss_on))  # fmt: skip
    if not out:
        raise ValueError(f"{path}: no samples")
    if all(bool((s["labels"] == -100).all()) for s in out):
        raise ValueError(f"--data {path!r}: no token is scored, so training would learn nothing (loss 0): "
                         f"--loss-on {loss_on} found no such tokens; check the data's roles, or --loss-on all")  # fmt: skip
    return out
