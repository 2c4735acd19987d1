"""Load a pretrained HF model into FSDP2 shards without ever holding the whole model on one rank.

Three steps, the middle one the engine's::

    model = init_empty_model("./Llama-3-8B", attn_implementation="sdpa")  # params on meta, buffers real
    engine, *_ = ulysses_sp.initialize(model, {"zero_optimization": {"stage": 3}, ...}, mpu=...)
    load_pretrained_weights(engine.module, "./Llama-3-8B")               # each rank reads its rows

``init_empty_model`` builds the transformers model under ``torch.device("meta")`` (no parameter is
ever allocated, not even for a moment), then gives the buffers real storage and computes them with
the model's own ``_init_weights``, the way ``from_pretrained`` does after its own meta construction
(rotary ``inv_freq`` comes out exactly as ``from_pretrained``'s). A model whose ``_init_weights``
leaves a buffer unset (transformers 4.x computes buffers only in ``__init__``) is built the older
way instead: each parameter moved to meta as it registers. The engine (ZeRO 2/3) shards the meta
model and allocates only this rank's shards. ``check_model_dir`` (``model_dir.py``) checks the
directory before any worker starts.

``load_pretrained_weights`` is ``torch.distributed.checkpoint.load`` with its HuggingFace safetensors
reader: the model's parameters (FSDP2's as ``DTensor`` shards) and persistent buffers, keyed by
the files' names, are the load target; DCP's planner works out which part of each saved tensor
this rank's shard holds (any placement), and the reader copies just that part
(``get_slice``) into the shard, casting (bf16 files -> fp32 master weights). One change to the
stock reader, for memory: it reads each request in blocks of at most ``block_bytes``, each through
its own mapping of the file, where the stock reader keeps a file mapped while it reads all of this
rank's tensors in it (a mapped file's touched pages count in the rank's RSS until unmapped). A
rank's peak host memory while loading is its own shards plus one block
(``bench/load_memory.py``). A tied ``lm_head`` is one parameter and not in the files: it is filled
through the embedding. Persistent buffers present in the files are loaded too.

At ZeRO 0/1 (whole replicas) keep ``from_pretrained``; ``load_pretrained_weights`` also fills a
plain (unsharded) model, reading whole tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader

from ulysses_sp.state.model_dir import (
    auto_model_class,
    check_model_dir,
    file_keys,
    load_config,
    merged_message,
    shape_mismatch,
    weight_files,
)

__all__ = ["check_model_dir", "init_empty_model", "load_pretrained_weights", "weight_files"]

BLOCK_BYTES = 8 * 2**20
"""Largest piece of a file one read maps (a rank's transient above its shards while loading)."""


def init_empty_model(
    path: str, *, attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32
) -> nn.Module:
    """The ``AutoModelForCausalLM`` of the HF directory ``path`` (``AutoModelForImageTextToText`` for a
    vision-language model: ``model_dir.auto_model_class``) with parameters on the meta device.

    Args:
        path: a local HF model directory (``config.json`` + safetensors weights).
        attn_implementation: the core attention (as ``from_pretrained``'s argument).
        dtype: the parameters' dtype once materialised: fp32 master weights by default (mixed
            precision casts the compute copy, ``precision.py``).
    """
    return empty_model_from_config(load_config(path), attn_implementation=attn_implementation, dtype=dtype)


def empty_model_from_config(
    config: Any, *, attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32
) -> nn.Module:
    """``init_empty_model`` for a transformers ``config`` (no directory, no weights): parameters on
    the meta device, buffers computed on the CPU (the rehearsal builds its model this way)."""
    build = lambda: auto_model_class(config).from_config(  # noqa: E731
        config, attn_implementation=attn_implementation, dtype=dtype
    )
    with torch.device("meta"):
        model = build()
    if not _materialize_buffers(model):  # a model whose _init_weights leaves a buffer unset
        with _parameters_on_meta():
            model = build()
    return model


def _materialize_buffers(model: nn.Module) -> bool:
    """Real (CPU) storage for every buffer, computed by the ``_init_weights`` of the innermost
    ``PreTrainedModel`` holding it (a composite model's parts have their own), as ``from_pretrained``
    initialises what its files do not hold. ``False`` when some floating buffer stays unset (its
    NaN fill survives: a model, or a transformers 4.x, that computes buffers only in ``__init__``)."""
    from transformers import PreTrainedModel

    unset: list[torch.Tensor] = []

    def visit(module: nn.Module, owner: Any) -> None:
        owner = module if isinstance(module, PreTrainedModel) else owner
        if any(b is not None for b in module._buffers.values()):
            for name, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[name] = new = torch.empty_like(buf, device="cpu")
                    if new.is_floating_point():
                        unset.append(new.fill_(float("nan")))
            with torch.no_grad():
                owner._init_weights(module)  # parameters still on meta: their init does nothing
        for child in module.children():
            visit(child, owner)

    visit(model, model)
    return not any(b.isnan().any() for b in unset)


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """The fallback: every parameter a module registers moves to the meta device at once (created
    on the CPU, never written: untouched pages), buffers computed for real by ``__init__``; this is
    ``accelerate.init_empty_weights(include_buffers=False)``'s mechanism, undone on exit."""
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


class _BlockReader(HuggingFaceStorageReader):
    """DCP's HuggingFace safetensors reader, reading each request in row blocks of at most
    ``block_bytes``, each through its own mapping (see the module docstring)."""

    def __init__(self, path: str, block_bytes: int = BLOCK_BYTES) -> None:
        super().__init__(path)
        self.block_bytes = block_bytes

    def read_data(self, plan: Any, planner: Any) -> Any:  # (LoadPlan, LoadPlanner) -> Future[None]
        from safetensors import safe_open
        from torch.futures import Future

        for req in plan.items:
            info = self.storage_data[
                req.storage_index
            ]  # relative_path: the full path, as read_metadata stores it
            file = info.relative_path
            fqn = req.storage_index.fqn
            target = planner.resolve_tensor(req).detach()  # this rank's part of the tensor, a view
            if target.dim() == 0:
                with safe_open(file, framework="pt") as f:
                    target.copy_(f.get_tensor(fqn))
            else:
                rest = tuple(slice(o, o + n) for o, n in zip(req.storage_offsets[1:], req.lengths[1:]))
                row_bytes = max(1, target[0].numel() * info.dtype.itemsize)
                step = max(1, self.block_bytes // row_bytes)
                first = req.storage_offsets[0]
                for r in range(0, req.lengths[0], step):
                    n = min(step, req.lengths[0] - r)
                    with safe_open(file, framework="pt") as f:  # unmapped after each block
                        target[r : r + n].copy_(f.get_slice(fqn)[(slice(first + r, first + r + n), *rest)])
            planner.commit_tensor(req, target)
        done: Future = Future()
        done.set_result(None)
        return done


def _targets(module: nn.Module, saved: dict[str, Any], path: str) -> dict[str, torch.Tensor]:
    """The load targets, keyed as the files key them (``model_dir.file_keys``: transformers' renames
    applied): each parameter once (a tied one under whichever of its names the files hold:
    ``lm_head.weight`` is usually absent), FSDP2 parameters as their ``DTensor`` shards, and the
    persistent buffers the files hold. Tensors transformers must combine are refused by name."""
    direct, merged = file_keys(module, saved)
    if merged:
        raise ValueError(merged_message(path, merged))
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    targets, missing = {}, []
    for p in module.parameters():
        key = next((direct[n] for n in names[id(p)] if n in direct), None)
        if key is None:
            missing.append(names[id(p)][0])
        else:
            targets[key] = p.detach()
    if missing:
        raise ValueError(f"{path!r} lacks weights for {len(missing)} parameter(s): {sorted(missing)[:8]}")
    for name, buf in module.named_buffers():
        prefix, _, leaf = name.rpartition(".")
        owner = module.get_submodule(prefix) if prefix else module
        if name in direct and leaf not in owner._non_persistent_buffers_set:
            targets[direct[name]] = buf
    for name, value in targets.items():
        if tuple(saved[name].size) != tuple(value.shape):
            raise ValueError(shape_mismatch(path, name, tuple(saved[name].size), tuple(value.shape)))
    return targets


def load_pretrained_weights(
    module: nn.Module, path: str, *, process_group: Any = None, block_bytes: int = BLOCK_BYTES
) -> None:
    """Fill ``module``'s parameters (FSDP2 shards or plain) and persistent buffers from ``path``.

    A collective over ``process_group`` (default: the world; no group needed in one process): DCP
    plans the reads together. Each rank reads only the part of each tensor its shards hold, cast to
    the parameter's dtype. Every rank reads the files itself (one node, or a file system every
    node sees).

    Raises:
        ValueError: a parameter the files lack (tied aliases excepted), or a tensor whose shape
            differs from the model's (naming both).
    """
    import torch.distributed.checkpoint as dcp

    weight_files(path)  # a clear error for a directory without weights, a bad index, a missing shard
    reader = _BlockReader(path, block_bytes)
    saved = reader.read_metadata().state_dict_metadata
    targets = _targets(module, saved, path)
    with torch.no_grad():
        dcp.load(targets, storage_reader=reader, process_group=process_group)
