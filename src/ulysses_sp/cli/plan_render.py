"""``ulysses-sp plan``'s output for a reader: the table of candidates (best first, the first
``TOP_ROWS`` unless ``--all``), the notes, the recommendation with its breakdown, and the complete
``train`` command (``complete_command``: the learning rate and, for a model directory, a ``--data``
placeholder made explicit). Where it sits: beside ``cli.plan``, which builds the document it renders.
"""

from __future__ import annotations

import os
from typing import Any

TOP_ROWS = 10
"""Candidate rows the table prints without ``--all`` (the JSON document has every one)."""


def label(c: dict[str, Any]) -> str:
    """``sp 8 zero 3/all loss+mlp+ckpt``: a candidate's setting in a few words."""
    s = c["settings"]
    tech = [n for n, k in (("loss", "tiled_loss"), ("mlp", "tiled_mlp"), ("ckpt", "activation_checkpointing"),
                           ("offload", "offload_activations"), ("norms", "recompute_norms"),
                           ("states->host", "cpu_offload")) if s.get(k)]  # fmt: skip
    tech += [f"heads{s['head_chunks']}"] if s.get("head_chunks", 1) > 1 else []
    part = "/all" if s.get("zero_partition") == "all" else ""
    ring = f" (ring {s['ring_size']})" if s.get("ring_size", 1) > 1 else ""
    return f"sp {s['sp']}{ring} zero {s['zero_stage']}{part} " + ("+".join(tech) or "plain")


def complete_command(best: dict[str, Any] | None, model: str, notes: list[str]) -> list[str] | None:
    """The recommended ``train`` command with what the plan cannot choose made explicit: the learning
    rate (train's default for this model) and, but for a preset (the embedded task), a ``--data``
    placeholder; a note says so. ``None`` when nothing is recommended."""
    from ulysses_sp import tasks
    from ulysses_sp.run.config import model_defaults

    if best is None:
        return None
    lr, preset = model_defaults(model)["lr"], tasks.is_preset(model)
    notes.append(f"the command sets --lr {lr:g}, train's default for "
                 + ("a preset (random init); " if preset else "a model directory (fine-tuning); ")
                 + "choose your own" + ("" if preset else ", and replace <your data> with your data file or "
                                        "directory (--data: .jsonl/.parquet/.txt/..., README 'Fine-tuning data')"))  # fmt: skip
    tokenizer = []  # a model directory without tokenizer files: train refuses it unless one is named
    if not preset and os.path.isdir(model) and not tasks.has_tokenizer(model):
        tokenizer = ["--tokenizer", "<tokenizer dir>"]
        notes.append(f"{model!r} has no tokenizer files: replace <tokenizer dir> with the model's tokenizer "
                     "(or --tokenizer byte for the built-in byte-level one)")  # fmt: skip
    return [*best["train_args"], *([] if preset else ["--data", "<your data>"]), *tokenizer, "--lr", f"{lr:g}"]


def render(doc: dict[str, Any], *, rows: int | None = TOP_ROWS) -> str:
    """The human table: the first ``rows`` candidates (``None``: all), best first, then the notes, the
    recommendation, its complete command and its breakdown."""
    gib = 2**30
    shown = doc["candidates"] if rows is None else doc["candidates"][:rows]
    lines = [f"{'setting (best first)':<58} {'peak GiB':>9} {'fits':>5} {'max S':>11} {'tokens/s':>10} {'comm':>5}"]
    for c in shown:
        lines.append(f"{label(c):<58} {c['peak_bytes_per_rank'] / gib:>9.2f} {'yes' if c['fits'] else 'no':>5} "
                     f"{c['max_seq_len']:>11,} {c['tokens_per_s']:>10,.0f} {c['comm_share']:>5.0%}")  # fmt: skip
    more = len(doc["candidates"]) - len(shown)
    if more:
        lines.append(f"... {more} more setting(s): --all prints every row, --json every candidate")
    best = doc["recommended"]
    lines += [""] + [f"note: {n}" for n in doc["notes"]]
    if not doc["candidates"]:
        lines.append("no setting to offer: train refuses every one for this model (notes above)")
    elif best is None:
        host = "" if doc["offload_states"] == "no" else ", even with model states on the host"
        lines.append(f"nothing fits{host}: more devices, a shorter --seq-len, or a smaller --micro-batch-size")
    else:
        lines.append(f"recommended: {label(best)} at S = {best['settings']['seq_len']:,}")
        lines.append("  " + " ".join(doc["command"]))
        lines.append(
            "  breakdown: " + ", ".join(f"{k} {v / gib:.2f} GiB" for k, v in best["breakdown"].items() if v)
        )
    return "\n".join(lines)
