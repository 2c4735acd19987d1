"""``initialize``: config + mesh + sharding engine + optimizer + scheduler + DataLoader, like ``deepspeed.initialize``.

Order (every check that can fail does so before the first collective, identically on every rank,
so a bad input raises ``ValueError`` everywhere instead of leaving some ranks in a collective):

1. parse the config; check the arguments and that a process group exists;
2. decide the mesh shape from ``mesh_param`` / ``mpu`` / config keys (they must agree) and the
   data-parallel world size (``mesh_shape.data_parallel_world_size``), then the batch triple;
3. check the optimizer / scheduler arguments against the ZeRO stage, and (sp > 1) that every module
   of the model is SP attention, position-wise or a mixer SP shards (``mixers.guard``);
4. collectives: build or adopt the mesh, wrap the model (DDP or FSDP2), build the optimizer over
   the wrapped parameters, the scheduler, and the DataLoader.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, Dataset

from ulysses_sp.attention.registration import attach_registered, registered_layout
from ulysses_sp.config import TrainingConfig, load_config
from ulysses_sp.engine.data import build_dataloader, check_dataset
from ulysses_sp.engine.engine import Engine, LossFn
from ulysses_sp.engine.optim import (
    OptimizerArg,
    SchedulerArg,
    build_optimizer,
    build_scheduler,
    check_optimizer_args,
    remap_parameters,
)
from ulysses_sp.engine.sharding import apply_ddp, apply_fsdp, on_meta
from ulysses_sp.mixers.apply import apply_mixers, has_unsharded_mixers
from ulysses_sp.mixers.base import MixerHandle
from ulysses_sp.mixers.guard import check_sequence_mixing
from ulysses_sp.parallel.comm import raise_if_any_rank_failed
from ulysses_sp.parallel.mesh import LAUNCH_HINT, SPMesh, init_mesh
from ulysses_sp.parallel.mesh_shape import check_mesh_param, data_parallel_world_size, resolve_mesh_shape
from ulysses_sp.state.precision import policy_for
from ulysses_sp.vlm import VLMShardHandle, shard_vlm, vlm_parts
from ulysses_sp.vlm.shard import installed

logger = logging.getLogger(__name__)


def initialize(
    model: nn.Module | None = None,
    config: TrainingConfig | Mapping[str, Any] | str | None = None,
    mesh_param: tuple[int, int] | None = None,
    mpu: Any | None = None,
    optimizer: OptimizerArg = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Dataset | None = None,
    lr_scheduler: SchedulerArg = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    *,
    loss_fn: LossFn | None = None,
) -> tuple[Engine, Optimizer | None, DataLoader | None, Any]:
    """Wrap ``model`` in a sharding engine over the ``(dp, sp)`` mesh; ``deepspeed.initialize``'s shape.

    A collective: every rank calls it with the same arguments (after ``init_process_group``).

    Args:
        model: the model (e.g. a transformers ``LlamaForCausalLM``), on CPU or its device.
        config: a ``TrainingConfig``, a DeepSpeed-style dict, or a JSON file path (``config.py``).
        mesh_param: ``(dp_size, sp_size)``; alternatively ``mpu`` or the config's
            ``data_parallel_size`` / ``sequence_parallel_size`` (either may be omitted).
        mpu: the ``Mpu`` ``register_with_transformers`` returns (its mesh is adopted), or any
            object with the reference ``mpu`` methods (its groups must match our layout).
        optimizer: a pre-built ``Optimizer`` (ZeRO stage 0; stage 1 rebuilds it as a
            ``ZeroRedundancyOptimizer``), or a ``callable(params) -> Optimizer`` (any stage; an
            optimizer class works). Or use the config's ``optimizer`` section.
        model_parameters: the parameters (or param-group dicts) to optimize; default: all that
            require grad. Given as the model's parameters before sharding; remapped after.
        training_data: a map-style dataset; a DataLoader of micro-batches is built over it with
            ``data.SPDistributedSampler`` (an ``sp = P`` run then sees the ``sp = 1`` run's
            batches, in order, once wrapped in ``UlyssesSPDataLoaderAdapter``).
        lr_scheduler: a pre-built scheduler (only with a pre-built optimizer at stage 0), or a
            ``callable(optimizer) -> scheduler``. Or use the config's ``scheduler`` section.
        collate_fn: passed to the DataLoader.
        loss_fn: ``loss_fn(wrapper, batch, shift_labels, sp_group) -> outputs`` with ``.loss``,
            replacing the full-logits loss (e.g. a tiled one). Call ``wrapper(...)`` (not its
            submodules) so the sharding engine's forward hooks run.

    Returns:
        ``(engine, optimizer, dataloader, lr_scheduler)``; ``dataloader`` / ``lr_scheduler`` /
        ``optimizer`` are ``None`` when not requested.

    Raises:
        ValueError: any bad or inconsistent input (before any collective, on every rank),
            including no process group (the message says how to launch) and, at ``sp_size > 1``, a
            model with a module that mixes tokens along the sequence outside the SP attention (the
            closed-world guard, ``mixers.guard``: the message names the layer, module and why).
    """
    if config is None:
        raise ValueError("initialize needs config= (a dict, a JSON file path or a TrainingConfig)")
    cfg = load_config(config)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable(model, batch, shift_labels, sp_group), got {loss_fn!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"ulysses_sp.initialize needs an initialized torch.distributed process group: {LAUNCH_HINT}"
        )
    world_size = dist.get_world_size()
    dp_size, sp_size = plan_mesh_shape(world_size, cfg, mesh_param=mesh_param, mpu=mpu)
    dp_world_size = data_parallel_world_size(world_size, mpu=mpu, sequence_parallel_size=sp_size)
    batch_sizes = cfg.batch_sizes(dp_world_size)
    stage, partition = cfg.zero_optimization.stage, cfg.zero_optimization.partition
    if model_parameters is not None:
        model_parameters = list(model_parameters)
    check_optimizer_args(
        stage=stage,
        section=cfg.optimizer,
        optimizer=optimizer,
        scheduler_section=cfg.scheduler,
        lr_scheduler=lr_scheduler,
        model=model,
        model_parameters=model_parameters,
    )
    if training_data is not None:
        check_dataset(training_data)
    # the closed-world guard: every module of every decoder layer is SP attention, position-wise or
    # a mixer SP shards; the same verdict on every rank (a pure function of the model)
    check_sequence_mixing(model, sp_size=sp_size)
    if stage <= 1 and on_meta(model):
        raise ValueError(
            f"the model's parameters are on the meta device, which needs ZeRO stage 2 or 3 (got stage {stage}): "
            "the shards are filled after sharding; at stage 0 or 1 load the whole model (from_pretrained)"
        )

    # ---- collectives from here on ----
    mesh = _build_mesh(dp_size, sp_size, mpu, model)
    mixers, vlm = shard_model(model, mesh)
    names = {id(p): n for n, p in model.named_parameters()}
    if stage <= 1:
        wrapper = apply_ddp(model, mesh)
    else:
        wrapper = apply_fsdp(model, mesh, stage=stage, partition=partition, policy=policy_for(cfg))
    if model_parameters is not None:
        params = remap_parameters(model_parameters, names, model)
    else:
        params = [p for p in model.parameters() if p.requires_grad]
    zero_group = mesh.dp_group if partition == "data_parallel" else mesh.reduce_group
    opt = build_optimizer(
        params, stage=stage, section=cfg.optimizer, optimizer=optimizer, zero_group=zero_group
    )
    sched = build_scheduler(opt, section=cfg.scheduler, lr_scheduler=lr_scheduler)
    engine = Engine(
        module=model,
        wrapper=wrapper,
        optimizer=opt,
        lr_scheduler=sched,
        mesh=mesh,
        mpu=mpu if mpu is not None else mesh.mpu,
        config=cfg,
        batch_sizes=batch_sizes,
        loss_fn=loss_fn,
    )
    engine.mixers = mixers  # the MixerHandle (remove() restores the mixers), or None
    engine.vlm = vlm  # the VLMShardHandle, or None
    loader = None
    if training_data is not None:
        loader = build_dataloader(
            training_data,
            batch_size=batch_sizes.train_micro_batch_size_per_gpu,
            dp_size=engine.dp_size,
            dp_rank=engine.dp_rank,
            sp_size=engine.sp_size,
            sp_rank=engine.sp_rank,
            collate_fn=collate_fn,
        )
    if dist.get_rank() == 0:
        logger.info("ulysses_sp.initialize: %r, %s", engine, batch_sizes)
    return engine, opt, loader, sched


def shard_model(model: nn.Module, mesh: SPMesh) -> tuple[MixerHandle | None, VLMShardHandle | None]:
    """The model side of sequence parallelism that ``initialize`` applies after the closed-world guard
    (``mixers.guard.check_sequence_mixing``), for any forward over ``mesh`` (``ulysses-sp eval`` runs
    ``train``'s forward through it): the registered SP attention attached to the positions of every
    call, the sequence mixers sharded (also at sp 1, so packed documents never leak whatever the sp
    size), and a VLM's per-shard merge (sp > 1). Returns ``(mixers, vlm)``: the handles whose
    ``remove()`` undoes each (``None``: nothing to undo, or installed by the caller before)."""
    attach_registered(model)  # its SP attention sees the position_ids of every call
    # sequence mixers (short convolutions, Mamba-2, gated delta-net, KDA): head-sharded, with document
    # boundaries from the batch's position ids
    mixers = apply_mixers(model, mesh) if has_unsharded_mixers(model) else None
    vlm = None  # a VLM: each rank embeds and merges its own shard, frames split over SP (ulysses_sp.vlm)
    if vlm_parts(model) is not None and mesh.sp_size > 1:  # unless installed already by the caller
        vlm = installed(model) or shard_vlm(
            model, sp_rank=mesh.sp_rank, sp_size=mesh.sp_size, ring_size=mesh.ring_size, split_images_over=mesh.sp_group
        )
    return mixers, vlm


def plan_mesh_shape(
    world_size: int, cfg: TrainingConfig, *, mesh_param: Any = None, mpu: Any = None
) -> tuple[int, int]:
    """``(dp_size, sp_size)`` from ``mesh_param``, ``mpu`` and the config, which must agree. Pure.

    Raises:
        ValueError: a disagreement (naming both sides), a bad ``mesh_param``, or
            ``dp * sp != world_size`` (naming all three numbers).
    """
    sources: list[tuple[str, int, int]] = []
    if mesh_param is not None:
        dp, sp = check_mesh_param(mesh_param)
        sources.append((f"mesh_param {tuple(mesh_param)}", dp, sp))
    if mpu is not None:
        if not hasattr(mpu, "get_sequence_parallel_world_size"):
            raise ValueError(f"mpu must have get_sequence_parallel_world_size(), got {type(mpu).__name__}")
        sp = mpu.get_sequence_parallel_world_size()
        sources.append((f"the mpu (sp_size {sp})", data_parallel_world_size(world_size, mpu=mpu), sp))
    for name, dp, sp in sources[1:]:
        if (dp, sp) != sources[0][1:]:
            raise ValueError(f"{name} gives (dp, sp) = {(dp, sp)} but {sources[0][0]} gives {sources[0][1:]}")
    if not sources:
        return resolve_mesh_shape(world_size, cfg.data_parallel_size, cfg.sequence_parallel_size)
    name, dp, sp = sources[0]
    for key, value, want in (("sequence_parallel_size", cfg.sequence_parallel_size, sp),
                             ("data_parallel_size", cfg.data_parallel_size, dp)):  # fmt: skip
        if value is not None and value != want:
            raise ValueError(f"config {key} ({value}) disagrees with {name}: {key} {want}")
    return resolve_mesh_shape(world_size, dp, sp)


def _build_mesh(dp_size: int, sp_size: int, mpu: Any, model: nn.Module) -> SPMesh:
    """The run's layout: the ``mpu``'s own ``SPMesh``, else the one the model's SP attention was
    registered on (when the shape agrees), else ``init_mesh`` (which reuses a live layout of the
    same shape): one set of communicators per layout, never two."""
    held = getattr(mpu, "mesh", None)
    attention_mesh = registered_layout(model)
    if isinstance(held, SPMesh):
        mesh = held
    elif (
        attention_mesh is not None
        and (attention_mesh.dp_size, attention_mesh.sp_size) == (dp_size, sp_size)
        and attention_mesh.is_current()
    ):
        mesh = attention_mesh
    else:
        mesh = init_mesh((dp_size, sp_size))
    if mpu is not None and not isinstance(held, SPMesh) and hasattr(mpu, "get_sequence_parallel_group"):
        # A foreign mpu: its groups must be the ones our mesh uses, on every rank.
        want = dist.get_process_group_ranks(mesh.sp_group)
        got = dist.get_process_group_ranks(mpu.get_sequence_parallel_group())
        error = (
            None if got == want else f"mpu SP group {got} != the mesh's SP group {want} (rank layout differs)"
        )
        raise_if_any_rank_failed(error, mesh.reduce_group)
    if attention_mesh is not None and attention_mesh is not mesh:
        # The same verdict on every rank (all ranks registered the same way): no agreement needed.
        raise ValueError(
            f"the model's sequence-parallel attention was registered on {attention_mesh!r}, but the engine "
            f"would train on {mesh!r}: pass initialize(mpu=<what register_with_transformers returned>), "
            "or the same (dp_size, sp_size)"
        )
    return mesh
