"""Load a pretrained HF model into FSDP2 shards without ever holding the whole model on one rank.

Three steps, the middle one the engine's::

    model = init_empty_model("./Llama-3-8B", attn_implementation="sdpa")  # params on meta, buffers real
    engine, *_ = ulysses_sp.initialize(model, {"zero_optimization": {"stage": 3}, ...}, mpu=...)
    load_pretrained_weights(engine.module, "./Llama-3-8B")               # each rank reads its rows

``init_empty_model`` builds the transformers model with every parameter on the meta device (no
memory) while buffers are computed for real on the CPU, as the modeling code does (rotary
``inv_freq`` and other non-persistent buffers come out exactly as ``from_pretrained``'s). The
engine (ZeRO 2/3) shards the meta model and allocates only this rank's shards.
``load_pretrained_weights`` then opens the safetensors files (one ``model.safetensors``, or the
``model-0000k-of-0000n.safetensors`` shards of ``model.safetensors.index.json``) memory-mapped and
copies into each shard **only its own rows** (``get_slice``): a rank's peak host memory while
loading is its own shards plus one slice, never the model. Tied embeddings are one parameter (the
file holds one copy); persistent buffers present in the files are loaded too.

FSDP2 shards every parameter on dim 0 (``Shard(0)``) over the shard axis of its mesh (the DP axis,
or all ranks with ``partition="all"``; replicated over the SP axis in HSDP): the rows of shard
``i`` of ``n`` are ``[i * ceil(d0 / n), ...)``, as ``torch.chunk`` cuts them, ``to_local()`` long.

At ZeRO 0/1 (whole replicas) keep ``from_pretrained``; ``load_pretrained_weights`` also fills a
plain (unsharded) model, reading whole tensors.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator

import torch
from torch import nn

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Inside: every parameter a module registers moves to the meta device; buffers stay real.

    ``torch.device("meta")`` would put buffers there too (rotary ``inv_freq`` is computed in
    ``__init__``); this is ``accelerate.init_empty_weights(include_buffers=False)``'s mechanism,
    undone on exit. A parameter is created on the CPU and moved at once: one tensor at a time.
    """
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            kwargs = {"requires_grad": param.requires_grad}
            module._parameters[name] = type(param)(param.to("meta"), **kwargs)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def init_empty_model(
    path: str, *, attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32
) -> nn.Module:
    """The ``AutoModelForCausalLM`` of the HF directory ``path`` with parameters on the meta device.

    Args:
        path: a local HF model directory (``config.json`` + safetensors weights).
        attn_implementation: the core attention (as ``from_pretrained``'s argument).
        dtype: the parameters' dtype once materialised: fp32 master weights by default (mixed
            precision casts the compute copy, ``state/precision.py``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    return model


def weight_files(path: str) -> dict[str, str]:
    """``tensor name -> safetensors file`` of an HF directory: the index's ``weight_map``, or the
    single ``model.safetensors``. ``ValueError`` when neither exists."""
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    single = os.path.join(path, SINGLE)
    if os.path.isfile(single):
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise ValueError(f"{path!r} has neither {SINGLE} nor {INDEX}: not a safetensors HF model directory")


def _shard_rows(target: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(local tensor, first global row)`` of a parameter: a plain tensor is all of it; an FSDP2
    ``DTensor`` holds rows ``[i * ceil(d0 / n), ...)`` of shard ``i`` of ``n`` on its ``Shard(0)`` axes."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(target, DTensor):
        return target, 0
    local = target.to_local()
    coord = target.device_mesh.get_coordinate()
    rows, start = target.shape[0], 0
    for axis, placement in enumerate(target.placements):
        if isinstance(placement, Shard):
            assert placement.dim == 0, f"FSDP2 shards dim 0, got {placement}"
            n = target.device_mesh.size(axis)
            step = -(-rows // n)
            start += coord[axis] * step
            rows = max(0, min(step, rows - coord[axis] * step))
    assert local.shape[0] == rows, (local.shape, rows)
    return local, start


def load_pretrained_weights(module: nn.Module, path: str) -> None:
    """Fill ``module``'s parameters (FSDP2 shards or plain) and persistent buffers from ``path``.

    Each rank reads only the rows its shards hold, straight from the memory-mapped safetensors
    files, cast to the parameter's dtype. No collective: every rank reads the files itself (one
    node, or a file system every node sees).

    Raises:
        ValueError: a parameter the files lack (tied duplicates excepted: one parameter, filled
            once), or a tensor whose shape differs from the model's (naming both).
    """
    from safetensors import safe_open

    files = weight_files(path)
    targets: dict[str, torch.Tensor] = dict(module.named_parameters())  # tied: one name per tensor
    persistent = {
        name: buf
        for name, buf in module.named_buffers()
        if name.rsplit(".", 1)[-1] not in _owner(module, name)._non_persistent_buffers_set
    }
    missing = sorted(n for n in targets if n not in files)
    if missing:
        raise ValueError(f"{path!r} lacks weights for {len(missing)} parameter(s): {missing[:8]}")
    targets.update({n: b for n, b in persistent.items() if n in files})
    with torch.no_grad():
        for name, target in targets.items():
            # one mapping per tensor: the pages read are unmapped right after, so a rank's resident
            # file pages never exceed one slice (a file held open keeps every page it touched)
            with safe_open(files[name], framework="pt") as f:
                _fill(target, f.get_slice(name), name, path)


def _owner(module: nn.Module, name: str) -> nn.Module:
    prefix = name.rpartition(".")[0]
    return module.get_submodule(prefix) if prefix else module


def _fill(target: torch.Tensor, source, name: str, path: str) -> None:  # noqa: ANN001 - a safetensors slice
    shape = tuple(source.get_shape())
    if shape != tuple(target.shape):
        raise ValueError(
            f"{path!r}: {name} has shape {shape} in the files but {tuple(target.shape)} in the model"
        )
    local, start = _shard_rows(target)
    if local.numel() == 0:
        return
    rows = source[start : start + local.shape[0]] if local.dim() else source[...]
    local.copy_(rows)  # casts (e.g. bf16 files -> fp32 master weights) without a second temporary
