"""The embedded defaults, so the main job runs with nothing downloaded.

- :func:`byte_tokenizer` — the byte-level tokenizer shipped in code;
- the ``recall`` task (:class:`RecallDataset`) — needs attention across SP shards to be learned;
- model presets ``tiny-llama`` / ``tiny-qwen2`` / ``tiny-mistral`` (:func:`build_model`);
- local ``.txt`` / ``.jsonl`` text (:class:`TextBlockDataset`), and fine-tuning data in any of
  ``datasets``' local formats — chat, prompt/completion, text — tokenized once and packed
  (:func:`build_local_dataset`, :class:`DataSettings`).

:func:`build_dataset` and :func:`run_tokenizer` turn the CLI's ``--data`` / ``--tokenizer`` /
``--model`` strings into these objects.

May import: ``checks``, ``parallel``, ``data``.
"""

from __future__ import annotations

import json
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
    "BYTE_TOKENIZER",
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
    "run_tokenizer",
    "preset_config",
    "recall_sample",
    "recall_start",
]


BYTE_TOKENIZER = "byte"
"""``--tokenizer byte``: the built-in byte-level tokenizer, asked for by name (a directory named
``byte`` is ``./byte``)."""
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")
"""Files that make a model directory's own tokenizer loadable (``AutoTokenizer``)."""


def has_tokenizer(directory: str) -> bool:
    return any(os.path.isfile(os.path.join(directory, f)) for f in TOKENIZER_FILES)


def _load_dir(directory: str, what: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"{what} {directory!r}: its tokenizer files do not load ({type(e).__name__}: {first})") from None


def _no_tokenizer(model: str) -> ValueError:
    try:
        with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
            vlm = "vision_config" in json.load(f)
    except (OSError, ValueError):
        vlm = False
    if vlm:  # a VLM run takes no --tokenizer: its directory's tokenizer renders the images
        return ValueError(f"--model {model!r} has no tokenizer ({' or '.join(TOKENIZER_FILES)}): a vision-language "
                          "model directory needs the tokenizer and processor files it was published with "
                          "(processor.save_pretrained(dir))")  # fmt: skip
    return ValueError(
        f"--model {model!r} has no tokenizer ({' or '.join(TOKENIZER_FILES)}) and no --tokenizer was given: pass "
        f"--tokenizer DIR (the tokenizer the model was trained with), or --tokenizer {BYTE_TOKENIZER} to train "
        f"it with the built-in byte-level tokenizer ({VOCAB_SIZE} tokens)"
    )


def run_tokenizer(tokenizer: str | None, model: str):
    """The tokenizer of a run (``train``, ``eval``), never a silent stand-in: ``--tokenizer byte``
    (the built-in byte-level one) or a directory if given; else a preset's byte-level tokenizer or the
    model directory's own. A directory without tokenizer files raises ``ValueError`` naming the fix."""
    if tokenizer == BYTE_TOKENIZER:
        return byte_tokenizer()
    if tokenizer:
        if not os.path.isdir(tokenizer):
            raise ValueError(f"--tokenizer {tokenizer!r}: no such directory (or '{BYTE_TOKENIZER}' for the "
                             "built-in byte-level tokenizer)")  # fmt: skip
        return _load_dir(tokenizer, "--tokenizer")
    if is_preset(model):
        return byte_tokenizer()
    check_model_dir(model)  # no such directory, no config.json: that, not the tokenizer, is the problem
    if has_tokenizer(model):
        return _load_dir(model, "--model")
    raise _no_tokenizer(model)


def load_tokenizer(tokenizer: str | None, model: str):
    """A tokenizer to size a model with (``plan``: only a preset's vocabulary depends on it): as
    ``run_tokenizer``, except that a model directory without one gets the byte-level tokenizer.
    Runs use ``run_tokenizer``, which refuses that case instead."""
    if tokenizer is None and not is_preset(model) and not has_tokenizer(model):
        return byte_tokenizer()
    return run_tokenizer(tokenizer, model)


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
