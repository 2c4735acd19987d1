"""What ``--resume`` reads, checked in the launching process before any rank loads it.

``read_checkpoint(path, output_dir)`` returns the checkpoint's manifest (it parses, in this
version's format); ``check_checkpoint_files`` checks that every other file a resume reads is
whole: the HF weights (``*.safetensors``, their
index) have complete headers and data; the training state's ``torch.distributed.checkpoint``
metadata loads and every ``.distcp`` file holds the bytes it lists; every rank that saved it (the
manifest's ``world.world_size``) left its ``rank<r>.pt`` and each is an intact archive (a resume on
more ranks than saved gives the new ranks rank 0's scheduler and RNG state; a missing file of a
saving rank is damage, never filled in from rank 0's). A damaged file (a disk that filled, a copy cut short, a run killed outside the
atomic rename) raises ``ValueError`` naming the file and the previous checkpoint to resume from
instead, rather than a traceback from every rank in the middle of loading.
"""

from __future__ import annotations

import json
import os
import zipfile
from typing import Any

from ulysses_sp.state import checkpoint as ckpt


def _previous(path: str, output_dir: str) -> str:
    """The suggestion: the newest checkpoint older than ``path`` (in its directory), if any."""
    here = os.path.dirname(os.path.abspath(path))
    found = [p for _, p in ckpt.list_checkpoints(here) if os.path.abspath(p) != os.path.abspath(path)]
    step = lambda p: int(os.path.basename(p).removeprefix(ckpt.PREFIX))  # noqa: E731
    older = (
        [p for p in found if step(p) < step(path)] if os.path.basename(path).startswith(ckpt.PREFIX) else []
    )
    if older:
        return f"resume from the previous checkpoint instead: --resume {older[-1]}"
    return f"no earlier checkpoint in {here}: start a new run (or --overwrite {output_dir})"


def _damaged(file: str, why: str, path: str, output_dir: str) -> ValueError:
    return ValueError(f"--resume {path!r}: {file} is damaged ({why}); {_previous(path, output_dir)}")


def _check_safetensors(file: str) -> None:
    from safetensors import safe_open

    with safe_open(file, framework="pt") as f:  # validates the header against the file's size
        f.keys()


def _check_dcp(directory: str) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(directory).read_metadata()
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        file = os.path.join(directory, name)
        have = os.path.getsize(file) if os.path.isfile(file) else None
        if have is None or have < size:
            raise _Bad(file, "missing" if have is None else f"{have} bytes, its metadata lists {size}")


class _Bad(Exception):
    def __init__(self, file: str, why: str) -> None:
        super().__init__(why)
        self.file = file


def read_checkpoint(path: str, output_dir: str) -> dict[str, Any]:
    """The manifest of the checkpoint ``path`` (parsed, of this version's format; see the module)."""
    manifest_file = os.path.join(path, ckpt.MANIFEST)
    try:
        saved = ckpt.read_manifest(path)
        if not isinstance(saved, dict):
            raise ValueError(f"a JSON {type(saved).__name__}, not an object")
    except (OSError, UnicodeDecodeError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        raise _damaged(manifest_file, f"{type(e).__name__}: {e}", path, output_dir) from None
    ckpt.check_format(saved, path)
    return saved


def check_checkpoint_files(path: str, output_dir: str) -> None:
    """Every file of the checkpoint ``path`` a resume reads is whole (see the module docstring)."""
    state = os.path.join(path, ckpt.STATE_DIR)
    current = path
    try:
        for name in sorted(os.listdir(path)):
            current = os.path.join(path, name)
            if name.endswith(".safetensors"):
                _check_safetensors(current)
            elif name.endswith(".safetensors.index.json"):
                with open(current, encoding="utf-8") as f:
                    json.load(f)
        current = os.path.join(state, ckpt.DCP_DIR, ".metadata")
        _check_dcp(os.path.join(state, ckpt.DCP_DIR))
        manifest = ckpt.read_manifest(path)
        for file in ckpt.missing_rank_states(path, manifest)[:1]:  # never rank 0's state in its place
            raise _Bad(file, f"missing: the manifest says {ckpt.saved_world_size(manifest)} ranks saved "
                             "this checkpoint, each writing its own rank<r>.pt")  # fmt: skip
        for name in sorted(os.listdir(state)):
            if name.endswith(".pt"):
                current = os.path.join(state, name)
                with zipfile.ZipFile(current) as z:
                    bad = z.testzip()
                if bad is not None:
                    raise ValueError(f"its entry {bad} fails its CRC check")
    except _Bad as e:
        raise _damaged(e.file, str(e), path, output_dir) from None
    except Exception as e:  # the readers' own errors (safetensors, pickle, zipfile, json): name the file
        first = (str(e).strip().splitlines() or [""])[0]
        raise _damaged(current, f"{type(e).__name__}: {first}", path, output_dir) from None
