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
existing SP and DP groups (no new communicators).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from ..mesh import DP_AXIS, SP_AXIS, dp_group, sp_group, track_mesh


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank computes on, from the mesh's device type (never hard-coded)."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


@dataclass
class _SumMeanState:
    """State of the DDP comm hook: all-reduce over ``group`` and divide by ``dp_size``."""

    group: dist.ProcessGroup
    dp_size: int


def _sum_over_sp_mean_over_dp(state: _SumMeanState, bucket):  # noqa: ANN001
    """DDP comm hook: ``grad <- sum over all ranks / dp_size`` (= sum over SP, mean over DP).

    ``bucket`` is a ``dist.GradBucket``; returns a ``Future[Tensor]``. Not annotated because DDP
    compares annotations to the real classes and ``from __future__ import annotations`` makes them
    strings.
    """
    buf = bucket.buffer()
    buf.div_(state.dp_size)  # divide first: same rounding as FSDP2's sum path, no overflow in fp16
    fut = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=state.group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def apply_ddp(model: nn.Module, mesh: DeviceMesh) -> DistributedDataParallel:
    """DDP over the whole world with the sum-over-SP / mean-over-DP gradient hook (stages 0, 1).

    DDP broadcasts rank 0's parameters and buffers at construction, so every replica starts equal.
    """
    device = mesh_device(mesh)
    model.to(device)
    ddp = DistributedDataParallel(model, device_ids=None if device.type == "cpu" else [device.index])
    ddp.register_comm_hook(
        _SumMeanState(group=dist.group.WORLD, dp_size=mesh.size(0)), _sum_over_sp_mean_over_dp
    )
    return ddp


def fsdp_mesh(mesh: DeviceMesh, partition: str) -> DeviceMesh:
    """The mesh FSDP2 shards over: HSDP ``(SP replicate, DP shard)`` or 1-D over all ranks.

    A collective only in the bookkeeping sense: it reuses the existing process groups.
    """
    if partition == "all":
        return track_mesh(
            DeviceMesh.from_group(dist.group.WORLD, mesh.device_type, mesh_dim_names=("dp_sp",))
        )
    dp_size, sp_size = mesh.size(0), mesh.size(1)
    # [dp, sp] rank grid -> [sp, dp]: dim 0 runs along an SP group (replicate), dim 1 along a DP group (shard).
    grid = torch.arange(dp_size * sp_size).view(dp_size, sp_size).T
    return track_mesh(
        DeviceMesh.from_group(
            [sp_group(mesh), dp_group(mesh)], mesh.device_type, mesh=grid, mesh_dim_names=(SP_AXIS, DP_AXIS)
        )
    )


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules to shard one by one before the root: the transformer blocks of an HF model
    (``model.model.layers``), otherwise the direct children that hold parameters."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if isinstance(layers, nn.ModuleList):
        return list(layers)
    return [child for child in model.children() if next(child.parameters(), None) is not None]


def broadcast_module_states(model: nn.Module, device: torch.device) -> None:
    """Make every rank's parameters and buffers equal to global rank 0's (FSDP2 does not)."""
    model.to(device)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=0)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, stage: int, partition: str) -> nn.Module:
    """FSDP2 per block, then the root (stages 2, 3), with the sum-over-SP / mean-over-DP reduction.

    FSDP2 divides by the size of the mesh it shards over by default; we replace that with
    ``dp_size`` and force plain SUM collectives (gloo has no AVG / PREMUL_SUM; on NCCL the cost
    is one division of the already-reduced shard).
    """
    device = mesh_device(mesh)
    broadcast_module_states(model, device)
    shard_mesh = fsdp_mesh(mesh, partition)
    reshard: Any = False if stage == 2 else None  # None: blocks reshard, the root keeps its params
    for unit in fsdp_units(model):
        fully_shard(unit, mesh=shard_mesh, reshard_after_forward=True if stage == 3 else reshard)
    fully_shard(model, mesh=shard_mesh, reshard_after_forward=reshard)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(float(mesh.size(0)))
            m.set_force_sum_reduction_for_comms(True)
    return model
