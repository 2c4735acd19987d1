"""The training loop behind ``ulysses-sp train``, as a library function over a typed config.

``validate(cfg, world_size)`` (in ``train_setup``, with ``TrainConfig``) checks everything that can
be checked without processes and raises ``ValueError`` naming the numbers; ``run(cfg)`` (every
rank, process group initialised) then builds and trains:

1. tokenizer, dataset, model (a preset from ``cfg.seed`` or a local HF directory; on resume the
   checkpoint's weights), ALST transforms (tiled MLP, activation checkpointing / offload);
2. sequence parallelism (``sp > 1``): ``UlyssesSPAttentionHF.register_with_transformers`` ->
   ``mpu``; the engine: ``initialize(model, config, mpu=...)`` (ZeRO stage, AdamW, warmup+cosine);
3. data: ``sp_data_sampler`` per rank -> ``DataLoader`` -> ``UlyssesSPDataLoaderAdapter``, so a run
   with ``sp = P`` processes the same global batches as ``sp = 1`` with the same ``dp``;
4. per optimizer step: ``grad_accum`` micro-steps of ``engine(**batch)`` / ``backward`` / ``step``,
   a metrics line, and every ``save_every`` steps an atomic checkpoint (``checkpoint.py``).

The library never reads argv or launcher variables; the CLI does and passes a ``TrainConfig``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from . import checkpoint as ckpt
from . import tasks
from .train_setup import (  # noqa: F401 - re-exported: the train command's public names
    ATTN_CHOICES,
    RUN_KEYS,
    TrainConfig,
    config_from_dict,
    manifest_for,
    model_config,
    prepare_output_dir,
    validate,
)

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- data position
class DataStream:
    """Endless micro-batches for this rank, resumable from ``(epoch, offset)``.

    ``offset`` counts the adapter micro-steps consumed in ``epoch``; a resumed stream skips whole
    rounds in the sampler (no loading) and the remaining ``offset % sp`` micro-steps of the round.
    """

    def __init__(self, dataset, engine, *, micro_batch_size: int, seed: int, shuffle: bool, pad_id: int,
                 epoch: int = 0, offset: int = 0) -> None:  # fmt: skip
        self.dataset, self.engine = dataset, engine
        self.micro_batch_size, self.seed, self.shuffle, self.pad_id = micro_batch_size, seed, shuffle, pad_id
        self.epoch, self.offset = epoch, offset

    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        from .data import UlyssesSPDataLoaderAdapter, sp_data_sampler

        e, b = self.engine, self.micro_batch_size
        while True:
            sampler = sp_data_sampler(
                self.dataset, e.mesh, batch_size=b, shuffle=self.shuffle, seed=self.seed
            )
            sampler.set_epoch(self.epoch)
            rounds, rest = divmod(self.offset, e.sp_size)
            indices = list(sampler)[rounds * b :]
            loader = DataLoader(self.dataset, batch_size=b, sampler=indices)
            group = e.sp_group if e.sp_size > 1 else None
            adapter = UlyssesSPDataLoaderAdapter(
                loader, e.sp_rank, group, e.sp_size, e.device, pad_token_id=self.pad_id
            )
            for i, batch in enumerate(adapter):
                if i < rest:
                    continue
                self.offset += 1
                yield batch
            self.epoch, self.offset = self.epoch + 1, 0


# ---------------------------------------------------------------- building
def _engine_config(cfg: TrainConfig) -> dict[str, Any]:
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, min(20, cfg.steps // 10))
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage},
        "optimizer": {"type": "AdamW", "params": {"lr": cfg.lr, "betas": [0.9, 0.95], "weight_decay": 0.0}},
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": max(cfg.steps, warmup),
                "warmup_num_steps": warmup,
                "warmup_min_ratio": 0.05,
                "cos_min_ratio": 0.1,
                "warmup_type": "linear",
            },
        },  # fmt: skip
    }


def _techniques(cfg: TrainConfig, model) -> tuple[list[Any], Any]:
    """Apply the ALST transforms to the bare model; return (undo handles, loss_fn or None)."""
    handles: list[Any] = []
    loss_fn = None
    if cfg.tiled_mlp:
        from .tiling_hf import apply_tiled_mlp

        handles.append(apply_tiled_mlp(model, cfg.tiled_mlp_shards))
    if cfg.activation_checkpointing:
        from .offload import enable_activation_checkpointing

        enable_activation_checkpointing(model)
    if cfg.offload_activations:
        from .offload import enable_activation_offload

        handles.append(enable_activation_offload(model))
    if cfg.tiled_loss:
        from .tiling_hf import TiledCausalLMLoss

        loss_fn = TiledCausalLMLoss(num_shards=cfg.tiled_loss_shards)
    return handles, loss_fn


def _on_off(flag: bool, shards: int | None = None) -> str:
    if not flag:
        return "off"
    return "on" if shards is None else f"on ({shards} tiles)"


def startup_summary(cfg: TrainConfig, engine, model, dataset, resumed: str | None) -> str:
    n_params = sum(p.numel() for p in model.parameters())
    bs = engine.batch_sizes
    lines = [
        f"ulysses-sp train: {dist.get_world_size()} processes = dp {engine.dp_size} x sp {engine.sp_size}, "
        f"device {engine.device.type} ({dist.get_backend()}), ZeRO stage {cfg.zero_stage}",
        f"  model {cfg.model}: {type(model).__name__}, {n_params / 1e6:.3f}M params, attention {cfg.attn}"
        + (" inside Ulysses SP" if engine.sp_size > 1 else ""),
        f"  data {cfg.data}: {len(dataset)} samples of {cfg.seq_len} tokens; {cfg.seq_len // engine.sp_size} "
        f"tokens per rank; global batch {bs.train_batch_size} = micro {bs.train_micro_batch_size_per_gpu} x "
        f"accum {bs.gradient_accumulation_steps} x dp {bs.dp_world_size}",
        f"  steps {cfg.steps}, lr {cfg.lr}, seed {cfg.seed}; output {cfg.output_dir}, metrics {cfg.metrics_path}"
        + (f"; resumed from {resumed}" if resumed else ""),
        f"  ALST: tiled MLP {_on_off(cfg.tiled_mlp, cfg.tiled_mlp_shards)}, tiled loss "
        f"{_on_off(cfg.tiled_loss, cfg.tiled_loss_shards)}, activation checkpointing "
        f"{_on_off(cfg.activation_checkpointing)}, activation offload {_on_off(cfg.offload_activations)}",
    ]
    return "\n".join(lines)


def _load_weights(model, state: dict[str, torch.Tensor], where: str) -> None:
    """Load a checkpoint's full state into the bare model; only tied duplicates may be absent."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {
        n for n, _ in model.named_parameters()
    }
    if unexpected or set(missing) - aliases:
        raise ValueError(
            f"{where!r}: weights do not fit the model (missing {missing}, unexpected {unexpected})"
        )


def _num_samples(cfg: TrainConfig, dp: int) -> int:
    # Recall samples are generated, not stored: exactly enough for every step, never repeated.
    return cfg.steps * cfg.micro_batch_size * cfg.grad_accum * dp


# ---------------------------------------------------------------- the loop
def run(cfg: TrainConfig) -> dict[str, Any]:
    """Train on every rank of the initialised process group; return a summary (same on every rank).

    A collective from start to end. Raises ``ValueError`` (on every rank) for bad input.
    """
    from .attention import UlyssesSPAttentionHF
    from .engine import initialize
    from .memory import track_peak_memory

    world, rank = dist.get_world_size(), dist.get_rank()
    manifest = validate(cfg, world)
    resume_dir = ckpt.resolve_resume(cfg.resume, cfg.output_dir) if cfg.resume else None
    saved = ckpt.read_manifest(resume_dir) if resume_dir else {}
    resumed_step = saved.get("step")
    if rank == 0 and resume_dir and (saved.get("steps"), saved.get("lr")) != (cfg.steps, cfg.lr):
        logger.warning(
            "resuming with --steps %s --lr %s, the checkpoint's run had --steps %s --lr %s: the learning-rate "
            "schedule continues as saved in the checkpoint", cfg.steps, cfg.lr, saved.get("steps"), saved.get("lr"),
        )  # fmt: skip
    if rank == 0:
        prepare_output_dir(cfg, resumed_step)
    dist.barrier()

    tokenizer = tasks.load_tokenizer(cfg.tokenizer, cfg.model)
    dp = world // cfg.sp
    dataset = tasks.build_dataset(
        cfg.data, tokenizer=tokenizer, seq_len=cfg.seq_len, seed=cfg.seed, num_samples=_num_samples(cfg, dp)
    )
    model = tasks.build_model(
        cfg.model, vocab_size=len(tokenizer), seed=cfg.seed, attn_implementation=cfg.attn
    )
    if resume_dir:
        _load_weights(model, ckpt.load_model_state(resume_dir), resume_dir)
    handles, loss_fn = _techniques(cfg, model)
    mpu = None
    if cfg.sp > 1:
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model, cfg.attn, cfg.sp, cfg.micro_batch_size, seq_length=cfg.seq_len
        )
    engine, _, _, _ = initialize(
        model, _engine_config(cfg), mesh_param=(dp, cfg.sp) if mpu is None else None, mpu=mpu, loss_fn=loss_fn
    )
    state = {"step": 0, "tokens": 0, "data": {"epoch": 0, "offset": 0}}
    if resume_dir:
        state = ckpt.load_training_state(engine, resume_dir)
    stream = DataStream(
        dataset, engine, micro_batch_size=cfg.micro_batch_size, seed=cfg.seed,
        shuffle=cfg.data != tasks.RECALL, pad_id=tokenizer.pad_token_id or 0, **state["data"],
    )  # fmt: skip
    if rank == 0:
        logger.info(startup_summary(cfg, engine, model, dataset, resume_dir))
    try:
        return _loop(cfg, engine, stream, state, tokenizer, manifest, track_peak_memory)
    finally:
        for h in handles:
            h.remove()
        if mpu is not None:
            mpu.remove()


def _loop(cfg, engine, stream, state, tokenizer, manifest, track_peak_memory) -> dict[str, Any]:
    from tqdm import tqdm

    rank = dist.get_rank()
    step, tokens = state["step"], state["tokens"]
    tokens_per_step = engine.batch_sizes.train_batch_size * cfg.seq_len
    batches = iter(stream)
    engine.train()
    bar = tqdm(
        total=cfg.steps, initial=step, disable=rank != 0 or not cfg.progress, unit="step", dynamic_ncols=True
    )
    metrics = open(cfg.metrics_path, "a", encoding="utf-8") if rank == 0 else None
    losses: list[float] = []
    start = time.perf_counter()
    try:
        while step < cfg.steps:
            t0 = time.perf_counter()
            lr = engine.get_lr()[0]
            with track_peak_memory(engine.device) as mem:
                for _ in range(cfg.grad_accum):
                    out = engine(**next(batches))
                    engine.backward(out.loss)
                    loss = engine.step()
            step, tokens = step + 1, tokens + tokens_per_step
            peak = torch.tensor(mem.peak_bytes, dtype=torch.int64, device=engine.device)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # the busiest rank's peak
            dt = time.perf_counter() - t0
            record = {
                "step": step, "loss": loss, "grad_norm": engine.get_global_grad_norm(), "lr": lr,
                "tokens": tokens, "tokens_per_s": tokens_per_step / dt, "peak_mem_bytes": int(peak.item()),
            }  # fmt: skip
            losses.append(loss)
            if metrics is not None:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
            bar.update(1)
            if step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0):
                train_state = {"step": step, "tokens": tokens, "data": stream.position()}
                path = ckpt.save_checkpoint(engine, cfg.output_dir, step, tokenizer=tokenizer, manifest=manifest,
                                            train_state=train_state, core_attn=cfg.attn)  # fmt: skip
                if rank == 0:
                    bar.write(f"saved {path}")
    finally:
        bar.close()
        if metrics is not None:
            metrics.close()
    elapsed = time.perf_counter() - start
    summary = {"steps": step, "final_loss": losses[-1] if losses else None, "seconds": elapsed,
               "output_dir": cfg.output_dir, "checkpoint": os.path.join(cfg.output_dir, f"{ckpt.PREFIX}{step}")}  # fmt: skip
    if rank == 0:
        logger.info("done: %d steps in %.1f s, final loss %s", step, elapsed, summary["final_loss"])
    return summary
