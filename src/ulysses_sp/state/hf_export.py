"""The HF-format export of a checkpoint, through ``torch.distributed.checkpoint``'s HF writer.

Every rank writes what it holds (FSDP2's ``DTensor`` shards as shards; a replica's tensors once,
DCP deduplicating them across ranks), cast to the save dtype, with
``HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)`` into ``sharded/``;
then the coordinator (rank 0 of the group) consolidates those pieces into full files, streaming
from disk to disk, and the pieces are deleted. No rank ever gathers a tensor it does not hold
(the disk sees the weights twice instead). Which tensor goes to which file is planned up front
from the global sizes: files of at most ``max_shard_bytes`` (one tensor may exceed it), in the
model's order, tied weights once under the name transformers keeps.

Files are what ``save_pretrained`` writes: ``model.safetensors`` when everything fits one file,
else ``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json`` (``total_size``
and the ``weight_map``), with ``config.json`` (its ``dtype`` the saved one):
``AutoModelForCausalLM.from_pretrained(dir)`` loads them.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch
from torch import nn

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
"""Above this many bytes per file the weights are split into numbered files plus an index."""
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters (deduplicated: a tied weight under its first name) then persistent buffers."""
    out = list(module.named_parameters())
    for name, buf in module.named_buffers():
        prefix, _, leaf = name.rpartition(".")
        owner = module.get_submodule(prefix) if prefix else module
        if leaf not in owner._non_persistent_buffers_set:
            out.append((name, buf))
    return out


def _dtype(t: torch.Tensor, save_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``t`` is saved in: ``save_dtype`` for floating tensors, else its own."""
    return save_dtype if save_dtype is not None and t.is_floating_point() else t.dtype


def _file_plan(
    tensors: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None, max_bytes: int
) -> dict[str, int]:
    """``name -> file number`` (from 1): consecutive tensors, a new file before one that would pass
    ``max_bytes`` (global sizes: the same plan on every rank)."""
    plan, size, index = {}, 0, 1
    for name, t in tensors:
        nbytes = t.numel() * _dtype(t, dtype).itemsize
        if size and size + nbytes > max_bytes:
            index, size = index + 1, 0
        plan[name], size = index, size + nbytes
    return plan


def export_hf(
    module: nn.Module,
    directory: str,
    *,
    is_writer: bool,
    config: Any,
    save_dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    process_group: Any = None,
) -> list[str]:
    """Write ``module``'s weights as HF safetensors into ``directory``; a collective over
    ``process_group`` (default: the world).

    Args:
        module: the trained model (plain, DDP's module, or FSDP2-sharded).
        is_writer: whether this rank writes the config (rank 0 of the group: DCP's coordinator,
            which consolidates the files).
        config: the transformers config to write (its ``dtype`` is set to the saved dtype).
        save_dtype: the dtype of the saved weights; ``None``: as trained (fp32 master weights).
        max_shard_bytes: split into files of at most about this many bytes (one tensor may exceed it).

    Returns:
        The weight file names written (on the writer; ``[]`` elsewhere).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    tensors = _tensors(module)
    plan = _file_plan(tensors, save_dtype, max_shard_bytes)
    with torch.no_grad():  # a cast copy of what this rank holds (its shards), only when the dtype differs
        state = {n: t.detach().to(_dtype(t, save_dtype)) for n, t in tensors}
    writer = HuggingFaceStorageWriter(
        directory, fqn_to_index_mapping=plan, save_distributed=True, enable_consolidation=True
    )
    dcp.save(state, storage_writer=writer, process_group=process_group)
    if not is_writer:
        return []
    shutil.rmtree(os.path.join(directory, "sharded"))
    n = max(plan.values())
    if n == 1:  # one file: save_pretrained's name, no index
        os.replace(
            os.path.join(directory, "model-00001-of-00001.safetensors"), os.path.join(directory, SINGLE)
        )
        os.remove(os.path.join(directory, INDEX))
    if save_dtype is not None:
        config.dtype = save_dtype
    config.save_pretrained(directory)
    return [SINGLE] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
