"""Local data: plain text chunked into blocks, or fine-tuning data tokenized once and packed.

``build_local_dataset`` picks the path: ``.txt`` / ``.jsonl`` text with no packing asked for
(``--packing`` unset) keeps the continuous-stream chunking below (``TextBlockDataset``); everything
else — ``.json`` / ``.parquet`` / ``.arrow`` / ``save_to_disk`` data, chat and prompt/completion
data, ``--packing best-fit|none`` — goes through ``ulysses_sp.data``: read with ``datasets``,
tokenized once into the on-disk cache, packed into ``seq_len`` blocks (``PackedDataset``).

The continuous stream (``TextBlockDataset``):

Each ``.txt`` file is one document; each ``.jsonl`` line is one document (its ``"text"`` field).
Documents are tokenized, each followed by the tokenizer's ``eos`` token (when it has one),
concatenated, and cut into ``seq_len`` blocks (the remainder is dropped). Every position is
labelled (plain causal LM). Errors name the file and the numbers: a missing, empty or unreadable
file, a ``.jsonl`` line without ``"text"``, fewer tokens than one sequence.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields

import torch
from torch.utils.data import Dataset, Subset

from ulysses_sp.checks import positive_int, read_text_file
from ulysses_sp.data import formats
from ulysses_sp.data.cache import default_cache_dir, tokenized_corpus
from ulysses_sp.data.chat import (
    ChatTemplateError,
    chat_template_of,
    read_chat_template,
    resolve_loss_on,
    template_name,
    tokenize_record,
)
from ulysses_sp.data.packed import PackedDataset, describe, packed_dataset, split_samples

SUFFIXES = (".txt", ".jsonl")


def list_text_files(path: str) -> list[str]:
    """The data files ``path`` names: itself, or the ``.txt``/``.jsonl`` files under it (sorted)."""
    if os.path.isdir(path):
        files = sorted(
            os.path.join(root, f) for root, _, names in os.walk(path) for f in names if f.endswith(SUFFIXES)
        )
        if not files:
            raise ValueError(f"--data {path!r}: directory holds no .txt or .jsonl files")
        return files
    if not os.path.exists(path):
        raise ValueError(f"--data {path!r}: no such file or directory (or use --data recall)")
    if not path.endswith(SUFFIXES):
        raise ValueError(f"--data {path!r}: expected a .txt or .jsonl file, or a directory of them")
    return [path]


def read_documents(path: str) -> list[str]:
    """Read the documents of one file; ``ValueError`` if unreadable, empty or malformed."""
    content = read_text_file("--data", path)
    if path.endswith(".txt"):
        return [content]
    docs = []
    for lineno, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--data: {path}:{lineno} is not valid JSON: {e}") from e
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise ValueError(f'--data: {path}:{lineno} has no string "text" field')
        docs.append(obj["text"])
    return docs


def tokenize_to_blocks(path: str, tokenizer, seq_len: int) -> torch.Tensor:
    """``[N, seq_len]`` token blocks from the file(s) at ``path``."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    for file in list_text_files(path):
        for doc in read_documents(file):
            ids.extend(tokenizer.encode(doc, add_special_tokens=False) + eos)
    if len(ids) < seq_len:
        raise ValueError(
            f"--data {path!r}: {len(ids)} tokens, shorter than one sequence (--seq-len {seq_len}); "
            "use more text or a smaller --seq-len"
        )
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


class TextBlockDataset(Dataset):
    """Blocks of ``seq_len`` tokens from local text, as ``{"input_ids", "labels"}`` dicts."""

    def __init__(self, path: str, *, tokenizer, seq_len: int) -> None:
        self.blocks = tokenize_to_blocks(path, tokenizer, seq_len)

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.blocks[index]
        return {"input_ids": ids, "labels": ids.clone()}


# ---------------------------------------------------------------- fine-tuning data (data/)
@dataclass(frozen=True, kw_only=True)
class DataSettings:
    """How local data becomes training blocks: the fine-tuning data flags, one field per flag of the
    same name (``data_format`` is ``--data-format``, ``data_cache`` is ``--data-cache``). The one
    definition: ``RunConfig`` and ``EvalConfig`` inherit it, ``--config`` files use these keys."""

    data_format: str = "auto"
    """``auto`` (from the columns), ``text``, ``chat`` or ``prompt-completion``."""
    loss_on: str | None = None
    """``all``, ``assistant`` or ``completion``; ``None``: the format's default (a VLM's chats: ``all``)."""
    chat_template: str | None = None
    """A Jinja chat template file overriding the tokenizer's; ``None``: the tokenizer's own."""
    packing: str | None = None
    """``best-fit`` or ``none``; ``None``: best-fit, but ``.txt``/``.jsonl`` text as a continuous stream."""
    long_samples: str = "truncate"
    """Samples longer than ``seq_len``: ``truncate``, ``split`` or ``drop``."""
    eval_split: float = 0.0
    """Fraction of samples held out for ``eval`` (chosen by the seed); 0: none. ``eval`` with the
    training run's ``eval_split`` and seed scores exactly its held-out samples."""
    data_cache: str | None = None
    """Root of the tokenization cache; ``None``: ``~/.cache/ulysses-sp/data``."""
    data_workers: int | None = None
    """Tokenizing processes; ``None``: ``min(8, cpu count)``."""

    def data_settings(self) -> DataSettings:
        """These fields alone, as a ``DataSettings`` (from a config that inherits them)."""
        return DataSettings(**{f.name: getattr(self, f.name) for f in fields(DataSettings)})


def _legacy_text(path: str, settings: DataSettings) -> bool:
    """Plain ``.txt``/``.jsonl`` text with no packing asked for: the continuous stream, as before."""
    if settings.packing is not None or settings.data_format not in ("auto", "text"):
        return False
    if not os.path.exists(path) or formats.is_save_to_disk_dir(path):
        return False
    files = formats.data_files(path) if os.path.isdir(path) else [path]
    if not all(f.endswith(SUFFIXES) for f in files):
        return False
    for f in files:  # auto: a .jsonl whose first row has no "text" is chat or prompt/completion data
        if f.endswith(".jsonl") and settings.data_format == "auto":
            with open(f, encoding="utf-8", errors="replace") as fh:
                first = next((line for line in fh if line.strip()), "")
            try:
                row = json.loads(first)
            except json.JSONDecodeError:
                return True  # the stream reader names the line
            if isinstance(row, dict) and "text" not in row:
                return False
    return True


def _check_settings(settings: DataSettings) -> None:
    from ulysses_sp.data.bestfit import LONG_SAMPLES, PACKINGS
    from ulysses_sp.data.packed import split_samples

    if settings.packing is not None and settings.packing not in PACKINGS:
        raise ValueError(f"--packing must be one of {PACKINGS}, got {settings.packing!r}")
    if settings.long_samples not in LONG_SAMPLES:
        raise ValueError(f"--long-samples must be one of {LONG_SAMPLES}, got {settings.long_samples!r}")
    split_samples(2, settings.eval_split, 0)  # the fraction's range
    if settings.data_workers is not None:
        positive_int("--data-workers", settings.data_workers)


def _probe(path: str, tokenizer, settings: DataSettings) -> None:
    """The checks a run would fail on, without tokenizing the data: its format, loss mask, template."""
    table = formats.read_table(
        path, cache_dir=os.path.join(settings.data_cache or default_cache_dir(), "arrow")
    )
    fmt = formats.resolve_format(table.column_names, settings.data_format, where=path)
    loss_on = resolve_loss_on(fmt, settings.loss_on)
    template = (
        chat_template_of(tokenizer, read_chat_template(settings.chat_template)) if fmt == "chat" else None
    )
    if not len(table):
        raise ValueError(f"--data {path!r}: no samples")
    try:
        tokenize_record(formats.records(table, 0, 1, fmt)[0], fmt=fmt, loss_on=loss_on, tokenizer=tokenizer,
                        template=template)  # fmt: skip
    except ChatTemplateError as e:
        raise ValueError(f"--data {path!r}, sample 0: {template_name(settings.chat_template)} {e}") from None
    except ValueError as e:
        raise ValueError(f"--data {path!r}, sample 0: {e}") from e


def build_local_dataset(
    path: str, *, tokenizer, seq_len: int, seed: int, settings: DataSettings, held_out: bool = False,
    probe: bool = False, progress: bool = False,
) -> Dataset | None:  # fmt: skip
    """The training (``held_out``: eval) blocks of local data, or with ``probe`` only its checks;
    ``progress``: a progress bar while tokenizing.

    Every rank may call it: the first to reach the cache tokenizes, the others wait and share it.
    """
    _check_settings(settings)
    if _legacy_text(path, settings):
        blocks = TextBlockDataset(path, tokenizer=tokenizer, seq_len=seq_len)
        train, held = split_samples(len(blocks), settings.eval_split, seed)
        if not settings.eval_split:
            return blocks
        return Subset(blocks, (held if held_out else train).tolist())
    if probe:
        _probe(path, tokenizer, settings)
        return None
    corpus = tokenized_corpus(
        path, tokenizer, data_format=settings.data_format, loss_on=settings.loss_on,
        chat_template=read_chat_template(settings.chat_template), template_file=settings.chat_template,
        cache_dir=settings.data_cache,
        workers=settings.data_workers or min(8, os.cpu_count() or 1), progress=progress,
    )  # fmt: skip
    return packed_dataset(
        corpus, seq_len=seq_len, pad_id=tokenizer.pad_token_id or 0, packing=settings.packing or "best-fit",
        long_samples=settings.long_samples, eval_split=settings.eval_split, seed=seed, held_out=held_out,
    )  # fmt: skip


def data_summary(dataset: Dataset) -> str | None:
    """The packing line of the startup summary (efficiency, scored-token share), if it has one."""
    if isinstance(dataset, PackedDataset):
        return describe(dataset.stats())
    return None
