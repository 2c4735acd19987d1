"""The embedded defaults, so the main job runs with nothing downloaded.

- :func:`byte_tokenizer` — the byte-level tokenizer shipped in code;
- the ``recall`` task (:class:`RecallDataset`) — needs attention across SP shards to be learned;
- model presets ``tiny-llama`` / ``tiny-qwen2`` / ``tiny-mistral`` (:func:`build_model`);
- local ``.txt`` / ``.jsonl`` text (:class:`TextBlockDataset`), and fine-tuning data in any of
  ``datasets``' local formats — chat, prompt/completion, text — tokenized once and packed
  (:func:`build_local_dataset`, :class:`DataSettings`).

:func:`build_dataset` and :func:`load_tokenizer` turn the CLI's ``--data`` / ``--tokenizer`` /
``--model`` strings into these objects.

May import: ``checks``, ``parallel``, ``data``.
"""

from __future__ import annotations

import os

from torch.utils.data import Dataset

from ulysses_sp.tasks.presets import PRESETS, build_model, check_model_dir, is_preset, preset_config
from ulysses_sp.tasks.recall import CHANCE_LOSS, RecallDataset, recall_sample, recall_start
from ulysses_sp.tasks.text import DataSettings, TextBlockDataset, build_local_dataset, data_summary
from ulysses_sp.tasks.tokenizer import VOCAB_SIZE, byte_tokenizer

RECALL = "recall"
EVAL_SEED_OFFSET = 1_000_000_007
"""Recall samples for evaluation come from ``seed + EVAL_SEED_OFFSET``: never seen in training."""

__all__ = [
    "CHANCE_LOSS",
    "DataSettings",
    "PRESETS",
    "RECALL",
    "RecallDataset",
    "TextBlockDataset",
    "VOCAB_SIZE",
    "build_dataset",
    "build_local_dataset",
    "build_model",
    "byte_tokenizer",
    "check_model_dir",
    "data_summary",
    "is_preset",
    "load_tokenizer",
    "preset_config",
    "recall_sample",
    "recall_start",
]


def load_tokenizer(tokenizer: str | None, model: str):
    """``--tokenizer`` directory if given; else the model directory's own tokenizer if it has one;
    else the byte-level tokenizer."""
    from transformers import AutoTokenizer

    if tokenizer:
        if not os.path.isdir(tokenizer):
            raise ValueError(f"--tokenizer {tokenizer!r}: no such directory")
        return AutoTokenizer.from_pretrained(tokenizer)
    if not is_preset(model) and os.path.isfile(os.path.join(model, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(model)
    return byte_tokenizer()


def build_dataset(
    data: str, *, tokenizer, seq_len: int, seed: int, num_samples: int, held_out: bool = False,
    settings: DataSettings | None = None, probe: bool = False, progress: bool = False,
) -> Dataset | None:  # fmt: skip
    """``recall`` (``num_samples`` samples; ``held_out`` draws from a disjoint seed) or local data
    (``build_local_dataset``: ``held_out`` = the ``--eval-split`` part; ``probe``: checks only,
    nothing tokenized into the cache, returns ``None`` for fine-tuning data; ``progress``: a
    progress bar while tokenizing)."""
    if data == RECALL:
        return RecallDataset(
            seq_len=seq_len, num_samples=num_samples, seed=seed + (EVAL_SEED_OFFSET if held_out else 0)
        )
    return build_local_dataset(data, tokenizer=tokenizer, seq_len=seq_len, seed=seed,
                               settings=settings or DataSettings(), held_out=held_out, probe=probe,
                               progress=progress)  # fmt: skip
