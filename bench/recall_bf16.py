"""Does the recall task learn in bf16 as in fp32? Two short CLI runs, the same seed and data.

Run (a few minutes on 2 CPU cores)::

    PYTHONPATH=src python bench/recall_bf16.py        # writes bench/results/recall_bf16.md

``ulysses-sp train`` on the embedded recall task (sp = 2, 2 processes, ZeRO 3, 64 tokens, micro-batch
32, 150 steps: the recipe of tests/test_cli.py's learning test) with ``--dtype fp32`` and
``--dtype bf16``; the final loss is the mean of the last 10 steps' losses. The criterion (the
issue's "reaches the fp32 run's final loss"): bf16's final loss <= fp32's + 0.15 nats (chance is
ln 221 = 5.40 nats; a run that does not learn the task stays above 4). The two runs cross the
task's phase transition (loss falling from ~4.7 to ~1) a few steps apart, so the final losses can
differ by more than the margin in either direction; the table shows by how much.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "bench", "results", "recall_bf16.md")
MARGIN = 0.15


def run(dtype: str, out: str) -> list[float]:
    cmd = [sys.executable, "-m", "ulysses_sp.cli.main", "train", "--seq-len", "64", "--micro-batch-size", "32",
           "--steps", "150", "--zero-stage", "3", "--output-dir", out, "--no-progress", "--dtype", dtype]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="recall-bf16-") as tmp:
        losses = {d: run(d, os.path.join(tmp, d)) for d in ("fp32", "bf16")}
    final = {d: sum(v[-10:]) / 10 for d, v in losses.items()}
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    diff = final["bf16"] - final["fp32"]
    lines = [
        "# recall_bf16 (issue 11): the recall task in bf16 vs fp32",
        "",
        f"Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, git {commit}, host {platform.node()}, "
        f"torch {torch.__version__}; `PYTHONPATH=src python bench/recall_bf16.py`. sp 2, 2 CPU processes, ZeRO 3, "
        "64 tokens, micro-batch 32, 150 steps, seed 0.",
        "",
        "| dtype | loss step 1 | loss step 50 | loss step 100 | final (mean of last 10) |",
        "|---|---|---|---|---|",
        *(f"| {d} | {v[0]:.3f} | {v[49]:.3f} | {v[99]:.3f} | {final[d]:.3f} |" for d, v in losses.items()),
        "",
        f"bf16 - fp32 final loss: {diff:+.3f} nats; bf16 reaches fp32's final loss within {MARGIN} nats: "
        f"{'yes' if diff <= MARGIN else 'NO'}.",
    ]
    with open(OUT, "w") as f:
        f.write("\n".join(lines) + "\n")
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
