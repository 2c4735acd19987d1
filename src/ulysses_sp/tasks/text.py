"""Local text data: a ``.txt`` / ``.jsonl`` file or a directory of them, tokenized and chunked.

Each ``.txt`` file is one document; each ``.jsonl`` line is one document (its ``"text"`` field).
Documents are tokenized, each followed by the tokenizer's ``eos`` token (when it has one),
concatenated, and cut into ``seq_len`` blocks (the remainder is dropped). Every position is
labelled (plain causal LM). Errors name the file and the numbers: a missing, empty or unreadable
file, a ``.jsonl`` line without ``"text"``, fewer tokens than one sequence.
"""

from __future__ import annotations

import json
import os

import torch
from torch.utils.data import Dataset

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
    try:
        with open(path, encoding="utf-8") as f:
            content = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--data: cannot read {path!r}: {e}") from e
    if not content.strip():
        raise ValueError(f"--data: {path!r} is empty")
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
