"""The HF-format export of a checkpoint, gathered one tensor at a time.

For each parameter (tied weights once, under the name transformers keeps) and persistent buffer,
in the model's order: every rank takes part in gathering that one tensor (``DTensor.full_tensor``
for FSDP2 shards; a DDP replica already has it), rank 0 casts it to the save dtype on the CPU and
adds it to the current file, and writes the file once it reaches ``max_shard_bytes``. Rank 0 thus
holds at most one file's worth plus one tensor, every other rank one tensor, never the model.

Files are what ``save_pretrained`` writes: ``model.safetensors`` when everything fits one file,
else ``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json`` (``total_size``
and the ``weight_map``), with ``config.json`` (its ``dtype`` the saved one) and
``generation_config.json``: ``AutoModelForCausalLM.from_pretrained(dir)`` loads them.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
"""Above this many bytes per file the weights are split into numbered files plus an index."""


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters (deduplicated: a tied weight under its first name) then persistent buffers."""
    out = list(module.named_parameters())
    for name, buf in module.named_buffers():
        prefix, _, leaf = name.rpartition(".")
        owner = module.get_submodule(prefix) if prefix else module
        if leaf not in owner._non_persistent_buffers_set:
            out.append((name, buf))
    return out


def export_hf(
    module: nn.Module,
    directory: str,
    *,
    is_writer: bool,
    config: Any,
    save_dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[str]:
    """Write ``module``'s weights as HF safetensors into ``directory``; a collective for FSDP2 models.

    Args:
        module: the trained model (plain, DDP's module, or FSDP2-sharded).
        is_writer: whether this rank writes (one rank per checkpoint).
        config: the transformers config to write (its ``dtype`` is set to the saved dtype).
        save_dtype: the dtype of the saved weights; ``None``: as trained (fp32 master weights).
        max_shard_bytes: split into files of at most about this many bytes (one tensor may exceed it).

    Returns:
        The weight file names written (on the writer; ``[]`` elsewhere).
    """
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    tmp_names: list[str] = []

    def flush() -> None:
        nonlocal size
        name = f".part-{len(tmp_names):05d}.safetensors"
        save_file(shards[-1], os.path.join(directory, name), metadata={"format": "pt"})
        tmp_names.append(name)
        shards[-1] = {}
        size = 0

    with torch.no_grad():
        for name, tensor in _tensors(module):
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # collective for shards
            if not is_writer:
                continue
            value = full.detach().to(device="cpu", dtype=save_dtype or full.dtype).contiguous()
            nbytes = value.numel() * value.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                flush()
            shards[-1][name] = value  # a DDP replica's CPU parameter itself: unchanged until written
            size, total = size + nbytes, total + nbytes
    if not is_writer:
        return []
    if shards[-1]:
        flush()
    return _finalize(directory, tmp_names, config, save_dtype, total)


def _finalize(
    directory: str, parts: list[str], config: Any, save_dtype: torch.dtype | None, total: int
) -> list[str]:
    from safetensors import safe_open

    n = len(parts)
    final = (
        ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    weight_map = {}
    for part, name in zip(parts, final):
        with safe_open(os.path.join(directory, part), framework="pt") as f:
            weight_map.update(dict.fromkeys(f.keys(), name))
        os.replace(os.path.join(directory, part), os.path.join(directory, name))
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(directory, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
    if save_dtype is not None:
        config.dtype = save_dtype
    config.save_pretrained(directory)
    return final
