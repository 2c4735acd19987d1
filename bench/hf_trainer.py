"""Bench: a ``transformers.Trainer`` with and without ``integrations.transformers.prepare`` (sp=2).

    python -m bench.hf_trainer [--seq 2048] [--steps 4] [--out bench/results/hf_trainer.md]

Both runs train the same tiny Llama on the same fixed-length batches on 2 processes (bench/launch.py):
without SP (DDP, each rank a whole sequence) and with ``prepare(trainer, sp_size=2)`` (each rank half of
every sequence, gradient accumulation doubled so the global batch is the same). Reported per run: the
busiest rank's peak tensor bytes during ``trainer.train()`` (``track_peak_memory``, parameters
counted), the median optimizer-step time after the first step, and the last logged loss (equal between
the runs: a sanity check, the tests assert it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

from bench import md
from bench.launch import finish_worker, init_worker, max_over_ranks, run_worker, under_torchrun


def worker(seq: int, steps: int) -> list:
    import torch
    from datasets import Dataset
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from bench.spec import llama
    from ulysses_sp.integrations.transformers import prepare
    from ulysses_sp.memory.meter import track_peak_memory

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t0)

    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": x, "labels": x} for x in (torch.randint(0, 256, (seq,), generator=g).tolist()
                                                     for _ in range(8 * steps))]  # fmt: skip
    results = []
    for sp in (1, 2):
        model = llama(vocab_size=259, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq)  # fmt: skip
        with tempfile.TemporaryDirectory() as out:
            args = TrainingArguments(
                output_dir=out, use_cpu=not torch.accelerator.is_available(), report_to=[], save_strategy="no",
                max_steps=steps, per_device_train_batch_size=1, gradient_accumulation_steps=sp,
                logging_steps=1, learning_rate=1e-3, disable_tqdm=True, seed=0)  # fmt: skip
            timer = StepTimer()
            trainer = Trainer(model=model, args=args, train_dataset=Dataset.from_list(rows), callbacks=[timer])
            if sp == 2:
                prepare(trainer, sp_size=2)
            with track_peak_memory(include=model.parameters()) as mem:
                trainer.train()
            loss = [h["loss"] for h in trainer.state.log_history if "loss" in h][-1]
            results.append([sp, int(max_over_ranks(mem.peak_bytes)), statistics.median(timer.times[1:]), loss])
    return results


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=str(md.ROOT / "bench" / "results" / "hf_trainer.md"))
    a = ap.parse_args(argv)
    if under_torchrun():
        init_worker()
        return finish_worker(worker(a.seq, a.steps), a.out)
    run = md.provenance(f"python -m bench.hf_trainer --seq {a.seq} --steps {a.steps}")
    results, _, _ = run_worker("bench.hf_trainer", 2, ["--seq", str(a.seq), "--steps", str(a.steps)])
    (_, base_peak, base_t, _), rows = results[0], []
    for sp, peak, t, loss in results:
        rows.append(["Trainer" if sp == 1 else "Trainer + prepare(sp_size=2)", a.seq // sp, f"{peak / 2**20:.1f}",
                     f"{peak / base_peak:.2f}", f"{t * 1e3:.0f}", f"{t / base_t:.2f}", f"{loss:.4f}"])  # fmt: skip
    md.page(a.out, "HF Trainer with and without sequence parallelism", run, [
        f"2 processes, tiny Llama h=128, 2 layers, sdpa, batch 1 x {a.seq} tokens per rank-batch.",
        md.table(["run", "tokens per rank per micro-step", "peak MiB (busiest rank)", "peak vs no SP",
                  "step ms (median)", "step time vs no SP", "last loss"], rows),
        "A step is the same global batch in both runs; with SP each rank runs 2 micro-steps of half a "
        "sequence instead of 1 of a whole one, plus the attention all-to-alls and the loader's exchange "
        "over gloo. Timings on a shared 2-core CPU machine are not a GPU projection; the peak is "
        "deterministic (tensor bytes, parameters and optimizer state included)."])  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
