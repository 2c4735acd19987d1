"""Bench: the HF Trainer path: step time vs a plain Trainer, and peak memory vs the CLI (ALST options).

``python -m bench.hf_trainer [--seq 2048] [--steps 6] [--rounds 3] [--mem-seq 1024]``, 2 processes. Time: plain
``Trainer`` (dp 2) vs ``prepare(trainer, sp_size=2)`` (dp 1, accumulation 2), same batches and work per rank,
alternating; per step wall, CPU, ``torch.distributed`` time and calls (Python-level: DDP's C++ ones unseen).
Memory: per ALST technique, the busiest rank's peak in the last of 3 steps, Trainer path vs the CLI's loop, same settings.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from datasets import Dataset
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

from bench import md
from bench.counters import SENT, CallTimer, CollectiveCounter
from bench.launch import finish_worker, init_worker, max_over_ranks, run_worker, under_torchrun
from bench.spec import llama
from ulysses_sp.integrations.transformers import prepare
from ulysses_sp.memory.meter import track_peak_memory
from ulysses_sp.run.config import RunConfig
from ulysses_sp.run.loop import run as run_cli

SMALL = dict(vocab_size=259, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
WIDE = dict(vocab_size=8192, hidden_size=64, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)
CKPT, OFF = {"gradient_checkpointing": True}, {"activation_checkpointing": True, "offload_activations": True}
ALL, TL, TM, UO = {"tiled_loss": True, "tiled_mlp": True, "offload_attention": True}, {"tiled_loss": True}, {"tiled_mlp": True}, {"offload_attention": True}
TECHNIQUES = {  # name: (prepare() options, TrainingArguments fields, the CLI's RunConfig fields)
    "SP only": ({}, {}, {}), "tiled loss": (TL, {}, TL), "tiled MLP": (TM, {}, TM), "Ulysses-Offload": (UO, {}, UO),
    "checkpointing": ({}, CKPT, {"activation_checkpointing": True}), "checkpointing + offload": ({"offload_activations": True}, CKPT, OFF),
    "bf16": ({}, {"bf16": True}, {"dtype": "bf16"}), "all, fp32": ({**ALL, "offload_activations": True}, CKPT, {**ALL, **OFF})}  # fmt: skip


def train(model, rows, *, sp: int, steps: int, options: dict, fields: dict, meter: bool) -> dict:
    class Probe(TrainerCallback):  # (wall, CPU, in collectives) at each step's end; each step's peak
        ends, peaks = [], []  # a class per train() call
        def on_step_begin(self, args, state, control, **kw):
            self.cm = track_peak_memory(args.device) if meter else contextlib.nullcontext()
            self.mem = self.cm.__enter__()

        def on_step_end(self, args, state, control, **kw):
            self.ends.append((time.perf_counter(), time.process_time(), sum(t.seconds for t in timers)))
            self.cm.__exit__(None, None, None)
            self.peaks += [self.mem.peak_bytes] if meter else []

    with tempfile.TemporaryDirectory() as out, contextlib.ExitStack() as stack:
        args = TrainingArguments(output_dir=out, use_cpu=not torch.accelerator.is_available(), report_to=[], seed=0,
            save_strategy="no", max_steps=steps, per_device_train_batch_size=1, gradient_accumulation_steps=sp,
            logging_steps=1, learning_rate=1e-3, disable_tqdm=True, optim="adamw_torch",  # the CLI's AdamW, unfused
            gradient_checkpointing_kwargs={"use_reentrant": False}, **fields)  # fmt: skip
        trainer = Trainer(model=model, args=args, train_dataset=Dataset.from_list(rows), callbacks=[probe := Probe()])
        handle = prepare(trainer, sp_size=sp, **options) if sp > 1 else None
        counter, timers = stack.enter_context(CollectiveCounter()), [stack.enter_context(CallTimer(dist, op)) for op in SENT]
        trainer.train()
        _ = handle and handle.remove()
    return {"times": [[b - a for a, b in zip(x, y)] for x, y in zip(probe.ends, probe.ends[1:])], "peak": probe.peaks[-1] if probe.peaks else 0,
            "calls": {op: n / steps for (_, op), n in counter.calls.items()}, "loss": trainer.state.log_history[-2]["loss"]}  # fmt: skip


def worker(seq: int, steps: int, rounds: int, mem_seq: int) -> dict:
    g, runs, res = torch.Generator().manual_seed(0), {1: [], 2: []}, {"memory": {}}
    rows = lambda n, s: [{"input_ids": x, "labels": x} for x in torch.randint(0, 256, (n, s), generator=g).tolist()]  # noqa: E731
    data = rows(2 * steps + 2, seq)  # the same batches for both runs
    for sp in [1, 2] * rounds:
        runs[sp].append(train(llama(**SMALL, max_position_embeddings=seq), data, sp=sp, steps=steps, options={}, fields={}, meter=False))
    med = lambda rs: [statistics.median(t[i] for r in rs for t in r["times"]) for i in range(3)]  # noqa: E731
    res["time"] = {sp: {"step_s": med(rs), "calls": rs[0]["calls"], "loss": rs[0]["loss"]} for sp, rs in runs.items()}
    dist.broadcast_object_list(tmp := [tempfile.mkdtemp(prefix="hf-trainer-bench-") if dist.get_rank() == 0 else None])
    _ = dist.get_rank() == 0 and llama(**WIDE, max_position_embeddings=mem_seq).save_pretrained(f"{tmp[0]}/model")
    dist.barrier()
    for i, (name, (options, fields, cli)) in enumerate(TECHNIQUES.items()):
        cfg = RunConfig(model=f"{tmp[0]}/model", seq_len=mem_seq, sp=2, steps=3, micro_batch_size=1, grad_accum=2, output_dir=f"{tmp[0]}/cli{i}", tokenizer="byte", progress=False, **cli)  # fmt: skip
        run_cli(cfg)
        # the last step: in the second, the CLI's DDP rebuilds its gradient buckets (reducer._rebuild_buckets),
        # which the CPU meter sees allocated but not the old ones (made at construction) freed
        cli_peak = json.loads(Path(cfg.metrics_path).read_text().splitlines()[-1])["peak_mem_bytes"]
        model = AutoModelForCausalLM.from_pretrained(f"{tmp[0]}/model", attn_implementation="sdpa")  # the CLI's weights
        got = train(model, rows(8, mem_seq), sp=2, steps=3, options=options, fields=fields, meter=True)
        res["memory"][name] = [int(max_over_ranks(got["peak"])), cli_peak]  # the last collective of both ranks
    _ = dist.get_rank() == 0 and shutil.rmtree(tmp[0])
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--seq", 2048), ("--steps", 6), ("--rounds", 3), ("--mem-seq", 1024)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--out", default=str(md.ROOT / "bench" / "results" / "hf_trainer.md"))
    a = ap.parse_args(argv)
    flags = [x for f in ("seq", "steps", "rounds", "mem_seq") for x in (f"--{f.replace('_', '-')}", str(getattr(a, f)))]
    if under_torchrun():
        init_worker()
        return finish_worker(worker(a.seq, a.steps, a.rounds, a.mem_seq), a.out)
    run = md.provenance("python -m bench.hf_trainer " + " ".join(flags))
    t, mem = (res := run_worker("bench.hf_trainer", 2, flags, timeout=1800)[0])["time"], res["memory"]
    base, ops = t["1"]["step_s"], sorted({op for r in t.values() for op in r["calls"]})  # JSON keys: "1", "2"
    trows = [[("Trainer (dp 2)", "Trainer + prepare(sp_size=2) (dp 1)")[sp == "2"], a.seq // int(sp), *(f"{x * 1e3:.0f} ({x / b:.2f}x)" for x, b in zip(r["step_s"], base)),
              *(f"{r['calls'].get(op, 0):g}" for op in ops), f"{r['loss']:.4f}"] for sp, r in t.items()]  # fmt: skip
    md.page(a.out, "HF Trainer path: overhead and ALST memory", run, [
        f"## Step time\n\nLlama h=128, 2 layers, fp32, 2 x {a.seq} tokens per step; medians over {a.rounds} alternating "
        f"rounds of {a.steps} steps (each run's first dropped); a shared 2-core CPU machine, not a GPU projection.",
        md.table(["run", "tokens per rank per micro-step", "step ms, wall (vs plain)", "CPU ms (vs plain)",
                  "ms in collectives (vs plain)", *(f"{op} per step" for op in ops), "last loss"], trows),
        f"## Peak memory per rank, Trainer path vs CLI\n\nsp 2, dp 1, Llama h=64, MLP 512, 2 layers, vocab 8192, "
        f"2 x {a.mem_seq} tokens per step (accumulation 2), AdamW; the last of 3 steps (host copies not counted; "
        f"in the second the CLI's DDP rebuilds its gradient buckets, new bytes to the CPU meter).",
        md.table(["technique", "Trainer + prepare() MiB", "CLI (ulysses-sp train) MiB", "Trainer / CLI"],
                 [[k, f"{p / 2**20:.1f}", f"{c / 2**20:.1f}", f"{p / c:.2f}"] for k, (p, c) in mem.items()])])  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
