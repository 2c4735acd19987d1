"""A rehearsed step's time, projected (not measured) from what the rehearsal counted.

``project(result, hw, ...)`` turns one rank's counts — FLOPs (matrix products and attention kernels,
causal attention at half the ``S x S`` work), collective bytes by kind, host<->device copy bytes —
into seconds on a stated device (``plan.hardware.DEVICES``: vendor peak FLOP/s, an assumed achieved
fraction ``mfu``, link and PCIe bandwidths). The overlap model is stated, not measured:

* the Ulysses all-to-alls are on the critical path, except under head-group overlap (``head_overlap``,
  ``attention/block_overlap.py``): in the passes that run the attention block's forward per group (the
  forward, and the checkpoint recompute), every group's exchanges but the first's in and the last's out run
  behind another group's core. Those passes carry 1 of the 3 exchange passes per layer (forward; backward:
  the group's forward again and the gradients), 2 of 4 with checkpointing; their cores, 1 of 2 (2 of 3)
  of the attention kernels' forward FLOPs. Hidden: the overlappable exchange time up to that core time
  (``all_to_all_hidden_s``; a projection: on CPU gloo's thread competes with the core for the same cores);
* FSDP2's all-gathers and reduce-scatters and the offload copies run on their own streams and hide
  behind the compute up to its length (what exceeds it is exposed);
* with model states on the host (CPU offload) the optimizer runs on the CPU: its state bytes read and
  written once at ``host_optimizer_gbps``.

Where it sits: below ``rehearse.report``; pure arithmetic on a ``StepResult``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ulysses_sp.plan.hardware import Hardware, link_gbps

ALL_TO_ALL = ("alltoall_base", "alltoall", "all_to_all_single", "all_to_all")
FSDP = ("allgather_into_tensor_coalesced", "_allgather_base", "allgather", "all_gather_into_tensor",
        "reduce_scatter_tensor_coalesced", "_reduce_scatter_base", "reduce_scatter", "reduce_scatter_tensor",
        "allreduce", "all_reduce")  # fmt: skip


@dataclass
class StepTime:
    """Projected seconds of one step on one rank (``as_dict`` for JSON)."""

    compute_s: float
    all_to_all_s: float
    """Ulysses exchanges: exposed."""
    fsdp_s: float
    """Parameter gathers and gradient reductions: hidden up to ``compute_s``."""
    host_copy_s: float
    """Activation / K/V offload and CPU-offloaded states' copies: hidden up to ``compute_s``."""
    host_optimizer_s: float
    step_s: float
    tokens_per_s_per_gpu: float
    hidden_fraction: float
    """Share of the overlappable time (FSDP + host copies) that hides behind the compute."""
    all_to_all_hidden_s: float = 0.0
    """Of the Ulysses exchanges, projected to hide behind the attention core under head-group overlap."""
    all_to_all_hidden_fraction: float = 0.0
    """``all_to_all_hidden_s / (all_to_all_s + all_to_all_hidden_s)``."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def project(
    result: Any,
    hw: Hardware,
    *,
    dtype: str,
    sp: int,
    shard_group: int,
    tokens: int,
    host_optimizer_bytes: int = 0,
    host_optimizer_gbps: float = 100.0,
    head_groups: int = 1,
    head_overlap: bool = False,
    checkpointed: bool = False,
) -> StepTime:
    """Seconds of ``result``'s step (a ``StepResult``) on ``hw`` (see the module docstring).

    Args:
        dtype: ``"bf16"``/``"fp16"``/``"fp32"``: which peak FLOP/s applies (fp16 as bf16).
        sp: ranks of the SP group (the all-to-all's link); ``shard_group``: ranks FSDP shards over.
        tokens: tokens this rank trains per step (``B * S / sp``).
        host_optimizer_bytes: optimizer state and master weights updated on the host (CPU offload).
        head_groups, head_overlap, checkpointed: ``--head-chunks``, ``--head-chunk-overlap`` and activation
            checkpointing (the share of the exchanges and attention cores that overlap: module docstring).
    """
    peak = hw.tflops.get("bf16" if dtype in ("bf16", "fp16") else "fp32", hw.tflops["fp32"]) * 1e12
    compute = result.flops / (peak * hw.mfu)
    coll = result.collectives
    a2a = sum(coll.get(k, {}).get("bytes", 0) for k in ALL_TO_ALL) / (link_gbps(hw, sp) * 1e9)
    fsdp = sum(coll.get(k, {}).get("bytes", 0) for k in FSDP) / (link_gbps(hw, shard_group) * 1e9)
    copies = sum(result.host_traffic.values()) / (hw.host_to_device_gbps * 1e9)
    optimizer = 2 * host_optimizer_bytes / (host_optimizer_gbps * 1e9)
    hidden_a2a = 0.0
    if head_overlap and head_groups > 1:  # forward passes' exchanges but a pass's first in and last out
        overlappable = a2a * (2 / 4 if checkpointed else 1 / 3) * (head_groups - 1) / head_groups
        cores = result.attention_forward_flops * (2 / 3 if checkpointed else 1 / 2) / (peak * hw.mfu)
        hidden_a2a = min(overlappable, cores)
    a2a -= hidden_a2a
    exposed = max(0.0, fsdp - compute) + max(0.0, copies - compute)
    step = compute + a2a + exposed + optimizer
    overlappable = fsdp + copies
    hidden = 1.0 if overlappable == 0 else 1.0 - exposed / overlappable
    return StepTime(compute_s=compute, all_to_all_s=a2a, fsdp_s=fsdp, host_copy_s=copies, host_optimizer_s=optimizer,
                    step_s=step, tokens_per_s_per_gpu=tokens / step if step > 0 else 0.0,
                    hidden_fraction=hidden, all_to_all_hidden_s=hidden_a2a,
                    all_to_all_hidden_fraction=hidden_a2a / (a2a + hidden_a2a) if a2a + hidden_a2a > 0 else 0.0)  # fmt: skip
