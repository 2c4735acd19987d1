"""Scaling projection: Llama-8B on 80 GB GPUs, by the library's planner (``ulysses_sp.plan.model``).

A thin caller: the memory and time model, its constants (``plan_hw.DEVICES["h100"]``: 989 TFLOP/s
bf16 at 40 % MFU, 360 GB/s achieved NVLink all-to-all, 6 GB reserve) and its assumptions are the
library's, documented in ``src/ulysses_sp/plan.py``. The settings projected are ALST's published
ones: bf16, tiled MLP and logits+loss, activation checkpointing with the checkpoints offloaded to
the host, and either model states on the host (``offload_states``, ALST's single-GPU recipe) or
ZeRO-3 across all ranks.

This run's measurements enter as:

* ``comm_ratio``: measured all-to-all bytes / analytic minimum (section 1) scales the planner's
  all-to-all time (the planner assumes the minimum);
* ``act_units``: the measured per-layer activation footprint (section 3), reported next to the
  planner's own per-layer count for the same model (a cross-check, not an input to the length).

Published points (ALST, arXiv 2506.13996, H100 80 GB): 500K tokens on 1 GPU, 3.7M on 8, 15M on 32.
"""

from __future__ import annotations

from dataclasses import replace

from ulysses_sp.plan.hardware import DEVICES
from ulysses_sp.plan.inputs import LLAMA_8B, Settings
from ulysses_sp.plan.model import max_seq_len, predict

GB = 1e9
PUBLISHED = {1: 500_000, 8: 3_700_000, 32: 15_000_000}
"""ALST (arXiv 2506.13996): Llama-8B on H100 80GB: 500K tokens on 1 GPU, 3.7M on 8, 15M on 32."""


def project(*, P: int, act_units: float, comm_ratio: float, offload_states: bool) -> dict:
    hw = DEVICES["h100"]
    m = LLAMA_8B
    s = Settings(seq_len=P, sp=P, dtype="bf16", zero_stage=0 if offload_states else 3, partition="all",
                 tiled_mlp=True, tiled_loss=True, activation_checkpointing=True, offload_activations=True,
                 offload_states=offload_states)  # fmt: skip
    s_max = max_seq_len(m, s, hw)
    pred = predict(m, replace(s, seq_len=max(s_max, P)), hw)
    a2a_s = pred.comm_s * comm_ratio
    b = pred.breakdown
    pub = PUBLISHED.get(P)
    tok = max(s_max, P) // P
    return {
        "P": P,
        "offload_states": offload_states,
        "states_gb": (b["parameters"] + b["gradients"] + b["optimizer_state"]) / GB,
        "act_bytes_per_local_token": (b["activations"] + b["backward_workspace"]) / tok,
        "act_units_measured": act_units,
        "max_seq": s_max,
        "published_seq": pub,
        "ratio_to_published": (s_max / pub) if pub else None,
        "a2a_gb_per_layer_fwd": pred.comm_s * comm_ratio * hw.intra_gbps / m.layers / 3 if P > 1 else 0.0,
        "a2a_s_per_step": a2a_s,
        "compute_s_per_step": pred.compute_s,
        "a2a_share": a2a_s / (a2a_s + pred.compute_s) if pred.compute_s else 0.0,
        "host_checkpoint_gb_per_rank": pred.host_bytes / GB,
    }


def projections(*, act_units: float, comm_ratio: float) -> list[dict]:
    return [
        project(P=1, act_units=act_units, comm_ratio=comm_ratio, offload_states=True),
        project(P=8, act_units=act_units, comm_ratio=comm_ratio, offload_states=False),
        project(P=8, act_units=act_units, comm_ratio=comm_ratio, offload_states=True),
        project(P=32, act_units=act_units, comm_ratio=comm_ratio, offload_states=True),
    ]
