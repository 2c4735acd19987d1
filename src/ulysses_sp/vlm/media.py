"""The media parts of a VLM chat record: which parts name files, which files, and the images read.

A chat's content parts are ``{"type": "text", "text": ...}``, ``{"type": "image", "image":
"cat.png"}`` or ``{"type": "video", "video": "clip.mp4"}`` (the file may also go under ``path`` or
``url``), paths relative to the JSONL file. This module walks a record's parts (``media_parts``),
resolves and checks a part's local file (``media_file``: no path, a URL, a directory, a missing
file — each a ``ValueError`` naming the part and what to do), reads images with PIL
(``read_image``: unsupported formats and PIL's decompression-bomb guard named in one line) and lists
every file a chat JSONL names for the resume fingerprint (``named_files``). Videos are decoded by
``vlm.video``; the sample is built by ``vlm.data``.
"""

from __future__ import annotations

import json
import os
from typing import Any

MEDIA_PARTS = ("image", "video")
"""Content part types that name a file (the resume fingerprint covers them; both are read)."""
PATH_KEYS = ("path", "url")
"""Keys that may hold a media part's file besides the part's type (``{"type": "image", "image": ...}``)."""
_URL = ("http://", "https://", "data:")
_EXAMPLE = {"image": "'cat.png'", "video": "'clip.mp4'"}


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


def media_parts(record: dict[str, Any], where: str) -> list[tuple[str, str, dict[str, Any]]]:
    """``(kind, where in the record, part)`` of each image or video part, in order; malformed
    messages and parts and part types this loader does not read are refused (``ValueError``)."""
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
            for media in MEDIA_PARTS:
                if kind is None and media in part:
                    raise ValueError(f"{where}: {at} has {'an' if media == 'image' else 'a'} {media!r} but no 'type'; write it as {{'type': "
                                     f"{media!r}, {media!r}: {_EXAMPLE[media]}}}")  # fmt: skip
            if kind not in (None, "text", *MEDIA_PARTS):
                raise ValueError(f"{where}: {at} has type {kind!r}, which this loader does not read (it reads "
                                 "'text', 'image' and 'video' parts); write an image as {'type': 'image', "
                                 "'image': 'cat.png'} and a video as {'type': 'video', 'video': 'clip.mp4'}")  # fmt: skip
            if kind in MEDIA_PARTS:
                out.append((kind, at, part))
    return out


def media_file(kind: str, part: dict[str, Any], at: str, where: str, base_dir: str) -> tuple[str, str]:
    """``(as written, resolved path)`` of an image or video part's local file (``kind``); a
    ``ValueError`` naming what is wrong and what to do."""
    rel = _reference(part)
    if rel is None:
        raise ValueError(f"{where}: the {kind} part ({at}) has no path; name the file under {kind!r}, 'path' or "
                         f"'url', relative to the data file, e.g. {{'type': {kind!r}, {kind!r}: "
                         f"{_EXAMPLE[kind]}}}")  # fmt: skip
    if not isinstance(rel, str):
        raise ValueError(f"{where}: the {kind} part ({at}) names {str(rel)[:40]!r} where a file path (a string "
                         f"under {kind!r}, 'path' or 'url') is expected; embedded {kind}s are not read, save them "
                         "as files")  # fmt: skip
    if rel.startswith(_URL):
        raise ValueError(f"{where}: {kind} {rel[:60]!r} is a URL; ulysses-sp reads local {kind} files only and "
                         f"downloads nothing: save the {kind} next to the data file and give its path")  # fmt: skip
    path = _resolve(rel, base_dir)
    if os.path.isdir(path):
        raise ValueError(f"{where}: {kind} path {rel!r} is a directory ({path!r}), not {'an' if kind == 'image' else 'a'} "
                         f"{kind} file; name the file itself (paths are relative to the data file)")  # fmt: skip
    if not os.path.isfile(path):
        raise ValueError(f"{where}: {kind} file {rel!r} not found (looked at {path!r}); paths are relative "
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


def read_image(rel: str, path: str, where: str, image_processor: Any = None) -> Any:
    """The image file ``path`` (written ``rel``) as a PIL RGB image; a ``ValueError`` naming it when
    PIL cannot read it or refuses it as a decompression bomb (PIL's limit left as the user set it)."""
    from PIL import Image, UnidentifiedImageError

    size = getattr(image_processor, "size", None)
    max_pixels = getattr(size, "longest_edge", None) or getattr(image_processor, "max_pixels", None)
    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except Image.DecompressionBombError as e:
        raise ValueError(f"{where}: {_too_many_pixels(rel, path, e, max_pixels)}") from None
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"{where}: image {rel!r} is not in a format PIL can read ({e}); use PNG, JPEG, "
                         "WebP, GIF or BMP") from None  # fmt: skip
