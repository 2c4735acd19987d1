"""The ``train`` command's settings: ``RunConfig``, one field per flag, and their startup summary.

``RunConfig`` is what ``ulysses-sp train`` (and ``ulysses_sp.run.loop.run``) takes, optimizer and
schedule recipe included; ``RunConfig.training_config()`` is the engine's ``TrainingConfig`` it
means; ``config_from_dict`` builds one from a ``--config`` JSON object. What is checked before any
process starts is ``train_checks``'s; the run directory (manifest, output-dir checks) ``rundir``'s.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ulysses_sp import tasks
from ulysses_sp.attention.core import describe_paths
from ulysses_sp.config import TrainingConfig
from ulysses_sp.config.sections import (
    BF16Config,
    FP16Config,
    OffloadConfig,
    OptimizerConfig,
    SchedulerConfig,
    ZeroConfig,
)
from ulysses_sp.run.prelaunch import check_option_types

PRESET_DEFAULTS: dict[str, Any] = {"lr": 1e-2, "micro_batch_size": 8}
"""A preset is a randomly initialised toy (the recall task's recipe): a high rate learns in minutes."""
MODEL_DIR_DEFAULTS: dict[str, Any] = {"lr": 1e-5, "micro_batch_size": 1}
"""A model directory is a trained model being fine-tuned, usually on long sequences: a rate of the usual
full fine-tuning range (1e-2 would wreck its weights in a few steps) and one sample per micro-step."""


def model_defaults(model: str) -> dict[str, Any]:
    """``lr`` and ``micro_batch_size`` when not given: a preset's, else a model directory's (``plan``
    uses them too, a named shape as a directory)."""
    return dict(PRESET_DEFAULTS if tasks.is_preset(model) else MODEL_DIR_DEFAULTS)


@dataclass(frozen=True, kw_only=True)
class RunConfig(tasks.DataSettings):
    """One training run, everything ``run`` needs; the CLI flags of the same names fill it. The engine's
    ``config.TrainingConfig`` (optimizer, ZeRO, precision sections) is derived from it by ``training_config()``."""

    model: str = "tiny-llama"
    """A preset (``tiny-llama``, ``tiny-qwen2``, ``tiny-mistral``) or a local HF model directory."""
    data: str = "recall"
    """``recall`` (the embedded task) or local data: a ``.txt``/``.jsonl``/``.json``/``.parquet``/``.arrow``
    file, a directory of them, or a ``datasets`` ``save_to_disk`` directory."""
    tokenizer: str | None = None
    """Tokenizer directory; ``None``: the model directory's own, else the byte-level tokenizer."""
    seq_len: int = 256
    """Tokens per sample (the full sequence ``S``; each SP rank holds ``S / sp``)."""
    sp: int = 2
    """Sequence-parallel size ``P``; ``dp = world_size / P``."""
    zero_stage: int = 0
    """0: DDP; 1: + sharded optimizer state; 2: FSDP2 grads+state; 3: FSDP2 params too."""
    micro_batch_size: int | None = None
    """Samples per micro-step per data-parallel replica (an SP group shares them); ``None``: the
    model's default (``model_defaults``: 8 for a preset, 1 for a model directory)."""
    grad_accum: int = 1
    """Micro-steps per optimizer step."""
    steps: int = 300
    """Optimizer steps to train (in total, counting those before a resume)."""
    lr: float | None = None
    """Peak learning rate of AdamW (warmup to it, then a cosine down to ``cos_min_ratio * lr``);
    ``None``: the model's default (``model_defaults``: 1e-2 for a preset, 1e-5 for a model directory)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's ``(beta1, beta2)``, each in ``[0, 1)``."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay (``>= 0``)."""
    warmup_steps: int | None = None
    """Warmup steps; ``None``: from ``warmup_ratio``, else ``min(20, steps // 10)`` (at least 1)."""
    warmup_ratio: float | None = None
    """Warmup as a fraction of ``steps`` in ``[0, 1]``: ``ceil(warmup_ratio * steps)`` steps (at
    least 1); ``None``: see ``warmup_steps``. Giving both is an error."""
    warmup_min_ratio: float = 0.05
    """Learning rate at step 0 as a fraction of ``lr`` (the warmup ramps from it to 1)."""
    cos_min_ratio: float = 0.1
    """Learning rate at the last step as a fraction of ``lr`` (the floor of the cosine)."""
    warmup_type: str = "linear"
    """Shape of the warmup ramp: ``"linear"`` or ``"log"`` (DeepSpeed's)."""
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
    disk_layers: int = 0
    """With ``offload_activations``: the first N layers' inputs go to files under ``offload_dir``
    instead of host memory (``memory.disk_offload``)."""
    offload_dir: str | None = None
    """Directory for ``disk_layers``' files (a local NVMe); ``None``: the system's temporary directory."""
    recompute_norms: bool = False
    """Each RMSNorm inside the decoder layers keeps only its input and output and recomputes the rest
    in backward (``memory.norms``: exact, one more norm forward per norm)."""
    progress: bool = True
    """Show a progress bar on rank 0."""

    memory: str | None = None
    """Memory budget per rank (``"20GB"``) for the planner's fit check; ``None``: the device's."""
    force: bool = False
    """Start even when the planner predicts the run does not fit (warn instead of refusing)."""
    profile_comm: bool = False
    """Time collectives (device syncs): ``comm_s``, ``dp_comm_s``, ``compute_s`` in the metrics."""
    memory_every: int | None = None
    """Measure ``peak_mem_bytes`` on steps 1-3, the last step and every ``memory_every``-th; ``None``:
    every step on an accelerator (its allocator counts for free), every 25th on CPU (where the count
    runs every op through Python: about twice a small model's step time)."""
    zero_partition: str = "auto"
    """ZeRO partitions span the DP axis (``data_parallel``) or all dp*sp ranks (``all``); ``auto``:
    ``all`` where the DP axis is one rank at ZeRO >= 1 (it would partition nothing), else
    ``data_parallel`` (``partition_for``)."""
    report_to: str = "none"
    """Where the metrics go besides ``metrics.jsonl``: ``none``, ``tensorboard`` (event files in
    ``<output_dir>/runs``), ``wandb`` (offline unless ``WANDB_MODE`` says otherwise), or both
    comma-separated; rank 0 writes, with the HF Trainer's names (``run.report``)."""
    plot: bool = True
    """Draw the run's loss curve into ``loss.png`` beside the metrics file at the end (needs matplotlib)."""

    dtype: str = "fp32"
    """Compute dtype: ``fp32``, ``bf16`` or ``fp16`` (mixed precision: fp32 master weights and state)."""
    cpu_offload: bool = False
    """Parameters, gradients and the optimizer step in host memory (ZeRO stage 3, FSDP2)."""
    save_dtype: str | None = None
    """Dtype of the exported HF weights (``fp32``/``bf16``/``fp16``); ``None``: the fp32 master weights."""

    ring_size: int | None = None
    """Hybrid Ulysses x Ring: ring groups the SP axis factors into; ``None`` = auto (1 when the heads allow)."""
    attn_chunk: int | None = None
    """Tokens per block of the blockwise attention core (sdpa: packed documents, windows, offload); ``None`` = auto."""
    offload_attention: bool = False
    """Ulysses-Offload (sdpa): the full-sequence K/V on the host between forward and backward."""
    head_chunks: int = 1
    """Head groups the SP attention exchanges and attends one at a time (less peak memory, one more
    q/k/v exchange and attention forward per layer in backward); 1 = all heads at once."""
    head_chunk_overlap: bool = False
    """With ``head_chunks > 1`` at sp > 1: post the next head group's exchange before this group's core
    (``attention/block_overlap.py``); two groups' exchanged q/k/v alive."""
    exchange: str = "auto"
    """The SP attention's all-to-all: ``packed``, ``headwise`` or ``auto`` (packed below the link's per-piece
    byte threshold, ``parallel/exchange_cost.py``)."""

    split_images: str = "auto"
    """A VLM's vision tower over the SP group (``vlm.split``): ``auto`` splits a micro-batch's frames when
    every rank gets a whole one (decided per micro-batch from its grids), ``off`` never (each rank encodes
    the frames its shard touches), ``on`` requires the split (a micro-batch that cannot is refused)."""

    max_nonfinite_steps: int = 3
    """Optimizer steps in a row with a non-finite loss or gradient norm that are skipped; the next
    one stops the run (the divergence guard)."""
    save_on_signal: float = 0.0
    """Seconds: on SIGTERM (preemption) finish the current step, save a checkpoint and stop once it
    is saved; past this many seconds the ranks stop anyway. 0 = stop at once."""
    allow_data_change: bool = False
    """``--resume`` even though the data's fingerprint differs from the checkpoint's."""

    def __post_init__(self) -> None:
        for name, value in model_defaults(self.model).items():  # None: this kind of model's default
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)

    def partition_for(self, world_size: int) -> str:
        """The ZeRO partition this run uses on ``world_size`` processes (``auto`` resolved)."""
        if self.zero_partition != "auto":
            return self.zero_partition
        return "all" if self.zero_stage >= 1 and world_size // self.sp == 1 else "data_parallel"

    @property
    def metrics_path(self) -> str:
        """Where the metrics JSONL goes: ``metrics_file``, else ``<output_dir>/metrics.jsonl``."""
        return self.metrics_file or os.path.join(self.output_dir, "metrics.jsonl")

    @property
    def warmup_num_steps(self) -> int:
        """The warmup length the settings mean (see ``warmup_steps`` and ``warmup_ratio``)."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        if self.warmup_ratio is not None:
            # rounded first: 0.1 * 30 is 3.0000000000000004 in floating point, and means 3
            return max(1, math.ceil(round(self.warmup_ratio * self.steps, 6)))
        return max(1, min(20, self.steps // 10))

    def training_config(self, world_size: int | None = None) -> TrainingConfig:
        """The engine's config for this run on ``world_size`` processes: batch sizes, clipping, ZeRO stage
        and partition, AdamW and a warmup + cosine ``WarmupCosineLR`` over ``steps`` (the mesh comes from
        ``mesh_param``/``mpu``). ``world_size`` may be left out when ``zero_partition`` is not ``auto``."""
        if world_size is None and self.zero_partition == "auto":
            if self.zero_stage >= 1:
                raise ValueError("zero_partition 'auto' depends on the world size: training_config(world_size), "
                                 "or give zero_partition 'data_parallel' or 'all'")  # fmt: skip
            world_size = self.sp  # ZeRO 0 partitions nothing: either answer is the same
        warmup = self.warmup_num_steps
        return TrainingConfig(
            train_micro_batch_size_per_gpu=self.micro_batch_size,
            gradient_accumulation_steps=self.grad_accum,
            gradient_clipping=self.grad_clip,
            zero_optimization=ZeroConfig(
                stage=self.zero_stage,
                partition=self.partition_for(world_size or self.sp),
                offload_param=OffloadConfig(device="cpu") if self.cpu_offload else None,
                offload_optimizer=OffloadConfig(device="cpu") if self.cpu_offload else None,
            ),
            bf16=BF16Config(enabled=self.dtype == "bf16"),
            fp16=FP16Config(enabled=self.dtype == "fp16"),
            optimizer=OptimizerConfig(
                type="AdamW",
                params={"lr": self.lr, "betas": tuple(self.betas), "weight_decay": self.weight_decay},
            ),
            max_nonfinite_steps=self.max_nonfinite_steps,
            scheduler=SchedulerConfig(
                type="WarmupCosineLR",
                params={
                    "total_num_steps": max(self.steps, warmup),
                    "warmup_num_steps": warmup,
                    "warmup_min_ratio": self.warmup_min_ratio,
                    "cos_min_ratio": self.cos_min_ratio,
                    "warmup_type": self.warmup_type,
                },
            ),
        )


def config_from_dict(values: dict[str, Any]) -> RunConfig:
    """A ``RunConfig`` from a dict (e.g. a ``--config`` JSON file); unknown keys are an error."""
    known = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown training option(s) {unknown}; known: {sorted(known)}")
    check_option_types(RunConfig, values)
    if isinstance(values.get("betas"), list):  # JSON has no tuples
        values = {**values, "betas": tuple(values["betas"])}
    return RunConfig(**values)


def _on_off(flag: bool, shards: int | None = None) -> str:
    if not flag:
        return "off"
    return "on" if shards is None else f"on ({shards} tiles)"


def _ring_note(mesh) -> str:
    return f" (ring {mesh.ring_size} x ulysses {mesh.ulysses_size}: ring attention)" if mesh.ring_size > 1 else ""


def _default_note(cfg: RunConfig) -> str:
    if cfg.lr != model_defaults(cfg.model)["lr"]:
        return ""
    return " (a preset's default)" if tasks.is_preset(cfg.model) else " (the default for a model directory: --lr)"


def unpartitioned_warning(cfg: RunConfig, world_size: int) -> str | None:
    """The warning for ZeRO >= 1 over a partition of one rank out of several: it shards nothing."""
    if cfg.zero_stage == 0 or world_size == 1 or cfg.partition_for(world_size) == "all" or world_size > cfg.sp:
        return None
    return (f"--zero-stage {cfg.zero_stage} --zero-partition data_parallel with dp 1 partitions nothing: each of "
            f"the {world_size} ranks holds the whole model's parameters, gradients and optimizer state; "
            f"--zero-partition all (the default, auto, at dp 1) partitions them over all {world_size} ranks")  # fmt: skip


def zero_note(cfg: RunConfig, world_size: int) -> str:
    """``ZeRO stage 3, partitioned over all 4 ranks (--zero-partition all)``: what the stage shards
    and over how many ranks; says so when a partition of one rank shards nothing."""
    if cfg.zero_stage == 0:
        return "ZeRO stage 0 (DDP: every rank holds the whole model's states)"
    part = cfg.partition_for(world_size)
    ranks = world_size if part == "all" else world_size // cfg.sp
    where = "all dp x sp ranks" if part == "all" else "the DP axis"
    note = f"ZeRO stage {cfg.zero_stage}, partitioned over {ranks} rank(s) ({where}, --zero-partition {part})"
    return note + (": NOTHING IS PARTITIONED (see the warning)" if unpartitioned_warning(cfg, world_size) else "")


def startup_summary(cfg: RunConfig, engine, model, dataset, resumed: str | None) -> str:
    n_params = sum(p.numel() for p in model.parameters())
    bs = engine.batch_sizes
    lines = [
        f"ulysses-sp train: {dist.get_world_size()} processes = dp {engine.dp_size} x sp {engine.sp_size}"
        f"{_ring_note(engine.mesh)}, device {engine.device.type} ({dist.get_backend()})",
        f"  {zero_note(cfg, dist.get_world_size())}",
        f"  model {cfg.model}: {type(model).__name__}, {n_params / 1e6:.3f}M params, attention {cfg.attn}"
        + (" inside Ulysses SP" if engine.sp_size > 1 else "")
        + (
            f" ({describe_paths(cfg.attn, attn_chunk=cfg.attn_chunk, offload_attention=cfg.offload_attention)})"
            if engine.sp_size > 1 or cfg.offload_attention or cfg.attn_chunk is not None
            else ""
        ),  # fmt: skip
        f"  data {cfg.data}: {len(dataset)} samples of {cfg.seq_len} tokens; {cfg.seq_len // engine.sp_size} "
        f"tokens per rank; global batch {bs.train_batch_size} = micro {bs.train_micro_batch_size_per_gpu} x "
        f"accum {bs.gradient_accumulation_steps} x dp {bs.dp_world_size}",
        f"  steps {cfg.steps}, AdamW lr {cfg.lr}{_default_note(cfg)} betas {tuple(cfg.betas)} weight decay {cfg.weight_decay}, "
        f"warmup {cfg.warmup_num_steps} steps, seed {cfg.seed}",
        f"  output {cfg.output_dir}, metrics {cfg.metrics_path}"
        + (f"; resumed from {resumed}" if resumed else ""),
        *filter(None, [tasks.data_summary(dataset)]),
        f"  ALST: tiled MLP {_on_off(cfg.tiled_mlp, cfg.tiled_mlp_shards)}, tiled loss "
        f"{_on_off(cfg.tiled_loss, cfg.tiled_loss_shards)}, activation checkpointing "
        f"{_on_off(cfg.activation_checkpointing)}, activation offload {_on_off(cfg.offload_activations)}, "
        f"norm recompute {_on_off(cfg.recompute_norms)}",
        f"  precision {cfg.dtype}"
        + (" (fp32 master weights, optimizer state and gradient reduction)" if cfg.dtype != "fp32" else "")
        + f"; CPU offload of model states {_on_off(cfg.cpu_offload)}; "
        f"checkpoints saved in {cfg.save_dtype or 'fp32'}"
        + (
            "; weights loaded shard by shard"
            if cfg.zero_stage >= 2 and not tasks.is_preset(cfg.model)
            else ""
        ),
    ]
    return "\n".join(lines)
