"""Tokenize a dataset once: parallel workers, an on-disk memory-mapped cache shared by a node's ranks.

``tokenized_corpus(path, tokenizer, settings)`` returns a ``TokenizedCorpus`` (``ids``, ``scored``,
``offsets``: three ``.npy`` arrays opened with ``mmap_mode="r"``, so every rank of a node shares
one copy in the page cache). The cache entry's name is a hash of everything the tokens depend on:
the input files (path, size, mtime), the tokenizer (its serialized model and special tokens), the
format, ``--loss-on``, the chat template and a format version — a changed input or setting gives a
new entry, never a stale one.

Ranks coordinate through a file lock (``fcntl.flock`` on ``<entry>.lock``): the first to take it
tokenizes and publishes the entry atomically (written to a temporary directory, then renamed); the
others wait on the lock and then open the finished entry, so a node tokenizes once, not once per
rank — with no collective, so it works before the process group exists, and across runs.

Tokenization runs in ``workers`` spawned processes (chunks of rows; a ``tqdm`` bar when
``progress``) when there are enough rows to pay for their start-up, else in this process.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ulysses_sp.data import formats
from ulysses_sp.data.chat import (
    ChatTemplateError,
    chat_template_of,
    resolve_loss_on,
    template_name,
    tokenize_record,
)

logger = logging.getLogger(__name__)

CACHE_VERSION = 1
CHUNK_ROWS = 1024
MIN_ROWS_PER_WORKER = 2048
"""Below ``workers * MIN_ROWS_PER_WORKER`` rows, tokenizing in-process beats starting workers."""


@dataclass(frozen=True)
class TokenizedCorpus:
    """Tokenized samples: sample ``i`` is ``ids[offsets[i]:offsets[i+1]]`` (and ``scored`` alike)."""

    ids: np.ndarray
    """``[T]`` int32 token ids of all samples, concatenated."""
    scored: np.ndarray
    """``[T]`` bool: whether the loss scores the token."""
    offsets: np.ndarray
    """``[N + 1]`` int64 start of each sample."""
    meta: dict
    """What the entry was built from (format, loss_on, counts, ...)."""
    path: str
    """The cache entry's directory."""

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __reduce__(self):
        # pickled (to the ranks) as its cache path: opened memory-mapped again, not copied
        return (_open, (self.path,))


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the tokenizer's model, vocabulary and special tokens."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:  # a slow tokenizer: its vocabulary in order
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps([tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]).encode())
    return h.hexdigest()


def default_cache_dir() -> str:
    """``~/.cache/ulysses-sp/data``: shared by the runs of one user on one node."""
    return os.path.join(os.path.expanduser("~"), ".cache", "ulysses-sp", "data")


@lru_cache(maxsize=1)
def _worker_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _tokenize_rows(task: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Worker body: rows ``[lo, hi)`` of the table -> ``(ids, scored, lengths)``."""
    data, cache_dir, tokenizer_dir, tokenizer, lo, hi, fmt, loss_on, template, template_file = task
    tokenizer = tokenizer or _worker_tokenizer(tokenizer_dir)
    table = formats.read_table(data, cache_dir=cache_dir)
    ids, scored, lengths = [], [], []
    for i, record in enumerate(formats.records(table, lo, hi, fmt), start=lo):
        try:
            one, mask = tokenize_record(
                record, fmt=fmt, loss_on=loss_on, tokenizer=tokenizer, template=template
            )
        except ChatTemplateError as e:
            raise ValueError(f"--data {data!r}, sample {i}: {template_name(template_file)} {e}") from None
        except ValueError as e:
            raise ValueError(f"--data {data!r}, sample {i}: {e}") from e
        ids += one
        scored += mask
        lengths.append(len(one))
    return (
        np.asarray(ids, dtype=np.int32),
        np.asarray(scored, dtype=bool),
        np.asarray(lengths, dtype=np.int64),
    )


def _tokenize_all(
    data, table, tokenizer, *, fmt, loss_on, template, template_file, cache_dir, workers, progress, tmp
):
    from tqdm import tqdm

    n = len(table)
    bounds = [(lo, min(lo + CHUNK_ROWS, n)) for lo in range(0, n, CHUNK_ROWS)]
    parallel = workers > 1 and n >= workers * MIN_ROWS_PER_WORKER
    bar = tqdm(total=n, disable=not progress, unit="sample", desc="tokenizing", dynamic_ncols=True)
    parts = []
    try:
        if parallel:
            import multiprocessing as mp

            tok_dir = os.path.join(tmp, "tokenizer")
            tokenizer.save_pretrained(tok_dir)
            tasks = [
                (data, cache_dir, tok_dir, None, lo, hi, fmt, loss_on, template, template_file)
                for lo, hi in bounds
            ]
            with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
                for part in pool.map(_tokenize_rows, tasks):
                    parts.append(part)
                    bar.update(len(part[2]))
        else:
            for lo, hi in bounds:
                parts.append(
                    _tokenize_rows(
                        (data, cache_dir, None, tokenizer, lo, hi, fmt, loss_on, template, template_file)
                    )
                )
                bar.update(hi - lo)
    finally:
        bar.close()
    empty = (np.zeros(0, np.int32), np.zeros(0, bool), np.zeros(0, np.int64))
    ids, scored, lengths = (np.concatenate(p) for p in zip(*(parts or [empty])))
    return ids, scored, lengths


def _open(entry: str) -> TokenizedCorpus:
    """The cache entry ``entry``, memory-mapped; ``ValueError`` naming it (and to delete it) when a
    file is missing, truncated or does not match the entry's counts (a disk that filled, a copy cut short)."""
    try:
        with open(os.path.join(entry, "meta.json"), encoding="utf-8") as f:
            meta = json.load(f)
        arrays = {
            name: np.load(os.path.join(entry, f"{name}.npy"), mmap_mode="r")
            for name in ("ids", "scored", "offsets")
        }
        ids, scored, offsets = arrays["ids"], arrays["scored"], arrays["offsets"]
        if not (len(ids) == len(scored) == meta["tokens"] and len(offsets) == meta["samples"] + 1
                and (not len(offsets) or int(offsets[-1]) == len(ids))):  # fmt: skip
            raise ValueError(
                f"{len(ids)} ids, {len(scored)} flags and {len(offsets)} offsets for {meta['tokens']} tokens "
                f"of {meta['samples']} samples"
            )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"the tokenization cache entry {entry} is damaged ({type(e).__name__}: {e}); delete that directory "
            "(rm -r it) and run again: the data is then tokenized afresh"
        ) from None
    return TokenizedCorpus(ids=ids, scored=scored, offsets=offsets, meta=meta, path=entry)


def tokenized_corpus(
    data: str,
    tokenizer,
    *,
    data_format: str = "auto",
    loss_on: str | None = None,
    chat_template: str | None = None,
    template_file: str | None = None,
    cache_dir: str | None = None,
    workers: int = 1,
    progress: bool = False,
) -> TokenizedCorpus:
    """The tokenized samples of ``data`` from the cache, tokenizing them first if no entry matches.

    Args:
        data: a local file or directory (``formats``).
        tokenizer: a transformers tokenizer.
        data_format: ``auto`` (decided from the columns) or a format of ``formats.FORMATS``.
        loss_on: ``all`` / ``assistant`` / ``completion``; ``None``: the format's default.
        chat_template: a Jinja template (the text) overriding the tokenizer's.
        template_file: the file ``chat_template`` was read from (named when it fails to render).
        cache_dir: the cache root; ``None``: ``default_cache_dir()``.
        workers: tokenizing processes (``1``: this process).
        progress: a progress bar while tokenizing.
    """
    root = cache_dir or default_cache_dir()
    os.makedirs(root, exist_ok=True)
    hf_cache = os.path.join(root, "arrow")  # datasets' converted tables
    table = formats.read_table(data, cache_dir=hf_cache)
    fmt = formats.resolve_format(table.column_names, data_format, where=data)
    loss_on = resolve_loss_on(fmt, loss_on)
    template = chat_template_of(tokenizer, chat_template) if fmt == "chat" else None
    key = {"version": CACHE_VERSION, "data": formats.fingerprint(data), "tokenizer": tokenizer_fingerprint(tokenizer),
           "format": fmt, "loss_on": loss_on, "template": template}  # fmt: skip
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    entry = os.path.join(root, digest)
    with open(entry + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process per entry tokenizes; the others wait here
        try:
            if os.path.isfile(os.path.join(entry, "meta.json")):
                return _open(entry)
            tmp = tempfile.mkdtemp(prefix=digest + ".tmp-", dir=root)
            try:
                ids, scored, lengths = _tokenize_all(data, table, tokenizer, fmt=fmt, loss_on=loss_on,
                                                     template=template, template_file=template_file,
                                                     cache_dir=hf_cache, workers=workers,
                                                     progress=progress, tmp=tmp)  # fmt: skip
                offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
                np.cumsum(lengths, out=offsets[1:])
                for name, array in (("ids", ids), ("scored", scored), ("offsets", offsets)):
                    np.save(os.path.join(tmp, f"{name}.npy"), array)
                meta = {**key, "data_path": os.path.abspath(data), "samples": len(lengths), "tokens": int(len(ids)),
                        "scored_tokens": int(scored.sum())}  # fmt: skip
                with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
                    json.dump(meta, f, indent=1)
                shutil.rmtree(os.path.join(tmp, "tokenizer"), ignore_errors=True)
                os.rename(tmp, entry)  # published atomically: a reader sees all of it or nothing
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            logger.info("tokenized %d samples (%d tokens) of %s into %s", len(lengths), len(ids), data, entry)
            return _open(entry)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
