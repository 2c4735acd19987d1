"""Rehearsed vs measured: ``train --rehearse``'s peak per rank against the same step run for real on CPU.

Each row is a ``bench/plan_check.py`` setting at ZeRO 2 or 3 (FSDP2; stages 0-1 wrap the model in DDP, whose C++
reducer reads real memory, so they cannot be rehearsed): its techniques on both tiny text models, the hybrids,
packed documents, bf16 compute and a tiny Qwen2.5-VL with 4 images (``measure_vlm``). The real side is ``plan_check.measure`` on 2 gloo ranks (the second optimizer
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
from bench.launch import ROOT, max_over_ranks, parser, run_worker, serve, under_torchrun
from bench.plan_check import HYBRIDS, SHORT, _opt_tensors, grid, hybrid_dir, measure_all

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
                   for z, sp in ((3, 2), (2, 1)) for extra in ({"packing": "best-fit"}, {"dtype": "bf16", **three})] + [
        {"model": vlm_dir(create=create), "seq_len": 2048, "sp": 2, "zero_stage": 3, "zero_partition": "all", "images": 4, "image_size": [256, 256]}]  # fmt: skip


def vlm_dir(*, create: bool = False) -> str:
    """A tiny Qwen2.5-VL's config directory (text h 128, 4 layers; tower h 64, depth 4; patch 14, merge 2)."""
    path = os.path.join(tempfile.gettempdir(), "ulysses-sp-plan-check", "tiny-qwen2.5-vl")
    if create and not os.path.isfile(os.path.join(path, "config.json")):
        from transformers import Qwen2_5_VLConfig

        Qwen2_5_VLConfig(text_config=dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 6, 6]}),
                         vision_config=dict(depth=4, hidden_size=64, intermediate_size=128, num_heads=4, patch_size=14,
                         spatial_merge_size=2, window_size=112, out_hidden_size=128, fullatt_block_indexes=[3]),
                         image_token_id=1000, video_token_id=1001, vision_start_token_id=1002,
                         vision_end_token_id=1003).save_pretrained(path)  # fmt: skip
    return path


def measure_vlm(case: dict[str, Any]) -> dict[str, Any]:
    """``plan_check.measure`` for a VLM row: train's model, shard, engine and micro-step on the rehearsal's image batch."""
    import torch

    from ulysses_sp.engine import initialize
    from ulysses_sp.memory.meter import track_peak_memory
    from ulysses_sp.parallel.mesh import init_mesh
    from ulysses_sp.rehearse.vlm import rank_batch, synthetic_vlm_batch
    from ulysses_sp.run.config import RunConfig
    from ulysses_sp.run.loop import micro_step, register_attention
    from ulysses_sp.run.model_checks import apply_techniques
    from ulysses_sp.run.vlm import vlm_shard
    from ulysses_sp.state.model_dir import auto_model_class, load_config

    c = {k: v for k, v in case.items() if k not in ("images", "image_size")}
    cfg, config = RunConfig(micro_batch_size=1, **{"zero_partition": "data_parallel", **c}), load_config(case["model"])
    mesh = init_mesh(sp_size=cfg.sp)
    torch.manual_seed(0)
    model = auto_model_class(config).from_config(config, attn_implementation=cfg.attn)
    _, loss_fn = apply_techniques(cfg, model)
    mpu = register_attention(cfg, model, config, mesh)
    vlm_shard(cfg, model, mesh)
    engine, *_ = initialize(model, cfg.training_config(), mpu=mpu or mesh.mpu, loss_fn=loss_fn)
    engine.train()
    batch = synthetic_vlm_batch(cfg, config, images=case["images"], image_size=tuple(case["image_size"]))
    batch.update({k: torch.randn(v.shape) for k, v in batch.items() if k == "pixel_values"})  # real pixels, held before the step
    local = rank_batch(cfg, model, batch, mesh.sp_rank)
    local.pop("_layout").attach(local)  # as the adapter yields it: the host layout on its input_ids
    step = lambda: (micro_step(engine, local), engine.step())  # noqa: E731
    step()
    with track_peak_memory("cpu", include=[*model.parameters(), *_opt_tensors(engine.optimizer)]) as mem:
        step()
    return {"peak_bytes": max_over_ranks(mem.peak_bytes, mesh.reduce_group)}


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
        images = {k: c.pop(k) for k in ("images", "image_size") if k in c}  # a VLM row's synthetic image load
        cfg = RunConfig(micro_batch_size=1, **{"zero_partition": "data_parallel", **c})  # as plan_check.measure
        try:
            out.append(rehearse_run(cfg, gpus=2, device="cpu", ranks=(0, 1), images=images.get("images"),
                                    image_size=tuple(images.get("image_size", ())) or None).device_peak)  # fmt: skip
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
    name = next((n for n in HYBRIDS if c["model"] == hybrid_dir(n)), c["model"]).replace(vlm_dir(), "tiny-qwen2.5-vl")
    extra = [v for k, v in SHORT.items() if c.get(k)] + [c[k] for k in ("packing", "dtype") if k in c]
    extra += [f"{c['images']} images {'x'.join(map(str, c['image_size']))}"] if "images" in c else []
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
    measure = {True: measure_trainer, False: lambda c: measure_vlm(c) if "images" in c else measure_all([c])[0]}
    if serve(lambda: [measure[bool(c.get("trainer"))](c) for c in rows], args.out):
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
