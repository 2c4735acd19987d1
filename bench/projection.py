"""Scaling projection: Llama-8B on 8 x 80 GB from the measured per-layer counts and a stated model.

Inputs measured by this suite (same run):

* ``comm_ratio``: measured all-to-all bytes / analytic minimum (section 1); the projected volume is
  ``ratio * analytic.ulysses_min_bytes_per_layer`` for Llama-8B's heads (H=32, Hkv=8, D=128).
* ``act_units``: per-token, per-layer activation bytes of a decoder layer under SP with tiling,
  measured on the tiny model (section 3, fitted slope of peak memory vs S at the largest sp,
  times sp, divided by layers x h x 4 bytes): the activation footprint of one layer in units of one
  ``[S_l, h]`` tensor. It is a property of the layer's structure (q/k/v/o, all-to-all buffers,
  norms, residuals), which Llama-8B shares; the MLP intermediate and the logits are tiled.

The model (every constant is written here, change it and rerun):

* Activation checkpointing per layer with the checkpoints offloaded to host memory (ALST): the
  accelerator holds one layer's activations at a time, ``act_units + GRAD_UNITS`` tensors of
  ``[S_l, h]`` in bf16 (the layer recomputed in backward plus the gradients flowing through it);
  the host holds ``L`` checkpoints ``[S_l, h]`` per rank.
* Model states: bf16 params + bf16 grads + fp32 master + Adam = 16 bytes/param, ZeRO-3 over the
  ``P`` ranks, or offloaded to host (``OFFLOAD_STATES``, as ALST does on one GPU), leaving one
  layer's bf16 params and grads on the accelerator.
* ``RESERVE_GB`` for the CUDA context, allocator fragmentation and kernel workspaces.
* All-to-all time = bytes / ``A2A_GBPS`` (H100 NVLink-4: 450 GB/s per direction; we assume 80 %
  achieved), three times the forward volume per layer per step (forward, recompute, backward).
* Compute time = FLOPs / P / (``PEAK_TFLOPS`` x ``MFU``), FLOPs = 8 N S (forward 2NS, recompute
  2NS, backward 4NS) + causal attention 8 S^2 h L (forward 2 S^2 h per layer with the causal half,
  times 4 for recompute and backward); section 2 measured the per-rank split at total/P.
"""

from __future__ import annotations

import dataclasses

from bench import analytic

GB = 1e9
GRAD_UNITS = 3.0
RESERVE_GB = 6.0
A2A_GBPS = 360.0
PEAK_TFLOPS = 989.0
MFU = 0.4
PUBLISHED = {1: 500_000, 8: 3_700_000}
"""ALST (arXiv 2506.13996): Llama-8B, 500K tokens on one H100 80GB, 3.7M on one 8 x H100 node."""


@dataclasses.dataclass(frozen=True)
class Llama8B:
    hidden: int = 4096
    layers: int = 32
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    vocab: int = 128256
    params: float = 8.03e9


def project(
    *, P: int, act_units: float, comm_ratio: float, offload_states: bool, gpu_gb: float = 80.0
) -> dict:
    m = Llama8B()
    bytes_bf16 = 2
    layer_params = m.params / m.layers
    if offload_states:
        states = 2 * layer_params * bytes_bf16  # one layer's bf16 params + grads in flight
    else:
        states = m.params * 16 / P
    per_token = (act_units + GRAD_UNITS) * m.hidden * bytes_bf16  # bytes per local token
    budget = gpu_gb * GB - RESERVE_GB * GB - states
    s_local = max(budget, 0) / per_token
    s_max = int(s_local * P)
    s_max -= s_max % P
    a2a_layer = (
        comm_ratio
        * analytic.ulysses_min_bytes_per_layer(
            B=1, S=s_max, H=m.heads, Hkv=m.kv_heads, D=m.head_dim, P=P, b=bytes_bf16
        )
        if P > 1
        else 0
    )
    a2a_s = 3 * m.layers * a2a_layer / (A2A_GBPS * GB)
    flops = 8 * m.params * s_max + 8 * s_max**2 * m.hidden * m.layers
    compute_s = flops / P / (PEAK_TFLOPS * 1e12 * MFU)
    host_ckpt = m.layers * s_local * m.hidden * bytes_bf16
    pub = PUBLISHED.get(P)
    return {
        "P": P,
        "offload_states": offload_states,
        "states_gb": states / GB,
        "act_bytes_per_local_token": per_token,
        "max_seq": s_max,
        "published_seq": pub,
        "ratio_to_published": (s_max / pub) if pub else None,
        "a2a_gb_per_layer_fwd": a2a_layer / GB,
        "a2a_s_per_step": a2a_s,
        "compute_s_per_step": compute_s,
        "a2a_share": a2a_s / (a2a_s + compute_s),
        "host_checkpoint_gb_per_rank": host_ckpt / GB,
    }


def projections(*, act_units: float, comm_ratio: float) -> list[dict]:
    return [
        project(P=1, act_units=act_units, comm_ratio=comm_ratio, offload_states=True),
        project(P=8, act_units=act_units, comm_ratio=comm_ratio, offload_states=False),
        project(P=8, act_units=act_units, comm_ratio=comm_ratio, offload_states=True),
    ]
