"""Predicted vs measured: the planner's peak per rank and comm share against real training steps.

Each case builds the run's model with its techniques and engine exactly as ``ulysses-sp train`` does
(``run.model_checks.apply_techniques``, ``register_with_transformers``, ``initialize``), takes one warm-up optimizer step (the
AdamW state then exists, as in every later step), and measures the second step with
``ulysses_sp.memory.meter.track_peak_memory`` (parameters and optimizer state counted in the baseline) and
``comm_timing.record_comm_times``. The prediction is ``plan.predict`` for the same settings, less what the CPU
tracker cannot see: DDP's gradient buckets (allocated at construction, outside any aten op) and the reserve.
FSDP2 (ZeRO 2-3) is measured on CPU (the tracker follows the ``UntypedStorage.resize_`` that allocates its
unsharded parameters) against the rehearsal in ``bench/rehearse_check.py``, which reuses ``measure``.

bf16 compute (``bf16_grid``: FSDP2's bf16 residual stream, which ZeRO 0-1 autocast does not have) is
checked in one process, the activation phases only (``measure_bf16``), with and without norm recompute.

Hybrid models (``HYBRIDS``: a Mamba-2 and a gated delta-net hybrid) are checked the same way, at sp 1 and 2,
two lengths each (``hybrid_grid``). Run: ``python -m bench.plan_check [--cases N]`` (2-3 minutes).
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM

from bench import md
from bench.launch import max_over_ranks, parser, run_worker, serve, under_torchrun
from ulysses_sp import tasks
from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
from ulysses_sp.cli.plan import load_shape  # what `ulysses-sp plan` reads: layer kinds and mixers too
from ulysses_sp.data.shard import prepare_batch, shard_batch
from ulysses_sp.engine import initialize
from ulysses_sp.memory.meter import track_peak_memory
from ulysses_sp.parallel.comm_timing import record_comm_times
from ulysses_sp.parallel.doc_layout import attach_layout, host_layout
from ulysses_sp.parallel.loss import sp_causal_lm_loss
from ulysses_sp.parallel.mesh import init_mesh
from ulysses_sp.plan.hardware import DEVICES
from ulysses_sp.plan.inputs import Settings
from ulysses_sp.plan.model import memory, predict
from ulysses_sp.rehearse.run import synthetic_batch
from ulysses_sp.run.config import RunConfig
from ulysses_sp.run.loop import micro_step
from ulysses_sp.run.model_checks import apply_techniques, sp_attention_wanted

CASES_TECH: list[dict[str, bool]] = [
    {}, {"activation_checkpointing": True}, {"activation_checkpointing": True, "offload_activations": True},
    {"tiled_mlp": True}, {"tiled_loss": True},
    {"tiled_mlp": True, "tiled_loss": True, "activation_checkpointing": True, "offload_activations": True},
]  # fmt: skip
SHORT = {"tiled_mlp": "mlp", "tiled_loss": "loss", "activation_checkpointing": "ckpt", "offload_activations": "offload",
         "recompute_norms": "norms"}  # fmt: skip


def grid() -> list[dict[str, Any]]:
    """The checked settings (2 ranks each): >= 20, two architectures, both sp, both DDP stages."""
    three = {"tiled_mlp": True, "tiled_loss": True, "activation_checkpointing": True}
    return [{"model": model, **case} for model in ("tiny-llama", "tiny-qwen2") for case in (
        *({"seq_len": 2048, "sp": 2, "zero_stage": 0, **tech} for tech in CASES_TECH),
        {"seq_len": 1024, "sp": 1, "zero_stage": 1}, {"seq_len": 4096, "sp": 2, "zero_stage": 1, "tiled_loss": True},
        {"seq_len": 2048, "sp": 1, "zero_stage": 0, **three}, {"seq_len": 4096, "sp": 2, "zero_stage": 0, **three},
        {"seq_len": 2048, "sp": 2, "zero_stage": 0, "activation_checkpointing": True, "recompute_norms": True},
        {"seq_len": 2048, "sp": 1, "zero_stage": 0, **three, "recompute_norms": True})]


_COMMON = dict(vocab_size=264, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
               max_position_embeddings=1 << 17, tie_word_embeddings=False)  # fmt: skip
HYBRIDS: dict[str, tuple[str, dict[str, Any]]] = {
    # Mamba-2 hybrid: 3 Mamba-2 layers (8 heads x 16, state 16, 2 groups, chunk 64) and 1 attention layer
    "tiny-bamba": ("BambaConfig", dict(num_hidden_layers=4, attn_layer_indices=[3], mamba_expand=2, mamba_n_heads=8,
                   mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=64, mamba_d_conv=4)),
    # gated delta-net hybrid: 3 linear layers (2 key / 4 value heads x 16) and 1 gated attention layer
    "tiny-qwen3.5": ("Qwen3_5TextConfig", dict(num_hidden_layers=4, layer_types=["linear_attention"] * 3 +
                     ["full_attention"], head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)),
}  # fmt: skip
"""Hybrid models (transformers' own Bamba and Qwen3.5 code), saved as local model directories."""


def hybrid_dir(name: str, *, create: bool = False) -> str:
    """The local model directory of ``HYBRIDS[name]`` (under the temp dir; written when ``create``)."""
    path = os.path.join(tempfile.gettempdir(), "ulysses-sp-plan-check", name)
    if create and not os.path.isfile(os.path.join(path, "config.json")):
        cls, kw = HYBRIDS[name]
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(getattr(transformers, cls)(**_COMMON, **kw)).save_pretrained(path)
    return path


def hybrid_grid(*, create: bool = False) -> list[dict[str, Any]]:
    """Each hybrid at sp 1 (S 1024, 2048) and sp 2 (S 2048, 4096), DDP; and at sp 2 with ZeRO 1,
    checkpointing and the tiled loss."""
    cases = [{"model": hybrid_dir(name, create=create), "seq_len": s, "sp": sp, "zero_stage": 0}
             for name in HYBRIDS for sp, lengths in ((1, (1024, 2048)), (2, (2048, 4096))) for s in lengths]  # fmt: skip
    return cases + [{"model": hybrid_dir(name), "seq_len": 2048, "sp": 2, "zero_stage": 1, "tiled_loss": True,
                     "activation_checkpointing": True} for name in HYBRIDS]  # fmt: skip


def bf16_grid() -> list[dict[str, Any]]:
    """16-bit compute as FSDP2's ``param_dtype`` runs it (a bf16 residual stream; ZeRO 0-1 autocast keeps
    an fp32 stream): checkpointing, and every technique, each with and
    without norm recompute, one rank, the activation phases only (``measure_bf16``)."""
    three = {"tiled_mlp": True, "tiled_loss": True, "activation_checkpointing": True}
    return [{"model": model, "seq_len": 2048, "sp": 1, "zero_stage": 0, "dtype": "bf16", **tech, "recompute_norms": r}
            for model in ("tiny-llama", "tiny-qwen2") for tech in ({"activation_checkpointing": True}, three)
            for r in (False, True)]  # fmt: skip


def measure_bf16(case: dict[str, Any]) -> int:
    """One forward + backward of ``case``'s model cast to bf16 (what each FSDP2 unit computes with under
    ``MixedPrecisionPolicy(param_dtype=bf16)``), its techniques as ``train`` applies them, in this process:
    the peak bytes above the parameters (activations, workspaces and the bf16 gradients made so far)."""
    cfg = RunConfig(micro_batch_size=1, **case)
    model = tasks.build_model(cfg.model, vocab_size=len(tasks.load_tokenizer(None, cfg.model)), seed=0)
    model = model.to(torch.bfloat16).train()
    handles, loss_fn = apply_techniques(cfg, model)
    s = cfg.seq_len
    ids = torch.randint(0, 250, (1, s), generator=torch.Generator().manual_seed(0))
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)
    batch = {"input_ids": ids, "position_ids": torch.arange(s)[None]}
    try:
        with track_peak_memory("cpu", include=model.parameters()) as mem:
            if loss_fn is None:  # the output (logits) freed before backward, as the training loop does
                loss = sp_causal_lm_loss(model(**batch).logits, labels, None)
            else:
                loss = loss_fn(model, batch, labels, None).loss
            loss.backward()
    finally:
        for h in handles:
            h.remove()
    return mem.peak_bytes - mem.baseline_bytes


def predict_bf16(case: dict[str, Any]) -> int:
    """The planner's activation phases for ``case`` (no model states: ``measure_bf16`` takes no step)."""
    b, _ = memory(load_shape(case["model"]), Settings(**{k: v for k, v in case.items() if k != "model"},
                                                      device_type="cpu"))  # fmt: skip
    return b["activations"] + b["logits_loss"] + b["backward_workspace"] + b["grads_in_flight"]


def _opt_tensors(optimizer) -> list:
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer wraps the local one
    return [t for st in inner.state.values() for t in st.values() if isinstance(t, torch.Tensor)]


def measure(case: dict[str, Any]) -> dict[str, Any]:
    """On every rank of an initialised 2-rank group: the second step's peak and comm times."""
    cfg = RunConfig(micro_batch_size=1, zero_partition="data_parallel", **case)  # the planner Settings' default
    s, sp = cfg.seq_len, cfg.sp
    mesh = init_mesh(sp_size=sp)
    model = tasks.build_model(cfg.model, vocab_size=len(tasks.load_tokenizer(None, cfg.model)), seed=0)
    handles, loss_fn = apply_techniques(cfg, model)
    mpu = None
    if sp_attention_wanted(cfg, model.config):  # as `train` decides: at sp 1 too, for plain text models
        mpu = UlyssesSPAttentionHF.register_with_transformers(model, cfg.attn, sp, 1, seq_length=s, mesh=mesh)
    engine, *_ = initialize(model, cfg.training_config(), mpu=mpu or mesh.mpu, loss_fn=loss_fn)
    engine.train()  # as the training loop does (a model directory loads in eval mode: no checkpointing)
    # what the data adapter yields, as the rehearsal draws it (packed documents with `packing`)
    prepared = prepare_batch(synthetic_batch(cfg, model.config.vocab_size, seed=mesh.dp_rank), sp)
    batch = shard_batch(prepared, mesh.sp_rank, sp)
    attach_layout(batch["position_ids"], host_layout(prepared["position_ids"]))

    def step() -> None:  # the training loop's micro-step: the output (logits) freed before backward
        micro_step(engine, batch)
        engine.step()

    try:
        step()
        t0 = time.perf_counter()
        with track_peak_memory("cpu", include=[*model.parameters(), *_opt_tensors(engine.optimizer)]) as mem:
            with record_comm_times(mesh.device) as times:
                step()
        dt = time.perf_counter() - t0
    finally:
        for h in [*handles, *(x for x in (engine.mixers, mpu) if x is not None)]:  # the mixers: their modules' functions
            h.remove()
    return {"peak_bytes": max_over_ranks(mem.peak_bytes, mesh.reduce_group), "host_peak_bytes": mem.host_peak_bytes,
            "comm_s": times.sp, "dp_comm_s": times.dp, "step_s": dt, "comm_share": (times.sp + times.dp) / dt}  # fmt: skip


def predict_case(case: dict[str, Any], world: int = 2) -> dict[str, Any]:
    """The planner's numbers for ``case``, and the part the CPU tracker can see."""
    shape = load_shape(case["model"])
    settings = Settings(**{k: v for k, v in case.items() if k != "model"}, dp=world // case["sp"], device_type="cpu")
    pred = predict(shape, settings, DEVICES["cpu"])
    trackable = pred.peak_bytes - pred.breakdown["comm_buffers"] - pred.breakdown["reserve"]
    return {"peak_bytes": pred.peak_bytes, "trackable_bytes": trackable, "host_bytes": pred.host_bytes,
            "comm_share": pred.comm_share}  # fmt: skip


def measure_all(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``measure`` for each case, in one process group (one pool call for the whole grid)."""
    return [measure(c) for c in cases]


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "plan_check.md")
    ap.add_argument("--cases", type=int, help="only the first N settings of the grid (a quick check)")
    args = ap.parse_args(argv)
    cases = (grid() + hybrid_grid(create=not under_torchrun()))[: args.cases]
    if serve(lambda: measure_all(cases), args.out):
        return
    run = md.provenance(md.command("bench.plan_check", argv))
    measured, _, _ = run_worker("bench.plan_check", 2, [f"--cases={len(cases)}"], timeout=1800)
    rows, worst = [], 0.0
    for case, got in zip(cases, measured):
        pred = predict_case(case)
        ratio = pred["trackable_bytes"] / got["peak_bytes"]
        worst = max(worst, abs(ratio - 1))
        name = next((n for n in HYBRIDS if case["model"] == hybrid_dir(n)), case["model"])
        rows.append([name, case["seq_len"], case["sp"], case["zero_stage"],
                     "+".join(v for k, v in SHORT.items() if case.get(k)) or "plain",
                     f"{pred['trackable_bytes'] / 2**20:.2f}", f"{got['peak_bytes'] / 2**20:.2f}", f"{ratio:.3f}",
                     f"{pred['host_bytes'] / 2**20:.2f} / {got['host_peak_bytes'] / 2**20:.2f}",
                     f"{pred['comm_share']:.0%}", f"{got['comm_share']:.0%}"])  # fmt: skip
    md.page(args.out, "plan_check: predicted vs measured peak per rank and comm share", run, [
        "2 gloo ranks on CPU, fp32, micro-batch 1, second optimizer step (AdamW state exists). Predicted = "
        "`plan.predict` less DDP's gradient buckets (invisible to the CPU tracker); measured = "
        "`track_peak_memory` (busiest rank). comm share: measured with `record_comm_times` on gloo/CPU "
        "vs the planner's CPU row of `plan.hardware.DEVICES` (a rough guess: not expected to agree). "
        "tiny-bamba (Mamba-2 hybrid) and tiny-qwen3.5 (gated delta-net hybrid): `HYBRIDS`, the planner reading "
        "their layer kinds as `ulysses-sp plan` does (`plan.mixers`: the measured mixer terms).",
        md.table(["model", "S", "sp", "zero", "techniques", "predicted MiB", "measured MiB", "pred/meas",
                  "host MiB pred/meas", "comm share pred", "comm share meas"], rows),
        f"Largest deviation: {worst:.1%} over {len(cases)} settings.", *_bf16_section()])  # fmt: skip


def _bf16_section() -> list[str]:
    """The ``bf16_grid`` rows: predicted vs measured activation phases (one process)."""
    rows, worst = [], 0.0
    for case in bf16_grid():
        pred, got = predict_bf16(case), measure_bf16(case)
        worst = max(worst, abs(pred / got - 1))
        rows.append([case["model"], case["seq_len"], "+".join(v for k, v in SHORT.items() if case.get(k)),
                     f"{pred / 2**20:.2f}", f"{got / 2**20:.2f}", f"{pred / got:.3f}"])  # fmt: skip
    return ["bf16 compute (`bf16_grid`: the model cast to bf16 as FSDP2's `param_dtype` computes, one process, "
            "forward + backward; the activation phases without model states):",
            md.table(["model", "S", "techniques", "predicted MiB", "measured MiB", "pred/meas"], rows),
            f"Largest deviation (bf16): {worst:.1%} over {len(rows)} settings."]  # fmt: skip


if __name__ == "__main__":
    main()
