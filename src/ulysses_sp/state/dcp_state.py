"""The reshardable training state: model and optimizer through ``torch.distributed.checkpoint``.

Every tensor is keyed by what it *is*, not by who held it: ``model/<fqn>`` for a parameter or
persistent buffer, ``optim/<fqn>/<key>`` for its optimizer state (Adam's ``exp_avg``,
``exp_avg_sq``, ``step``; SGD's ``momentum_buffer``), each with the parameter's **global** shape.
DCP writes each rank's pieces (FSDP2 ``DTensor`` shards as shards, replicated tensors once) and a
global ``.metadata``; loading asks for the pieces the *current* layout holds, whatever the saving
layout was, so a state saved at ``(dp 2, sp 1, ZeRO 3)`` loads at ``(dp 1, sp 2, ZeRO 0)``:

========= ======================================= =============================================
stage     a rank's model / optimizer entries      read back as
========= ======================================= =============================================
0         every parameter, plain; all state       the full tensors
1         every parameter; its ZeRO-1 partition's the full tensors of its partition
          state only
2, 3      ``DTensor`` shards of both               its own rows of each tensor
========= ======================================= =============================================

The optimizer state of a fresh optimizer does not exist yet (torch creates it lazily): the targets
are allocated from the checkpoint's metadata (a tensor of the parameter's shape and placement when
the saved tensor has the parameter's shape, else a plain tensor such as Adam's scalar ``step``)
and installed into ``optimizer.state`` after the load.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer holding this rank's state: ZeRO-1's local partition, else ``optimizer``."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def reshard(module: nn.Module) -> None:
    """Put every FSDP2 unit in its sharded state (a forward at ZeRO 2, or one without backward,
    leaves the gathered parameters registered): the state is read from the sharded ``DTensor``s,
    which are also what the optimizer holds."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, buf in module.named_buffers():
        prefix, _, leaf = name.rpartition(".")
        owner = module.get_submodule(prefix) if prefix else module
        if leaf not in owner._non_persistent_buffers_set:
            out[name] = buf
    return out


def _model_entries(module: nn.Module) -> dict[str, torch.Tensor]:
    entries = {f"model/{n}": p.detach() for n, p in module.named_parameters()}
    entries.update({f"model/{n}": b for n, b in _persistent_buffers(module).items()})
    return entries


def _param_names(module: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in module.named_parameters()}


def state_entries(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's ``model/...`` and ``optim/...`` entries for ``dcp.save``."""
    reshard(module)
    entries = _model_entries(module)
    names = _param_names(module)
    inner = local_optimizer(optimizer)
    for group in inner.param_groups:
        for p in group["params"]:
            for key, value in inner.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    entries[f"optim/{names[id(p)]}/{key}"] = value
    return entries


def save_state(module: nn.Module, optimizer: torch.optim.Optimizer, directory: str, group: Any) -> None:
    """Write the model and optimizer state under ``directory`` (a collective over ``group``)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state_entries(module, optimizer), checkpoint_id=directory, process_group=group)


def load_state(module: nn.Module, optimizer: torch.optim.Optimizer, directory: str, group: Any) -> None:
    """Fill the model in place and install the optimizer state from ``directory``, resharded to
    this layout (a collective over ``group``).

    Raises:
        ValueError: the checkpoint lacks a parameter of this model, or a shape differs.
    """
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    reshard(module)
    targets = _model_entries(module)
    missing = sorted(k.removeprefix("model/") for k in targets if k not in saved)
    if missing:
        raise ValueError(f"training state {directory!r} lacks {len(missing)} model tensor(s): {missing[:8]}")
    for key, t in targets.items():
        if tuple(saved[key].size) != tuple(t.shape):
            raise ValueError(
                f"{key}: shape {tuple(saved[key].size)} in the checkpoint, {tuple(t.shape)} here"
            )
    names = _param_names(module)
    inner = local_optimizer(optimizer)
    wanted: dict[Any, dict[str, torch.Tensor]] = {}
    for param_group in inner.param_groups:
        for p in param_group["params"]:
            prefix = f"optim/{names[id(p)]}/"
            for key, meta in saved.items():
                if not key.startswith(prefix) or not hasattr(meta, "size"):
                    continue
                dtype = meta.properties.dtype
                if tuple(meta.size) == tuple(p.shape):
                    target = torch.zeros_like(p.detach(), dtype=dtype)
                else:
                    target = torch.zeros(tuple(meta.size), dtype=dtype)
                wanted.setdefault(p, {})[key.removeprefix(prefix)] = target
                targets[key] = target
    with torch.no_grad():
        dcp.load(targets, checkpoint_id=directory, process_group=group)
    for p, state in wanted.items():
        inner.state[p] = state
