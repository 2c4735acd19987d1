"""The ``train`` command's settings and everything checked before any process starts.

``TrainConfig`` is what ``ulysses-sp train`` (and ``ulysses_sp.train.run``) takes;
``validate(cfg, world_size)`` checks sizes, model, tokenizer, data, output directory and resume
compatibility without processes or collectives, so every rank (or the launching process) reaches
the same verdict, and raises ``ValueError`` naming the numbers. ``manifest_for`` is what a
checkpoint records and a resume compares; ``prepare_output_dir`` readies the run directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from typing import Any

from . import checkpoint as ckpt
from . import tasks

ATTN_CHOICES = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
RUN_KEYS = ("model", "data", "seq_len", "micro_batch_size", "grad_accum", "seed", "attn")
"""Settings a resumed run must share with its checkpoint (else the batches or model differ)."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything ``run`` needs; the CLI flags of the same names fill it."""

    model: str = "tiny-llama"
    """A preset (``tiny-llama``, ``tiny-qwen2``, ``tiny-mistral``) or a local HF model directory."""
    data: str = "recall"
    """``recall`` (the embedded task) or a local ``.txt``/``.jsonl`` file or directory."""
    tokenizer: str | None = None
    """Tokenizer directory; ``None``: the model directory's own, else the byte-level tokenizer."""
    seq_len: int = 256
    """Tokens per sample (the full sequence ``S``; each SP rank holds ``S / sp``)."""
    sp: int = 2
    """Sequence-parallel size ``P``; ``dp = world_size / P``."""
    zero_stage: int = 0
    """0: DDP; 1: + sharded optimizer state; 2: FSDP2 grads+state; 3: FSDP2 params too."""
    micro_batch_size: int = 8
    """Samples per micro-step per data-parallel replica (an SP group shares them)."""
    grad_accum: int = 1
    """Micro-steps per optimizer step."""
    steps: int = 300
    """Optimizer steps to train (in total, counting those before a resume)."""
    lr: float = 1e-2
    """Peak learning rate (AdamW; linear warmup, then cosine to 10%)."""
    warmup_steps: int | None = None
    """Warmup steps; ``None``: ``min(20, steps // 10)``."""
    grad_clip: float = 1.0
    """Max global gradient norm; 0 = no clipping."""
    seed: int = 0
    """Model init (presets), data order, recall samples."""
    attn: str = "sdpa"
    """Core attention run over the full sequence."""
    output_dir: str = "runs/ulysses-sp"
    """Where checkpoints and (by default) the metrics file go."""
    save_every: int = 0
    """Checkpoint every N optimizer steps; 0 = only at the end (always saved at the end)."""
    resume: str | None = None
    """``"latest"``, a checkpoint directory, or a run directory; ``None`` = fresh run."""
    overwrite: bool = False
    """Replace another run's checkpoints in ``output_dir`` instead of refusing."""
    metrics_file: str | None = None
    """JSONL, one object per optimizer step; ``None``: ``<output_dir>/metrics.jsonl``."""
    tiled_mlp: bool = False
    """Run MLP blocks in sequence tiles (ALST ``TiledMLP``)."""
    tiled_mlp_shards: int | None = None
    """Tiles for the tiled MLP; ``None`` = auto."""
    tiled_loss: bool = False
    """Compute logits + loss in sequence tiles (no full ``[S_l, vocab]`` logits)."""
    tiled_loss_shards: int | None = None
    """Tiles for the tiled loss; ``None`` = auto."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in backward."""
    offload_activations: bool = False
    """Keep checkpointed layer inputs in host memory (needs ``activation_checkpointing``)."""
    progress: bool = True
    """Show a progress bar on rank 0."""

    @property
    def metrics_path(self) -> str:
        return self.metrics_file or os.path.join(self.output_dir, "metrics.jsonl")


# ---------------------------------------------------------------- validation (no processes)
def _positive(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"--{name.replace('_', '-')} must be an int >= {minimum}, got {value!r}")


def model_config(cfg: TrainConfig, vocab_size: int):
    """The transformers config of ``cfg.model`` (preset or directory), without building weights."""
    if tasks.is_preset(cfg.model):
        return tasks.preset_config(cfg.model, vocab_size=vocab_size)
    tasks.check_model_dir(cfg.model)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(cfg.model, local_files_only=True)


def manifest_for(cfg: TrainConfig, world_size: int, model_cfg) -> dict[str, Any]:
    """The ``world`` / ``run`` / ``model_config`` sections a checkpoint records and resume compares."""
    mc = model_cfg.to_dict()
    # what may legitimately differ between the saving and the resuming run: not the architecture
    ignore = (
        "_attn_implementation_autoset",
        "attn_implementation",
        "transformers_version",
        "dtype",
        "_name_or_path",
    )
    for key in ignore:
        mc.pop(key, None)
    return {
        "world": {
            "world_size": world_size,
            "sp": cfg.sp,
            "dp": world_size // cfg.sp,
            "zero_stage": cfg.zero_stage,
        },
        "run": {k: getattr(cfg, k) for k in RUN_KEYS},
        "model_config": json.loads(json.dumps(mc, default=str)),
        "steps": cfg.steps,
        "lr": cfg.lr,
    }


def validate(cfg: TrainConfig, world_size: int) -> dict[str, Any]:
    """Check ``cfg`` for a run on ``world_size`` processes; return the run's manifest.

    Deterministic and free of collectives: every rank (or the launching process) can call it and
    all reach the same verdict. Raises ``ValueError`` naming what is wrong.
    """
    from .attention import check_heads

    for name in ("seq_len", "sp", "micro_batch_size", "grad_accum", "steps"):
        _positive(name, getattr(cfg, name))
    _positive("save_every", cfg.save_every, 0)
    if world_size % cfg.sp:
        raise ValueError(
            f"--nproc / world size ({world_size}) is not divisible by --sp ({cfg.sp}): "
            f"dp = world_size / sp must be an integer; use --sp in "
            f"{[p for p in range(1, world_size + 1) if world_size % p == 0]}"
        )
    if cfg.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"--zero-stage must be 0, 1, 2 or 3, got {cfg.zero_stage}")
    if cfg.attn not in ATTN_CHOICES:
        raise ValueError(f"--attn must be one of {ATTN_CHOICES}, got {cfg.attn!r}")
    if cfg.seq_len % cfg.sp:
        raise ValueError(
            f"--seq-len ({cfg.seq_len}) is not divisible by --sp ({cfg.sp}); "
            f"use a multiple of {cfg.sp}, e.g. {cfg.seq_len + cfg.sp - cfg.seq_len % cfg.sp}"
        )
    if not cfg.lr > 0:
        raise ValueError(f"--lr must be > 0, got {cfg.lr}")
    if cfg.offload_activations and not cfg.activation_checkpointing:
        raise ValueError(
            "--offload-activations needs --activation-checkpointing: offload moves the one input each "
            "checkpointed layer keeps for backward to host memory; without checkpointing there is "
            "nothing it could offload"
        )
    tokenizer = tasks.load_tokenizer(cfg.tokenizer, cfg.model)
    mcfg = model_config(cfg, len(tokenizer))
    if len(tokenizer) > mcfg.vocab_size:
        raise ValueError(
            f"tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {mcfg.vocab_size}; "
            "pass the model's own tokenizer with --tokenizer"
        )
    check_heads(
        mcfg.num_attention_heads,
        getattr(mcfg, "num_key_value_heads", None) or mcfg.num_attention_heads,
        cfg.sp,
    )
    tasks.build_dataset(cfg.data, tokenizer=tokenizer, seq_len=cfg.seq_len, seed=cfg.seed, num_samples=1)
    manifest = manifest_for(cfg, world_size, mcfg)
    check_output_dir(cfg, manifest)
    return manifest


def check_output_dir(cfg: TrainConfig, manifest: dict[str, Any]) -> None:
    """Refuse to mix runs: another run's checkpoints need ``--resume`` or ``--overwrite``;
    ``--resume`` needs a compatible checkpoint (the message lists every difference)."""
    if cfg.resume is not None:
        if cfg.overwrite:
            raise ValueError("--resume and --overwrite contradict each other; pass one of them")
        path = ckpt.resolve_resume(cfg.resume, cfg.output_dir)
        diffs = ckpt.compare_manifests(ckpt.read_manifest(path), manifest)
        if diffs:
            raise ValueError(
                f"--resume {path!r} does not match this run:\n  "
                + "\n  ".join(diffs)
                + "\nresume with the checkpoint's settings, or start a new run in another --output-dir"
            )
        return
    existing = ckpt.list_checkpoints(cfg.output_dir)
    if existing and not cfg.overwrite:
        raise ValueError(
            f"--output-dir {cfg.output_dir!r} already holds checkpoints of a run "
            f"({', '.join(os.path.basename(p) for _, p in existing[-3:])}); pass --resume to continue it, "
            "--overwrite to replace it, or choose another --output-dir"
        )


def prepare_output_dir(cfg: TrainConfig, resumed_step: int | None) -> None:
    """Rank 0: create the output dir; with ``--overwrite`` remove the old run's checkpoints and
    metrics (only those); on resume drop metrics lines past the resumed step."""
    os.makedirs(cfg.output_dir, exist_ok=True)
    if cfg.overwrite:
        for _, path in ckpt.list_checkpoints(cfg.output_dir):
            shutil.rmtree(path)
        if os.path.exists(cfg.metrics_path):
            os.remove(cfg.metrics_path)
    for name in os.listdir(cfg.output_dir):
        if name.startswith(ckpt.TMP_PREFIX):  # left by a run killed while saving
            shutil.rmtree(os.path.join(cfg.output_dir, name), ignore_errors=True)
    metrics_dir = os.path.dirname(cfg.metrics_path)
    if metrics_dir:
        os.makedirs(metrics_dir, exist_ok=True)
    if resumed_step is not None and os.path.exists(cfg.metrics_path):
        with open(cfg.metrics_path, encoding="utf-8") as f:
            keep = [line for line in f if line.strip() and json.loads(line)["step"] <= resumed_step]
        with open(cfg.metrics_path, "w", encoding="utf-8") as f:
            f.writelines(keep)
    elif resumed_step is None and os.path.exists(cfg.metrics_path):
        os.remove(cfg.metrics_path)


def config_from_dict(values: dict[str, Any]) -> TrainConfig:
    """A ``TrainConfig`` from a dict (e.g. a ``--config`` JSON file); unknown keys are an error."""
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown training option(s) {unknown}; known: {sorted(known)}")
    return TrainConfig(**values)
