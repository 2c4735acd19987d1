"""Wrap a model in PyTorch's own sharding engine over the ``(dp, sp)`` mesh: DDP or FSDP2.

One rule in every stage: **gradients are summed over the SP group and averaged over the DP axis**.
Each SP rank back-propagates only its own share of the loss (``loss.sp_mean_loss``), so the
exact gradient of a sample is the *sum* over its SP group; different DP replicas see different
samples, so their gradients are *averaged*. Since ``world = dp * sp``, both together are one
collective: sum over all ranks, then divide by ``dp_size`` (not by the world size, which is what
DDP and FSDP2 do by default and would scale the gradient down by ``sp``).

What each ZeRO stage partitions (``partition="data_parallel"``: across the DP axis, the columns
``{0,4} {1,5} ...`` of DESIGN.md's picture; ``partition="all"``: across all ``dp*sp`` ranks):

====== ============================================ ======================== =============
stage  engine                                       partitioned              grads reduced
====== ============================================ ======================== =============
0      DDP over the world group                     nothing                  all-reduce
1      DDP + ``ZeroRedundancyOptimizer``            optimizer state          all-reduce
2      FSDP2 ``fully_shard(reshard_after_forward    optimizer state, grads   reduce-scatter
       =False)``                                    (+ params between steps)
3      FSDP2 ``fully_shard``                        + parameters             reduce-scatter
====== ============================================ ======================== =============

FSDP2 has no "ZeRO-2 only" mode: it always keeps parameters sharded between steps. Stage 2 keeps
the unsharded parameters from forward until backward (no re-gather in backward: ZeRO-2's memory
and communication profile during the step); stage 3 frees them after each block's forward and
gathers them again in backward.

FSDP2 over the DP axis is HSDP: a 2-D mesh whose **first** axis is the replicate axis (SP) and
whose second is the shard axis (DP) — the transpose of our ``(dp, sp)`` grid, built from the
existing SP and DP groups (no new communicators): ``SPMesh.fsdp_mesh``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from ulysses_sp.parallel.comm import broadcast_from_first_, sum_over_sp_mean_over_dp_
from ulysses_sp.parallel.mesh import SPMesh
from ulysses_sp.state.precision import PrecisionPolicy
from ulysses_sp.vlm.families import vlm_parts


@dataclass
class _SumMeanState:
    """State of the DDP comm hook: the group spanning all ``dp * sp`` ranks, and ``dp_size``."""

    group: dist.ProcessGroup
    dp_size: int


def _sum_over_sp_mean_over_dp(state: _SumMeanState, bucket):  # noqa: ANN001
    """DDP comm hook: ``grad <- sum over all ranks / dp_size`` (= sum over SP, mean over DP).

    ``bucket`` is a ``dist.GradBucket``; returns a ``Future[Tensor]``. Not annotated because DDP
    compares annotations to the real classes and ``from __future__ import annotations`` makes them
    strings.
    """
    fut = sum_over_sp_mean_over_dp_(bucket.buffer(), state.group, state.dp_size).get_future()
    return fut.then(lambda f: f.value()[0])


def may_leave_parameters_unused(model: nn.Module) -> str | None:
    """Why a step of ``model`` can leave some parameters without a gradient, or ``None``: an admitted
    VLM (towers' layers past the feature layer, pooling heads, a modality absent from the batch), or a
    mixture of experts, found by structure, whose experts are modules of their own (a ``ModuleList`` /
    ``ModuleDict`` named ``*experts`` or of ``*Expert*`` modules: one that no token of a rank's shard is
    routed to is skipped, common on a short shard) or that has identity experts (``zero_expert_num``:
    every token of a shard may pick them). transformers' own MoE families hold each layer's experts
    fused in one tensor, used whenever any expert is hit: those need no search."""
    if vlm_parts(model) is not None:
        return "it is a vision-language model"
    separate = expert_modules(model)
    if separate is not None:
        return f"it is a mixture of experts with one module per expert ({separate})"
    for module in model.modules():
        if getattr(getattr(module, "config", None), "zero_expert_num", None):
            return f"it is a mixture of experts with identity experts ({type(module).__name__}.config.zero_expert_num)"
    return None


def expert_modules(model: nn.Module) -> str | None:
    """The name of the first ``ModuleList`` / ``ModuleDict`` of ``model`` that holds one module per expert
    (named ``*experts``, or of ``*Expert*`` modules), or ``None``."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            kinds = {type(child).__name__ for child in module.children()}
            if name.rsplit(".", 1)[-1].lower().endswith("experts") or any("expert" in k.lower() for k in kinds):
                return name
    return None


def reentrant_checkpointing(model: nn.Module) -> bool:
    """Whether a module of ``model`` has transformers' activation checkpointing on in reentrant mode
    (``use_reentrant=True``, or not given: torch's default)."""
    for module in model.modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        if getattr(module, "gradient_checkpointing", False) and func is not None:
            if getattr(func, "keywords", {}).get("use_reentrant", True):
                return True
    return False


def apply_ddp(model: nn.Module, mesh: SPMesh) -> DistributedDataParallel:
    """DDP over the layout's ``dp * sp`` ranks with the sum-over-SP / mean-over-DP hook (stages 0, 1).

    DDP broadcasts rank 0's parameters and buffers at construction, so every replica starts equal.
    Where a step can leave parameters unused (``may_leave_parameters_unused``), DDP looks for them
    after each forward (``find_unused_parameters``): without it the buckets holding an unused
    parameter are never reduced, the other ranks' reductions pair up wrongly, the step's gradients
    are silently wrong and the next forward raises. That search cannot see through reentrant
    activation checkpointing (every parameter inside a checkpointed layer looks unused), so that
    combination is refused.
    """
    if on_meta(model):
        raise ValueError(
            "the model's parameters are on the meta device, which needs ZeRO stage 2 or 3 (the shards are "
            "filled after sharding); at stage 0 or 1 load the whole model (from_pretrained)"
        )
    unused = may_leave_parameters_unused(model)
    if unused and reentrant_checkpointing(model):
        raise ValueError(
            f"ZeRO stage 0/1 (DDP) with reentrant activation checkpointing cannot train this model: {unused}, "
            "so a step can leave parameters without a gradient, and DDP's search for them cannot see through "
            "reentrant checkpointing. Enable checkpointing with use_reentrant=False "
            "(enable_activation_checkpointing(model), the default)"
        )
    device = mesh.device
    model.to(device)
    ddp = DistributedDataParallel(
        model,
        device_ids=None if device.type == "cpu" else [device.index],
        process_group=mesh.reduce_group,
        # only where needed: the search walks the autograd graph after every forward, and DDP warns
        # at every step where it finds nothing
        find_unused_parameters=unused is not None,
    )
    ddp.register_comm_hook(
        _SumMeanState(group=mesh.reduce_group, dp_size=mesh.dp_size), _sum_over_sp_mean_over_dp
    )
    return ddp


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules to shard one by one before the root: the transformer blocks of an HF model
    (``model.model.layers``); where there is no such list (a vision-language model: its decoder layers
    under ``model.model.language_model``, its vision tower's blocks under ``model.model.visual``), every
    outermost ``GradientCheckpointingLayer`` (transformers' base class of both), so that ZeRO 3 gathers
    one block's parameters at a time, never the whole language model; otherwise the direct children
    that hold parameters."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = getattr(getattr(model, "model", None), "layers", None)
    if isinstance(layers, nn.ModuleList):
        return list(layers)
    blocks, inside = [], set()
    for name, module in model.named_modules():
        if isinstance(module, GradientCheckpointingLayer) and not any(name.startswith(f"{o}.") for o in inside):
            blocks.append(module)
            inside.add(name)
    if blocks:
        return blocks
    return [child for child in model.children() if next(child.parameters(), None) is not None]


def broadcast_module_states(model: nn.Module, mesh: SPMesh) -> None:
    """Make every rank's parameters and buffers equal to the layout's first rank's (FSDP2 does not)."""
    model.to(mesh.device)
    broadcast_from_first_([*model.parameters(), *model.buffers()], mesh.reduce_group)


def on_meta(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are on the meta device (``loading.init_empty_model``)."""
    return any(p.is_meta for p in model.parameters())


def apply_fsdp(
    model: nn.Module, mesh: SPMesh, *, stage: int, partition: str, policy: PrecisionPolicy | None = None
) -> nn.Module:
    """FSDP2 per block, then the root (stages 2, 3), with the sum-over-SP / mean-over-DP reduction.

    FSDP2 divides by the size of the mesh it shards over by default; we replace that with
    ``dp_size`` and force plain SUM collectives (gloo has no AVG / PREMUL_SUM; on NCCL the cost
    is one division of the already-reduced shard). ``policy`` adds the mixed-precision and CPU
    offload policies (``state/precision.py``). A model whose parameters are on the meta device is
    sharded as it is, then each rank allocates only its own shards (``to_empty``) with the real
    buffers put back; ``loading.load_pretrained_weights`` fills the shards.
    """
    separate = expert_modules(model)  # (a VLM's unused towers are the same on every rank: reduced alike)
    if separate is not None:
        raise ValueError(
            f"ZeRO stage {stage} (FSDP2) cannot train this model: it is a mixture of experts with one module per "
            f"expert ({separate}). FSDP2 reduces only the parameters "
            "that got a gradient, so ranks whose tokens reach different experts would run mismatched collectives "
            "(a hang). Use ZeRO stage 0 or 1 (DDP finds the unused experts), or a model whose experts are fused "
            "in one tensor (transformers' own MoE classes)"
        )
    policy = policy or PrecisionPolicy()
    meta = on_meta(model)
    if meta:
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    else:
        broadcast_module_states(model, mesh)
    shard_mesh = mesh.fsdp_mesh(partition)
    extra = policy.fsdp_kwargs(mesh.device)
    reshard: Any = False if stage == 2 else None  # None: blocks reshard, the root keeps its params
    for unit in fsdp_units(model):
        fully_shard(unit, mesh=shard_mesh, reshard_after_forward=True if stage == 3 else reshard, **extra)
    fully_shard(model, mesh=shard_mesh, reshard_after_forward=reshard, **extra)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(float(mesh.dp_size))
            m.set_force_sum_reduction_for_comms(True)
    if meta:
        # shards where FSDP2 keeps them: host memory under CPU offload, else the run's device
        model.to_empty(device="cpu" if policy.cpu_offload else mesh.device)
        for name, buf in model.named_buffers():
            buf.copy_(buffers[name])
    return model
