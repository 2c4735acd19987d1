"""Checkpoints in standard HF format, plus the training state for exact resume.

Layout of ``<output_dir>/checkpoint-<step>/``::

    config.json, generation_config.json, model.safetensors   # save_pretrained: loads anywhere
    tokenizer.json, tokenizer_config.json                    # the run's tokenizer
    manifest.json                                            # step, model config, world layout, run settings
    training_state/rank<r>.pt                                # per rank: optimizer (this rank's shard),
                                                             # scheduler, RNG, data position, counters

The model files are what ``AutoModelForCausalLM.from_pretrained(dir)`` reads, without ulysses-sp
and without sequence parallelism: the full fp32 weights, gathered from whatever the engine holds
(``get_model_state_dict(full_state_dict=True, cpu_offload=True)``: DDP's replica at ZeRO 0/1,
FSDP2's ``DTensor`` shards at ZeRO 2/3), and a config whose attention is the core implementation
(never the ``ulysses_sp`` registry name, which plain transformers does not know).

The optimizer state is saved per rank as that rank holds it (a ZeRO-1 shard, FSDP2 ``DTensor``
shards as local tensors): no gather of the largest state, and resume needs the same world layout,
which ``manifest.json`` records and ``compare_manifests`` checks (naming what differs).

Atomic: every rank writes into ``.tmp-checkpoint-<step>``, and after a barrier rank 0 renames it to
``checkpoint-<step>``. A run killed while saving leaves only a ``.tmp-`` directory, which is ignored
(and removed by the next save); the previous checkpoint is untouched. Per-rank files need a file
system that every rank sees (one node, or a shared mount across nodes).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from typing import Any

import torch
import torch.distributed as dist

PREFIX = "checkpoint-"
TMP_PREFIX = ".tmp-" + PREFIX
MANIFEST = "manifest.json"
STATE_DIR = "training_state"
FORMAT_VERSION = 1
_CKPT_RE = re.compile(rf"^{PREFIX}(\d+)$")


# ---------------------------------------------------------------- finding checkpoints
def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every complete checkpoint under ``output_dir``, by step."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        m = _CKPT_RE.match(name)
        path = os.path.join(output_dir, name)
        if m and os.path.isfile(os.path.join(path, MANIFEST)):
            found.append((int(m.group(1)), path))
    return sorted(found)


def resolve_resume(resume: str, output_dir: str) -> str:
    """The checkpoint directory ``--resume`` names: ``"latest"`` (newest in ``output_dir``), a
    checkpoint directory, or a run directory (its newest checkpoint). ``ValueError`` if none."""
    if resume != "latest" and os.path.isfile(os.path.join(resume, MANIFEST)):
        return resume
    where = output_dir if resume == "latest" else resume
    found = list_checkpoints(where)
    if not found:
        raise ValueError(
            f"--resume: no checkpoint in {where!r} (looked for {PREFIX}<step>/{MANIFEST}); "
            "start without --resume, or point --resume at a checkpoint directory"
        )
    return found[-1][1]


def read_manifest(checkpoint_dir: str) -> dict[str, Any]:
    with open(os.path.join(checkpoint_dir, MANIFEST), encoding="utf-8") as f:
        return json.load(f)


def compare_manifests(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human-readable differences that make an exact resume impossible (empty: compatible).

    Compares the ``model_config``, ``world`` and ``run`` sections key by key.
    """
    diffs = []
    for section in ("world", "run", "model_config"):
        a, b = saved.get(section, {}), current.get(section, {})
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                diffs.append(f"{section}.{key}: checkpoint has {a.get(key)!r}, this run has {b.get(key)!r}")
    return diffs


# ---------------------------------------------------------------- saving
def _optimizer_and_groups(optimizer: torch.optim.Optimizer) -> tuple[torch.optim.Optimizer, list[dict]]:
    # ZeRO-1 keeps this rank's shard in a local optimizer; its own state_dict() would need a
    # consolidation collective onto one rank. The outer param_groups carry the scheduled lr.
    from torch.distributed.optim import ZeroRedundancyOptimizer

    inner = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return inner, groups


def _to_local(obj: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return obj.to_local().detach().cpu().clone()
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_local(v) for k, v in obj.items()}
    return obj


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def core_attention_config(module: torch.nn.Module, core_attn: str):
    """A copy of ``module.config`` whose attention is ``core_attn`` (loadable without ulysses-sp)."""
    import copy

    config = copy.deepcopy(module.config)
    config._attn_implementation = core_attn
    return config


def save_checkpoint(
    engine: Any,
    output_dir: str,
    step: int,
    *,
    tokenizer: Any,
    manifest: dict[str, Any],
    train_state: dict[str, Any],
    core_attn: str,
) -> str:
    """Save an HF checkpoint + this rank's training state; a collective (every rank calls it).

    Args:
        engine: the ``Engine`` (its ``module`` is the HF model, its ``optimizer``/``lr_scheduler``).
        manifest: JSON-able description of the run (``compare_manifests`` sections); ``step`` is added.
        train_state: this rank's extra state (data position, counters); RNG, optimizer and
            scheduler are added here.
        core_attn: the attention implementation written into ``config.json``.

    Returns:
        The final checkpoint directory.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    rank = dist.get_rank()
    final = os.path.join(output_dir, f"{PREFIX}{step}")
    tmp = os.path.join(output_dir, f"{TMP_PREFIX}{step}")
    # Gather first (a collective on every rank; rank 0 receives the full fp32 weights on CPU).
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(engine.module, options=options)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, STATE_DIR))
    dist.barrier()
    inner, groups = _optimizer_and_groups(engine.optimizer)
    state = {
        **train_state,
        "optimizer": _to_local(inner.state_dict()),
        "param_groups": groups,
        "scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "rng": rng_state(),
    }
    torch.save(state, os.path.join(tmp, STATE_DIR, f"rank{rank}.pt"))
    if rank == 0:
        module = engine.module
        config = core_attention_config(module, core_attn)
        prev = module.config
        module.config = config  # save_pretrained writes self.config; restore it right after
        try:
            module.save_pretrained(tmp, state_dict=full, safe_serialization=True)
        finally:
            module.config = prev
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
            json.dump({"format": FORMAT_VERSION, "step": step, **manifest}, f, indent=2, sort_keys=True)
    dist.barrier()  # every rank's file is written before the rename makes the checkpoint visible
    if rank == 0:
        if os.path.exists(final):  # re-saving a step (after --resume from an earlier one)
            shutil.rmtree(final)
        os.replace(tmp, final)
    dist.barrier()
    return final


# ---------------------------------------------------------------- loading
def load_model_state(checkpoint_dir: str) -> dict[str, torch.Tensor]:
    """The full state dict of a checkpoint's model (safetensors, possibly sharded), on CPU."""
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(checkpoint_dir) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{checkpoint_dir!r} has no .safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(os.path.join(checkpoint_dir, f)))
    return state


def _dtensor_like(value: Any, param: torch.Tensor) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
        if value.dim() == 0:  # Adam's step counter stays a plain scalar
            return value
        local = value.to(param.to_local().device)
        return DTensor.from_local(
            local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
    return value


def load_training_state(engine: Any, checkpoint_dir: str) -> dict[str, Any]:
    """Restore this rank's optimizer, scheduler and RNG state; return the rest (data position...).

    The model weights are loaded separately (``load_model_state``) before the engine wraps the
    model. Call on every rank.
    """
    path = os.path.join(checkpoint_dir, STATE_DIR, f"rank{dist.get_rank()}.pt")
    if not os.path.isfile(path):
        raise ValueError(f"{checkpoint_dir!r} has no training state for rank {dist.get_rank()} ({path})")
    state = torch.load(path, map_location="cpu", weights_only=False)
    inner, _ = _optimizer_and_groups(engine.optimizer)
    inner.load_state_dict(state.pop("optimizer"))
    for group in inner.param_groups:
        for p in group["params"]:
            if p in inner.state:
                inner.state[p] = {k: _dtensor_like(v, p) for k, v in inner.state[p].items()}
    for group, saved in zip(engine.optimizer.param_groups, state.pop("param_groups")):
        group.update(saved)
    scheduler = state.pop("scheduler")
    if engine.lr_scheduler is not None and scheduler is not None:
        engine.lr_scheduler.load_state_dict(scheduler)
    set_rng_state(state.pop("rng"))
    return state
