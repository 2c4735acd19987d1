"""Bench: a ``transformers.Trainer`` with and without ``integrations.transformers.prepare`` (sp=2).

    python -m bench.hf_trainer            # 2 local processes (torchrun), CPU/gloo or GPUs
    python -m bench.hf_trainer --seq 4096 --steps 4

Both runs train the same tiny Llama on the same fixed-length batches on 2 processes: without SP
(DDP, each rank a whole sequence) and with ``prepare(trainer, sp_size=2)`` (each rank half of every
sequence, gradient accumulation doubled so the global batch is the same). Reported per run: the
busiest rank's peak tensor bytes during ``trainer.train()`` (``ulysses_sp.memory.meter.track_peak_memory``,
model parameters counted), the median optimizer-step time after the first step, and the last logged
loss (equal between the runs: a sanity check, the tests assert it). Writes
``bench/results/hf_trainer.md``, headed by the run that produced it.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "hf_trainer.md"


def _worker(seq: int, steps: int) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainerCallback, TrainingArguments

    from ulysses_sp.integrations.transformers import prepare
    from ulysses_sp.memory.meter import track_peak_memory
    from ulysses_sp.parallel.comm import all_reduce_max
    from ulysses_sp.parallel.mesh import shutdown

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t0)

    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 256, (seq,), generator=g).tolist() for _ in range(8 * steps)]
    rows = [{"input_ids": x, "labels": x} for x in ids]
    results = []
    for sp in (1, 2):
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=259, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
        )  # fmt: skip
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        with tempfile.TemporaryDirectory() as out:
            args = TrainingArguments(
                output_dir=out, use_cpu=not torch.accelerator.is_available(), report_to=[], save_strategy="no",
                max_steps=steps, per_device_train_batch_size=1, gradient_accumulation_steps=sp,
                logging_steps=1, learning_rate=1e-3, disable_tqdm=True, seed=0,
            )  # fmt: skip
            timer = StepTimer()
            trainer = Trainer(
                model=model, args=args, train_dataset=Dataset.from_list(rows), callbacks=[timer]
            )
            handle = prepare(trainer, sp_size=2) if sp == 2 else None
            with track_peak_memory(include=model.parameters()) as mem:
                trainer.train()
            group = handle.mesh.reduce_group if handle else torch.distributed.group.WORLD
            peak = int(all_reduce_max(torch.tensor(mem.peak_bytes), group))
            loss = [h["loss"] for h in trainer.state.log_history if "loss" in h][-1]
            results.append((sp, peak, statistics.median(timer.times[1:]), loss))
    if torch.distributed.get_rank() == 0:
        print("RESULTS", repr(results), flush=True)
    shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        _worker(a.seq, a.steps)
        return 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "bench.hf_trainer",
           "--worker", "--seq", str(a.seq), "--steps", str(a.steps)]  # fmt: skip
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
    }
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULTS ")), None)
    if r.returncode or line is None:
        sys.stderr.write(r.stdout[-3000:] + r.stderr[-5000:])
        return 1
    results = ast.literal_eval(line.removeprefix("RESULTS "))
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "src", "bench/hf_trainer.py"],
                           cwd=ROOT, capture_output=True, text=True).stdout.strip()  # fmt: skip
    head = (
        f"Run: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, git {commit.stdout.strip()}{'+uncommitted' if dirty else ''}, "
        f"host {platform.node()}, torch {torch.__version__}; `python -m bench.hf_trainer --seq {a.seq} "
        f"--steps {a.steps}` (2 processes, tiny Llama h=128, 2 layers, sdpa, batch 1 x {a.seq} tokens per "
        "rank-batch)."
    )
    (_, base_peak, base_t, _), rows = results[0], []
    for sp, peak, t, loss in results:
        rows.append(
            f"| {'Trainer' if sp == 1 else 'Trainer + prepare(sp_size=2)'} | {a.seq if sp == 1 else a.seq // 2} "
            f"| {peak / 2**20:.1f} | {peak / base_peak:.2f} | {t * 1e3:.0f} | {t / base_t:.2f} | {loss:.4f} |"
        )
    table = [
        "# HF Trainer with and without sequence parallelism", "", head, "",
        "| run | tokens per rank per micro-step | peak MiB (busiest rank) | peak vs no SP "
        "| step ms (median) | step time vs no SP | last loss |",
        "|---|---|---|---|---|---|---|", *rows, "",
        "A step is the same global batch in both runs; with SP each rank runs 2 micro-steps of half a "
        "sequence instead of 1 of a whole one, plus the attention all-to-alls and the loader's exchange "
        "over gloo. Timings on a shared 2-core CPU machine are not a GPU projection; the peak is "
        "deterministic (tensor bytes, parameters and optimizer state included).",
    ]  # fmt: skip
    OUT.write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
