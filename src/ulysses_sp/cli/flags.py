"""The flag vocabulary the ``train`` and ``eval`` parsers share: the fine-tuning data flags
(``tasks.DataSettings``, field for flag), the launch keys, how a default is written in ``--help``.
A leaf of ``cli``: ``args`` and ``evaluate`` import it, it imports neither.
"""

from __future__ import annotations

import argparse
from typing import Any

LAUNCH_KEYS = ("nproc", "timeout")
REHEARSAL_KEYS = ("rehearse", "gpus", "device", "gpu_memory", "host_memory", "json", "images", "image_size")
"""``train --rehearse``'s own options: not the run's settings (``RunConfig``)."""
"""Options of the launch, not of the run: taken out of the command's config."""


def show_default(value: Any) -> str:
    """A default as ``--help`` writes it: ``0.9,0.95`` for a tuple, ``0.01`` for a float."""
    if isinstance(value, tuple):
        return ",".join(show_default(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


DATA_FLAGS: tuple[tuple[str, dict[str, Any], str, str | None], ...] = (
    ("--data-format", {"choices": ("auto", "text", "chat", "prompt-completion")},
     "format of --data; auto decides from the columns", None),
    ("--loss-on", {"choices": ("all", "assistant", "completion")}, "tokens the loss scores",
     "assistant for chat, completion for prompt/completion, all for text"),
    ("--chat-template", {"metavar": "FILE"}, "Jinja chat template file", "the tokenizer's own"),
    ("--packing", {"choices": ("best-fit", "none")}, "best-fit-decreasing packing or one sample per block",
     "best-fit; .txt/.jsonl text: a continuous stream"),
    ("--long-samples", {"choices": ("truncate", "split", "drop")}, "samples longer than --seq-len", None),
    ("--eval-split", {"type": float, "metavar": "F"},
     "fraction of samples held out for eval, chosen by --seed", None),
    ("--data-cache", {"metavar": "DIR"}, "tokenization cache", "~/.cache/ulysses-sp/data"),
    ("--data-workers", {"type": int, "metavar": "N"}, "tokenizing processes", "min(8, cpus)"),
)  # fmt: skip
"""The fine-tuning data flags (``tasks.DataSettings``, field for flag): flag, argparse options, help,
what the field's ``None`` means."""


def add_data_args(p: argparse.ArgumentParser, default: Any, *, from_run: tuple[str, ...] = ()) -> None:
    """The fine-tuning data flags, shared by ``train`` and ``eval``; ``from_run``: the fields whose
    default is the training run's (``eval``)."""
    from ulysses_sp.tasks import DataSettings

    g = p.add_argument_group("fine-tuning data (chat, prompt/completion, datasets formats)")
    for flag, options, text, unset in DATA_FLAGS:
        dest = flag[2:].replace("-", "_")
        value = getattr(DataSettings, dest)
        shown = unset if value is None else show_default(value)
        run = "the training run's, else " if dest in from_run else ""
        g.add_argument(flag, default=default, help=f"{text} (default: {run}{shown})", **options)
