"""Predicted vs measured: the planner's peak per rank and comm share against real training steps.

Each case builds the run's model with its techniques and engine exactly as ``ulysses-sp train``
does (``train._techniques``, ``register_with_transformers``, ``initialize``), takes one warm-up
optimizer step (the AdamW state then exists, as in every later step), and measures the second step
with ``ulysses_sp.memory.meter.track_peak_memory`` (parameters and optimizer state counted in the
baseline) and ``comm_timing.record_comm_times``. The prediction is ``plan.predict`` for the same settings,
less what the CPU tracker cannot see: DDP's gradient buckets (allocated at construction, outside any
aten op) and the reserve. FSDP2 (ZeRO 2-3) is left out on CPU: its unsharded parameters are
allocated with ``UntypedStorage.resize_``, invisible to the tracker (``memory.py``'s blind spots).

    python -m bench.plan_check [--cases N] [--out bench/results/plan_check.md]    # ~1-2 min
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from bench import md
from bench.launch import finish_worker, init_worker, run_worker, under_torchrun

CASES_TECH: list[dict[str, bool]] = [
    {}, {"activation_checkpointing": True}, {"activation_checkpointing": True, "offload_activations": True},
    {"tiled_mlp": True}, {"tiled_loss": True},
    {"tiled_mlp": True, "tiled_loss": True, "activation_checkpointing": True, "offload_activations": True},
]  # fmt: skip
SHORT = {"tiled_mlp": "mlp", "tiled_loss": "loss", "activation_checkpointing": "ckpt", "offload_activations": "offload"}


def grid() -> list[dict[str, Any]]:
    """The checked settings (2 ranks each): >= 20, two architectures, both sp, both DDP stages."""
    cases = []
    for model in ("tiny-llama", "tiny-qwen2"):
        for tech in CASES_TECH:
            cases.append({"model": model, "seq_len": 2048, "sp": 2, "zero_stage": 0, **tech})
        cases.append({"model": model, "seq_len": 1024, "sp": 1, "zero_stage": 1})
        cases.append({"model": model, "seq_len": 4096, "sp": 2, "zero_stage": 1, "tiled_loss": True})
        cases.append({"model": model, "seq_len": 2048, "sp": 1, "zero_stage": 0, "tiled_mlp": True,
                      "tiled_loss": True, "activation_checkpointing": True})  # fmt: skip
        cases.append({"model": model, "seq_len": 4096, "sp": 2, "zero_stage": 0, "tiled_mlp": True,
                      "tiled_loss": True, "activation_checkpointing": True})  # fmt: skip
    return cases


def _opt_tensors(optimizer) -> list:
    import torch

    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer wraps the local one
    return [t for st in inner.state.values() for t in st.values() if isinstance(t, torch.Tensor)]


def measure(case: dict[str, Any]) -> dict[str, Any]:
    """On every rank of an initialised 2-rank group: the second step's peak and comm times."""
    import time

    import torch

    from ulysses_sp import tasks
    from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
    from ulysses_sp.engine import initialize
    from ulysses_sp.memory.meter import track_peak_memory
    from ulysses_sp.parallel.comm import all_reduce_max
    from ulysses_sp.parallel.comm_timing import record_comm_times
    from ulysses_sp.parallel.mesh import init_mesh
    from ulysses_sp.run.config import TrainConfig
    from ulysses_sp.run.loop import _techniques

    cfg = TrainConfig(micro_batch_size=1, **case)
    s, sp = cfg.seq_len, cfg.sp
    mesh = init_mesh(sp_size=sp)
    model = tasks.build_model(cfg.model, vocab_size=len(tasks.load_tokenizer(None, cfg.model)), seed=0)
    handles, loss_fn = _techniques(cfg, model)
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1, seq_length=s, mesh=mesh) if sp > 1 else None
    engine, *_ = initialize(model, cfg.training_config(), mpu=mpu or mesh.mpu, loss_fn=loss_fn)
    ids = torch.randint(0, 250, (1, s), generator=torch.Generator().manual_seed(mesh.dp_rank))
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)
    cols = slice(mesh.sp_rank * s // sp, (mesh.sp_rank + 1) * s // sp)
    batch = {"input_ids": ids[:, cols], "position_ids": torch.arange(s)[cols][None], "shift_labels": labels[:, cols]}

    def step() -> None:
        out = engine(**batch)
        engine.backward(out.loss)
        engine.step()

    try:
        step()
        t0 = time.perf_counter()
        with track_peak_memory("cpu", include=[*model.parameters(), *_opt_tensors(engine.optimizer)]) as mem:
            with record_comm_times(mesh.device) as times:
                step()
        dt = time.perf_counter() - t0
    finally:
        for h in handles:
            h.remove()
        if mpu is not None:
            mpu.remove()
    peak = int(all_reduce_max(torch.tensor(mem.peak_bytes), mesh.reduce_group).item())
    return {"peak_bytes": peak, "host_peak_bytes": mem.host_peak_bytes, "comm_s": times.sp,
            "dp_comm_s": times.dp, "step_s": dt, "comm_share": (times.sp + times.dp) / dt}  # fmt: skip


def predict_case(case: dict[str, Any], world: int = 2) -> dict[str, Any]:
    """The planner's numbers for ``case``, and the part the CPU tracker can see."""
    from ulysses_sp.cli.plan import load_shape  # what `ulysses-sp plan` reads: layer kinds and mixers too
    from ulysses_sp.plan.hardware import DEVICES
    from ulysses_sp.plan.inputs import Settings
    from ulysses_sp.plan.model import predict

    shape = load_shape(case["model"])
    settings = Settings(
        **{k: v for k, v in case.items() if k != "model"}, dp=world // case["sp"], device_type="cpu"
    )
    pred = predict(shape, settings, DEVICES["cpu"])
    trackable = pred.peak_bytes - pred.breakdown["comm_buffers"] - pred.breakdown["reserve"]
    return {"peak_bytes": pred.peak_bytes, "trackable_bytes": trackable, "host_bytes": pred.host_bytes,
            "comm_share": pred.comm_share}  # fmt: skip


def measure_all(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``measure`` for each case, in one process group (one pool call for the whole grid)."""
    return [measure(c) for c in cases]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, help="only the first N settings of the grid (a quick check)")
    ap.add_argument("--out", default=str(md.ROOT / "bench" / "results" / "plan_check.md"))
    args = ap.parse_args(argv)
    cases = grid()[: args.cases]
    if under_torchrun():
        init_worker()
        return finish_worker(measure_all(cases), args.out)
    run = md.provenance(" ".join(["python -m bench.plan_check", *(argv if argv is not None else sys.argv[1:])]))
    measured, _, _ = run_worker("bench.plan_check", 2, [f"--cases={len(cases)}"], timeout=1800)
    rows, worst = [], 0.0
    for case, got in zip(cases, measured):
        pred = predict_case(case)
        ratio = pred["trackable_bytes"] / got["peak_bytes"]
        worst = max(worst, abs(ratio - 1))
        rows.append([case["model"], case["seq_len"], case["sp"], case["zero_stage"],
                     "+".join(v for k, v in SHORT.items() if case.get(k)) or "plain",
                     f"{pred['trackable_bytes'] / 2**20:.2f}", f"{got['peak_bytes'] / 2**20:.2f}", f"{ratio:.3f}",
                     f"{pred['host_bytes'] / 2**20:.2f} / {got['host_peak_bytes'] / 2**20:.2f}",
                     f"{pred['comm_share']:.0%}", f"{got['comm_share']:.0%}"])  # fmt: skip
    md.page(args.out, "plan_check: predicted vs measured peak per rank and comm share", run, [
        "2 gloo ranks on CPU, fp32, micro-batch 1, second optimizer step (AdamW state exists). Predicted = "
        "`plan.predict` less DDP's gradient buckets (invisible to the CPU tracker); measured = "
        "`track_peak_memory` (busiest rank). comm share: measured with `record_comm_times` on gloo/CPU "
        "vs the planner's CPU row of `plan.hardware.DEVICES` (a rough guess: not expected to agree).",
        md.table(["model", "S", "sp", "zero", "techniques", "predicted MiB", "measured MiB", "pred/meas",
                  "host MiB pred/meas", "comm share pred", "comm share meas"], rows),
        f"Largest deviation: {worst:.1%} over {len(cases)} settings."])  # fmt: skip


if __name__ == "__main__":
    main()
