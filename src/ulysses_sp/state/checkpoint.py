"""Checkpoints: an HF-format export that plain transformers loads, and a reshardable training state.

Layout of ``<output_dir>/checkpoint-<step>/``::

    config.json, generation_config.json                      # the model, as save_pretrained writes it:
    model.safetensors | model-0000k-of-0000n.safetensors     #   one file, or numbered files + index
        + model.safetensors.index.json                       #   (hf_export: DCP's HF writer)
    tokenizer.json, tokenizer_config.json                    # the run's tokenizer
    manifest.json                                            # format, step, model config, layout, settings
    training_state/dcp/                                      # model + optimizer, torch.distributed.checkpoint
    training_state/rank<r>.pt                                # per rank: scheduler, loss scale, RNG, data
                                                             #   position, counters (small)

The model files are the full weights in the dtype asked for (``save_dtype``; default the fp32
master weights), written by every rank from what it holds (DDP's replica at ZeRO 0/1, FSDP2's
``DTensor`` shards at 2/3) and consolidated by rank 0 (``hf_export``), with a config whose attention is the core
implementation (never the ``ulysses_sp`` registry name, which plain transformers does not know).

The training state is keyed by parameter name with global shapes (``dcp_state``): ``--resume`` on
another layout (other ``nproc``, ``sp``, ZeRO stage) reads the pieces it now holds. The fp32
master weights come from there too, so a bf16 export does not lose precision on resume. Format 1
checkpoints (per-rank optimizer files of one layout, before this format) are refused with a
message (``check_format``): their HF weights still load as a ``--model``.

Atomic: every rank writes into ``.tmp-checkpoint-<step>``, and after a barrier rank 0 renames it to
``checkpoint-<step>``. A run killed while saving leaves only a ``.tmp-`` directory, which is ignored
(and removed by the next save); the previous checkpoint is untouched. Files need a file system that
every rank sees (one node, or a shared mount across nodes).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from typing import Any

import torch
import torch.distributed as dist

from ulysses_sp.parallel.comm import barrier
from ulysses_sp.state.dcp_state import load_state, save_state
from ulysses_sp.state.hf_export import DEFAULT_MAX_SHARD_BYTES, export_hf

logger = logging.getLogger(__name__)

PREFIX = "checkpoint-"
TMP_PREFIX = ".tmp-" + PREFIX
MANIFEST = "manifest.json"
STATE_DIR = "training_state"
DCP_DIR = "dcp"
FORMAT_VERSION = 2
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
def check_format(manifest: dict[str, Any], path: str) -> None:
    """``ValueError`` unless the checkpoint at ``path`` is in this version's format (resumable)."""
    found = manifest.get("format")
    if found != FORMAT_VERSION:
        raise ValueError(
            f"checkpoint {path!r} has format {found!r}; this ulysses-sp resumes format {FORMAT_VERSION} "
            "(a reshardable torch.distributed.checkpoint training state). Its HF weights still load: start a "
            f"new run with --model {path} (the optimizer state and the schedule start afresh)"
        )


def rng_state(device: torch.device) -> dict[str, Any]:
    """This rank's RNG state: Python's, torch's CPU generator and, on an accelerator, ``device``'s."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if device.type != "cpu":
        state["device"] = (device.type, torch.get_device_module(device.type).get_rng_state(device))
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore ``rng_state(device)``; an accelerator state saved on another device type is skipped."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    device_type, device_state = state.get("device", (None, None))
    if device.type != "cpu" and device_type == device.type:
        torch.get_device_module(device.type).set_rng_state(device_state, device)


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
    save_dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> str:
    """Save the HF export + the training state; a collective (every rank calls it).

    Args:
        engine: the ``Engine`` (its ``module`` is the HF model, its ``optimizer``/``lr_scheduler``).
        manifest: JSON-able description of the run (``compare_manifests`` sections); ``step`` is added.
        train_state: this rank's extra state (data position, counters); RNG, scheduler and the
            fp16 loss scale are added here, the model and optimizer go to the DCP state.
        core_attn: the attention implementation written into ``config.json``.
        save_dtype: dtype of the exported weights (``None``: the fp32 master weights).
        max_shard_bytes: above this the export is split into numbered files plus an index.

    Returns:
        The final checkpoint directory.
    """
    rank = dist.get_rank()
    final = os.path.join(output_dir, f"{PREFIX}{step}")
    tmp = os.path.join(output_dir, f"{TMP_PREFIX}{step}")
    group = engine.mesh.reduce_group
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, STATE_DIR))
    barrier(group)
    save_state(engine.module, engine.optimizer, os.path.join(tmp, STATE_DIR, DCP_DIR), group)
    scaler = getattr(engine, "loss_scaler", None)
    state = {
        **train_state,
        "param_groups": [
            {k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups
        ],
        "scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "loss_scaler": scaler.state_dict() if scaler is not None else None,
        "rng": rng_state(engine.device),
    }
    torch.save(state, os.path.join(tmp, STATE_DIR, f"rank{rank}.pt"))
    config = core_attention_config(engine.module, core_attn)
    export_hf(engine.module, tmp, is_writer=rank == 0, config=config, save_dtype=save_dtype,
              max_shard_bytes=max_shard_bytes)  # fmt: skip
    if rank == 0:
        generation = getattr(engine.module, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
            json.dump({"format": FORMAT_VERSION, "step": step, **manifest}, f, indent=2, sort_keys=True)
    barrier(group)  # every rank's file is written before the rename makes the checkpoint visible
    if rank == 0:
        if os.path.exists(final):  # re-saving a step (after --resume from an earlier one)
            shutil.rmtree(final)
        os.replace(tmp, final)
    barrier(group)
    return final


# ---------------------------------------------------------------- loading
def load_model_state(checkpoint_dir: str) -> dict[str, torch.Tensor]:
    """The full state dict of a checkpoint's HF weights (safetensors, possibly sharded), on CPU."""
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(checkpoint_dir) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{checkpoint_dir!r} has no .safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(os.path.join(checkpoint_dir, f)))
    return state


def saved_world_size(manifest: dict[str, Any]) -> int | None:
    """The number of ranks that saved the checkpoint (its manifest's ``world.world_size``), if recorded."""
    size = (manifest.get("world") or {}).get("world_size")
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def missing_rank_states(checkpoint_dir: str, manifest: dict[str, Any]) -> list[str]:
    """The ``training_state/rank<r>.pt`` files a checkpoint saved on ``world.world_size`` ranks lacks
    (every saving rank writes one: a missing one is a damaged checkpoint, not a smaller run)."""
    size = saved_world_size(manifest) or 1
    files = (os.path.join(checkpoint_dir, STATE_DIR, f"rank{r}.pt") for r in range(size))
    return [f for f in files if not os.path.isfile(f)]


def rank_state_file(checkpoint_dir: str, rank: int, manifest: dict[str, Any]) -> str:
    """The per-rank state file ``rank`` resumes from: its own, or rank 0's for a rank the saving run
    did not have (more ranks now: resharded). A saving rank's missing file raises ``ValueError``."""
    missing = missing_rank_states(checkpoint_dir, manifest)
    if missing:
        raise ValueError(
            f"checkpoint {checkpoint_dir!r} is damaged: {missing[0]} is missing (its manifest says "
            f"{saved_world_size(manifest)} ranks saved it, each writing its rank<r>.pt)"
        )
    size = saved_world_size(manifest) or 1
    if rank >= size:
        logger.info("%s was saved on %d ranks: rank %d resumes rank 0's scheduler and RNG state",
                    checkpoint_dir, size, rank)  # fmt: skip
        rank = 0
    return os.path.join(checkpoint_dir, STATE_DIR, f"rank{rank}.pt")


def load_training_state(engine: Any, checkpoint_dir: str) -> dict[str, Any]:
    """Restore the model (fp32 master weights), optimizer, scheduler, loss scale and RNG; return the
    rest (data position, counters). Resharded to the engine's layout; call on every rank.

    The RNG streams are per rank: on a layout with more ranks than the checkpoint's, a rank without
    its own file takes rank 0's (the streams matter for dropout only).
    """
    manifest = read_manifest(checkpoint_dir)
    check_format(manifest, checkpoint_dir)
    rank = dist.get_rank()
    path = rank_state_file(checkpoint_dir, rank, manifest)
    load_state(engine.module, engine.optimizer, os.path.join(checkpoint_dir, STATE_DIR, DCP_DIR),
               engine.mesh.reduce_group)  # fmt: skip
    state = torch.load(path, map_location="cpu", weights_only=False)
    for group, saved in zip(engine.optimizer.param_groups, state.pop("param_groups")):
        group.update(saved)
    scheduler = state.pop("scheduler")
    if engine.lr_scheduler is not None and scheduler is not None:
        engine.lr_scheduler.load_state_dict(scheduler)
    scaler_state = state.pop("loss_scaler", None)
    if getattr(engine, "loss_scaler", None) is not None and scaler_state is not None:
        engine.loss_scaler.load_state_dict(scaler_state)
    set_rng_state(state.pop("rng"), engine.device)
    return state
