"""Rehearsed vs measured: ``train --rehearse``'s peak per rank against the same step run for real on CPU.

Each row is a ``bench/plan_check.py`` setting at ZeRO 2 or 3 (FSDP2; stages 0-1 wrap the model in DDP, whose C++
reducer reads real memory, so they cannot be rehearsed): its techniques on both tiny text models, the hybrids,
packed documents and bf16 compute. The real side is ``plan_check.measure`` on 2 gloo ranks (the second optimizer
step under ``track_peak_memory``, which follows FSDP2's ``UntypedStorage.resize_``; the busiest rank); the
rehearsal is ``rehearse_run(cfg, gpus=2, device="cpu", ranks=(0, 1))`` on fake CPU tensors, in a process of its
own (its fake process group must not meet the real one). Run: ``python -m bench.rehearse_check [--cases N]``.
The last row is the HF Trainer path (``TRAINER``): ``Trainer.training_step`` after ``prepare()`` with ALST options
under FSDP2 (``rehearse.trainer``; accelerate keeps FSDP off on a CPU, so the real side wraps as the rehearsal
does), real on 2 gloo ranks vs ``rehearse_trainer``; ``--trainer-only`` runs that row alone.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import md
from bench.launch import ROOT, parser, run_worker, serve, under_torchrun
from bench.plan_check import HYBRIDS, SHORT, grid, hybrid_dir, measure_all

TOLERANCE = 0.05
TRAINER = {"trainer": True, "model": "tiny-llama", "seq_len": 2048, "sp": 2, "zero_stage": 3, "dtype": "bf16",
           "options": {"tiled_mlp": True, "tiled_loss": True, "offload_activations": True, "recompute_norms": True}}  # fmt: skip
"""The Trainer-path row: tiny-llama in a ``Trainer`` (bf16, gradient checkpointing), ``prepare()``'s ALST options."""


def _tiny_trainer() -> Any:
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from ulysses_sp import tasks

    config = tasks.preset_config("tiny-llama", vocab_size=tasks.VOCAB_SIZE)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    args = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="rehearse-check-"), use_cpu=True, report_to=[], bf16=True,
                             gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
                             per_device_train_batch_size=1, optim="adamw_torch")  # fmt: skip
    return Trainer(model=model, args=args)


def measure_trainer(c: dict[str, Any]) -> dict[str, Any]:
    """The Trainer path's second step for real on this 2-rank gloo group (``plan_check.measure``'s meter)."""
    from bench.launch import max_over_ranks
    from bench.plan_check import _opt_tensors
    from ulysses_sp.memory.meter import track_peak_memory
    from ulysses_sp.parallel.doc_layout import attach_layout
    from ulysses_sp.rehearse.trainer import trainer_batch, trainer_run_config, trainer_step_parts

    trainer = _tiny_trainer()
    cfg = trainer_run_config(trainer, sp_size=c["sp"], seq_len=c["seq_len"], **c["options"])
    build, make_engine, micro_step = trainer_step_parts(trainer, cfg, c["options"], gpus=2, device_type="cpu", empty=False)
    model, mesh = build()
    engine = make_engine(model, mesh)
    batch = trainer_batch(cfg, model.config.vocab_size, sp_rank=mesh.sp_rank, dp=2 // c["sp"])
    attach_layout(batch["position_ids"], batch.pop("_layout"))
    for _ in range(2):  # the second step: AdamW's state exists
        with track_peak_memory("cpu", include=[*model.parameters(), *_opt_tensors(engine.optimizer)]) as mem:
            micro_step(engine, batch)
            engine.step()
    return {"peak_bytes": max_over_ranks(mem.peak_bytes, mesh.reduce_group)}


def rehearse_trainer_row(c: dict[str, Any]) -> int:
    from ulysses_sp.rehearse.trainer import rehearse_trainer

    return rehearse_trainer(_tiny_trainer(), sp_size=c["sp"], seq_len=c["seq_len"], gpus=2, device="cpu", ranks=(0, 1),
                            **c["options"]).device_peak  # fmt: skip


def cases(*, create: bool = False) -> list[dict[str, Any]]:
    """plan_check's 12 technique settings on tiny-llama at ZeRO 3 and tiny-qwen2 at ZeRO 2; each hybrid at sp 1
    and sp 2 (checkpointing + tiled loss); packed documents and bf16 compute at sp 1 and 2."""
    rows = [{**c, "zero_stage": 3 if c["model"] == "tiny-llama" else 2} for c in grid()]
    for i, name in enumerate(HYBRIDS):
        path = hybrid_dir(name, create=create)
        rows += [{"model": path, "seq_len": 2048, "sp": 1, "zero_stage": 2 + i},
                 {"model": path, "seq_len": 2048, "sp": 2, "zero_stage": 3 - i, "tiled_loss": True,
                  "activation_checkpointing": True}]  # fmt: skip
    three = {"tiled_mlp": True, "tiled_loss": True, "activation_checkpointing": True}
    return rows + [{"model": "tiny-llama", "seq_len": 2048, "sp": sp, "zero_stage": z, **extra}
                   for z, sp in ((3, 2), (2, 1)) for extra in ({"packing": "best-fit"}, {"dtype": "bf16", **three})]  # fmt: skip


def rehearse_all(rows: list[dict[str, Any]]) -> list[int | str]:
    """The rehearsed device peak (max over ranks 0 and 1) of each row, in this process; for a step that
    reads a device value on the host (a fake tensor has none) the innermost library frame that read it."""
    from ulysses_sp.rehearse.fake import HostReadError
    from ulysses_sp.rehearse.run import rehearse_run
    from ulysses_sp.run.config import RunConfig

    out: list[int | str] = []
    for c in rows:
        if c.get("trainer"):
            out.append(rehearse_trainer_row(c))
            continue
        cfg = RunConfig(micro_batch_size=1, **c)
        try:
            out.append(rehearse_run(cfg, gpus=2, device="cpu", ranks=(0, 1)).device_peak)
        except HostReadError as e:  # 'File ".../ulysses_sp/attention/masks.py", line 70, in from_positions'
            frames = re.findall(r'ulysses_sp/([\w/]+\.py)", line (\d+), in (\w+)', str(e))
            where = [f"{fn} ({path}:{line})" for path, line, fn in frames[-1:]] or ["the step"]
            out.append(f"host read in {where[0]}")
    return out


def _rehearsed(n: int, extra: tuple[str, ...] = ()) -> list[int]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rehearsed.json"
        cmd = [sys.executable, "-m", "bench.rehearse_check", f"--cases={n}", *extra, "--rehearse-to", str(out)]
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, PYTHONWARNINGS="ignore")
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def _label(c: dict[str, Any]) -> list[Any]:
    if c.get("trainer"):
        return ["tiny-llama, HF Trainer + prepare()", c["seq_len"], c["sp"], c["zero_stage"],
                "+".join([*(SHORT.get(k, k) for k in c["options"]), "ckpt", c["dtype"]])]  # fmt: skip
    name = next((n for n in HYBRIDS if c["model"] == hybrid_dir(n)), c["model"])
    extra = [v for k, v in SHORT.items() if c.get(k)] + [c[k] for k in ("packing", "dtype") if k in c]
    return [name, c["seq_len"], c["sp"], c["zero_stage"], "+".join(extra) or "plain"]


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "rehearse_check.md")
    ap.add_argument("--cases", type=int, help="only the first N rows (a quick check)")
    ap.add_argument("--rehearse-to", help=argparse.SUPPRESS)  # the rehearsing process writes its peaks here
    ap.add_argument("--trainer-only", action="store_true", help="only the HF Trainer row")
    args = ap.parse_args(argv)
    rows = [TRAINER] if args.trainer_only else [*cases(create=not under_torchrun())[: args.cases], TRAINER]
    extra = ("--trainer-only",) if args.trainer_only else ()
    if args.rehearse_to:
        Path(args.rehearse_to).write_text(json.dumps(rehearse_all(rows)))
        return
    if serve(lambda: [measure_trainer(c) if c.get("trainer") else measure_all([c])[0] for c in rows], args.out):
        return
    run = md.provenance(md.command("bench.rehearse_check", argv))
    measured, _, _ = run_worker("bench.rehearse_check", 2, [f"--cases={len(rows)}", *extra], timeout=1800)
    rehearsed = _rehearsed(len(rows), extra)
    table, off = [], []
    for c, got, reh in zip(rows, measured, rehearsed):
        real = f"{got['peak_bytes'] / 2**20:.2f}"
        if isinstance(reh, str):  # not rehearsable: the reason
            off.append(f"{'/'.join(map(str, _label(c)))} ({reh})")
            table.append([*_label(c), real, f"not rehearsable: {reh}", "-"])
            continue
        ratio = reh / got["peak_bytes"]
        off += [f"{'/'.join(map(str, _label(c)))} ({ratio:.3f})"] if abs(ratio - 1) > TOLERANCE else []
        table.append([*_label(c), real, f"{reh / 2**20:.2f}", f"{ratio:.3f}"])
    worst = max((abs(float(r[-1]) - 1) for r in table if r[-1] != "-"), default=0.0)
    md.page(args.out, "rehearse_check: the rehearsal's peak vs the real CPU step's", run, [
        "2 gloo ranks on CPU, micro-batch 1, the second optimizer step (AdamW state exists). real = "
        "`track_peak_memory` around `plan_check.measure`'s step (busiest rank); rehearsed = `rehearse_run(cfg, "
        "gpus=2, device=\"cpu\")`'s device peak (ranks 0 and 1). ZeRO 0-1 (DDP) cannot be rehearsed: DDP's C++ "
        "reducer reads parameter memory that fake tensors do not have. The HF Trainer row: `Trainer.training_step` after "
        "`prepare()` under FSDP2 (the rehearsal's wrap; accelerate keeps FSDP off on a CPU) vs `rehearse_trainer`.",
        md.table(["model", "S", "sp", "zero", "techniques", "real MiB", "rehearsed MiB", "rehearsed/real"], table),
        f"Largest deviation: {worst:.1%} over {len(table)} settings; beyond {TOLERANCE:.0%} or not rehearsed: "
        f"{', '.join(off) or 'none'}."])  # fmt: skip


if __name__ == "__main__":
    main()
