"""Does the recall task learn in bf16 as in fp32? Two short CLI runs, the same seed and data.

    python -m bench.recall_bf16 [--steps 150] [--out bench/results/recall_bf16.md]   # a few minutes

``ulysses-sp train`` on the embedded recall task (sp = 2, 2 processes, ZeRO 3, 64 tokens, micro-batch
32, 150 steps: the recipe of tests/test_cli.py's learning test) with ``--dtype fp32`` and
``--dtype bf16``; the final loss is the mean of the last 10 steps' losses. The criterion: bf16's final
loss <= fp32's + 0.15 nats (chance is ln 221 = 5.40 nats; a run that does not learn stays above 4).
The two runs cross the task's phase transition (loss falling from ~4.7 to ~1) a few steps apart, so
the final losses can differ by more than the margin in either direction; the table shows by how much.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # `python bench/recall_bf16.py` as well as `python -m bench.recall_bf16`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import md

MARGIN = 0.15


def losses(dtype: str, steps: int, out: str) -> list[float]:
    cmd = [sys.executable, "-m", "ulysses_sp.cli.main", "train", "--seq-len", "64", "--micro-batch-size", "32",
           "--steps", str(steps), "--zero-stage", "3", "--output-dir", out, "--no-progress", "--dtype", dtype]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return [json.loads(line)["loss"] for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--out", default=str(md.ROOT / "bench" / "results" / "recall_bf16.md"))
    args = ap.parse_args(argv)
    run = md.provenance(" ".join(["python -m bench.recall_bf16", *(argv if argv is not None else sys.argv[1:])]))
    with tempfile.TemporaryDirectory(prefix="recall-bf16-") as tmp:
        got = {d: losses(d, args.steps, str(Path(tmp) / d)) for d in ("fp32", "bf16")}
    final = {d: sum(v[-10:]) / len(v[-10:]) for d, v in got.items()}
    at = lambda v, i: f"{v[i - 1]:.3f}" if i <= len(v) else "—"  # noqa: E731
    diff = final["bf16"] - final["fp32"]
    md.page(args.out, "recall_bf16: the recall task in bf16 vs fp32", run, [
        f"sp 2, 2 CPU processes, ZeRO 3, 64 tokens, micro-batch 32, {args.steps} steps, seed 0.",
        md.table(["dtype", "loss step 1", "loss step 50", "loss step 100", "final (mean of last 10)"],
                 [[d, at(v, 1), at(v, 50), at(v, 100), f"{final[d]:.3f}"] for d, v in got.items()]),
        f"bf16 - fp32 final loss: {diff:+.3f} nats; bf16 reaches fp32's final loss within {MARGIN} nats: "
        f"{'yes' if diff <= MARGIN else 'NO'}."])  # fmt: skip


if __name__ == "__main__":
    main()
