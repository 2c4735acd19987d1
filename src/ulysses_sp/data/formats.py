"""Reading fine-tuning data from local files through the ``datasets`` library, and its format.

``--data`` may name a ``.jsonl`` / ``.json`` / ``.parquet`` / ``.arrow`` / ``.txt`` file, a
directory of such files (searched recursively, sorted by path, read as one table), or a directory
written by ``datasets``' ``save_to_disk``. Only local paths are read: a name that would reach a
model hub (``org/name`` that is no local path, ``hf://``, a URL) is refused with a clear error —
nothing is downloaded. ``.txt`` files are one document each (a ``text`` row).

The columns decide the format (``--data-format auto``) unless it is given:

- ``text``: a string column ``text`` (language modelling);
- ``chat``: ``messages``, a list of ``{"role", "content"}`` turns;
- ``prompt-completion``: string columns ``prompt`` and ``completion``.

Tables are memory-mapped Arrow (``datasets``' own cache, under ``cache_dir``): reading a large
file twice converts it once.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any

from ulysses_sp.checks import read_text_file

FORMATS = ("auto", "text", "chat", "prompt-completion")
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".txt": "txt"}
REQUIRED = {"text": ("text",), "chat": ("messages",), "prompt-completion": ("prompt", "completion")}
_REMOTE = re.compile(r"^[a-z][a-z0-9+.-]*://", re.IGNORECASE)


def is_save_to_disk_dir(path: str) -> bool:
    """Whether ``path`` is a directory written by ``Dataset.save_to_disk`` (or a ``DatasetDict``'s)."""
    has = lambda name: os.path.isfile(os.path.join(path, name))  # noqa: E731
    return os.path.isdir(path) and (has("state.json") or has("dataset_dict.json"))


def check_local(path: str) -> None:
    """Refuse anything that is not an existing local file or directory, naming why."""
    if _REMOTE.match(path):
        raise ValueError(
            f"--data {path!r}: a remote location; ulysses-sp reads local paths only and downloads nothing "
            "(download the dataset yourself, e.g. with `datasets`' save_to_disk, and pass the directory)"
        )
    if not os.path.exists(path):
        hub = "/" in path and not path.startswith((".", "/")) and path.count("/") == 1
        hint = (
            " — it looks like a hub dataset name; ulysses-sp reads local paths only and downloads "
            "nothing: save it locally (datasets' save_to_disk) and pass that directory"
            if hub
            else " (or use --data recall)"
        )
        raise ValueError(f"--data {path!r}: no such file or directory{hint}")


def data_files(path: str) -> list[str]:
    """The files ``path`` names (itself, or the data files under a directory), sorted.

    A ``save_to_disk`` directory counts as one entry (the directory itself).
    """
    check_local(path)
    if is_save_to_disk_dir(path):
        return [path]
    if os.path.isdir(path):
        files = sorted(
            os.path.join(root, f)
            for root, _, names in os.walk(path)
            for f in names
            if os.path.splitext(f)[1] in BUILDERS
        )
        if not files:
            raise ValueError(f"--data {path!r}: directory holds no {'/'.join(BUILDERS)} files")
        return files
    if os.path.splitext(path)[1] not in BUILDERS:
        raise ValueError(f"--data {path!r}: expected one of {', '.join(BUILDERS)} files, or a directory")
    return [path]


def fingerprint(path: str) -> str:
    """A hash of every input file's path, size and modification time: changes when the data does."""
    entries = []
    for item in data_files(path):
        walk = (
            [os.path.join(r, f) for r, _, names in os.walk(item) for f in names]
            if os.path.isdir(item)
            else [item]
        )
        for f in sorted(walk):
            st = os.stat(f)
            entries.append((os.path.abspath(f), st.st_size, st.st_mtime_ns))
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def _read_txt(files: list[str]):
    from datasets import Dataset

    return Dataset.from_dict({"text": [read_text_file("--data", f) for f in files]})


def _read_arrow(files: list[str]):
    import pyarrow as pa
    from datasets import Dataset, concatenate_datasets

    parts = []
    for f in files:
        try:
            parts.append(Dataset.from_file(f))  # the stream format save_to_disk writes: memory-mapped
        except (pa.ArrowInvalid, OSError):
            with pa.memory_map(f) as source:  # the Arrow IPC file format (pyarrow / feather v2)
                parts.append(Dataset(pa.ipc.open_file(source).read_all()))
    return concatenate_datasets(parts) if len(parts) > 1 else parts[0]


def _read_save_to_disk(path: str):
    from datasets import DatasetDict, load_from_disk

    ds = load_from_disk(path)
    if isinstance(ds, DatasetDict):
        if "train" not in ds:
            raise ValueError(f"--data {path!r}: a DatasetDict without a 'train' split (splits: {sorted(ds)}); "
                             "pass the directory of one split")  # fmt: skip
        ds = ds["train"]
    return ds


def read_table(path: str, *, cache_dir: str | None = None):
    """The rows of ``path`` as one ``datasets.Dataset`` (Arrow, memory-mapped where possible).

    Raises:
        ValueError: a remote or missing path, no data files, mixed file kinds, an unreadable file.
    """
    files = data_files(path)
    if is_save_to_disk_dir(files[0]):
        return _read_save_to_disk(files[0])
    kinds = sorted({BUILDERS[os.path.splitext(f)[1]] for f in files})
    if len(kinds) > 1:
        raise ValueError(f"--data {path!r}: mixes file kinds {kinds}; put one kind of file in a directory")
    from datasets import Dataset

    kind = kinds[0]
    try:
        if kind == "txt":
            return _read_txt(files)
        if kind == "arrow":
            return _read_arrow(files)
        if kind == "json":
            return Dataset.from_json(files, cache_dir=cache_dir)
        return Dataset.from_parquet(files, cache_dir=cache_dir)
    except ValueError:
        raise
    except Exception as e:  # the datasets library's parse errors carry the reason; name the input
        where = _json_error(files) if kind == "json" else None
        if where:  # datasets says only "An error occurred while generating the dataset"
            raise ValueError(f"--data {path!r}: {where}; fix or remove that line") from None
        raise ValueError(f"--data {path!r}: cannot read it as {kind}: {type(e).__name__}: {e}") from e


def _json_error(files: list[str]) -> str | None:
    """``"<file>:<line>: <what>"`` for the first line of ``files`` that is not valid JSON (a
    ``.jsonl`` line, or the position in a ``.json`` document); ``None`` if every file parses."""
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            if f.endswith(".jsonl"):
                for lineno, line in enumerate(fh, start=1):
                    if not line.strip():
                        continue
                    try:
                        json.loads(line)
                    except json.JSONDecodeError as e:
                        return f"{f}:{lineno} is not valid JSON ({e.msg} at column {e.colno}): {line.strip()[:80]!r}"
                continue
            try:
                json.load(fh)
            except json.JSONDecodeError as e:
                return f"{f}:{e.lineno} is not valid JSON ({e.msg} at column {e.colno})"
    return None


def resolve_format(columns: list[str], data_format: str, *, where: str) -> str:
    """The format of a table with ``columns`` (``auto`` decides; a given one must fit the columns)."""
    if data_format not in FORMATS:
        raise ValueError(f"--data-format must be one of {FORMATS}, got {data_format!r}")
    if data_format == "auto":
        for fmt in ("chat", "prompt-completion", "text"):
            if all(c in columns for c in REQUIRED[fmt]):
                return fmt
        raise ValueError(
            f"--data {where!r}: columns {sorted(columns)} fit no format; expected 'text', 'messages' "
            "(chat) or 'prompt' + 'completion'"
        )
    missing = [c for c in REQUIRED[data_format] if c not in columns]
    if missing:
        raise ValueError(
            f"--data {where!r} with --data-format {data_format}: missing column(s) {missing} "
            f"(columns: {sorted(columns)})"
        )
    return data_format


def records(table, lo: int, hi: int, fmt: str) -> list[dict[str, Any]]:
    """Rows ``[lo, hi)`` of ``table`` as dicts holding only the columns format ``fmt`` reads."""
    cols = table.select_columns(list(REQUIRED[fmt]))[lo:hi]
    return [dict(zip(cols, values)) for values in zip(*cols.values())]
