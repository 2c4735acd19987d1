"""The training loop behind ``ulysses-sp train``, as a library function over a typed config.

``run.resolve.resolve_run(cfg, world_size)`` checks everything that can be checked without
processes (``ValueError`` naming the numbers) and resolves the run: model config, tokenizer, ring
size, manifest, dataset. The CLI resolves once in the launching process and hands the result to
``run(cfg, resolved=...)``; without one, every rank resolves it itself. ``run`` (every rank, process
group initialised) then builds and trains:

1. model (a preset from ``cfg.seed`` or a local HF directory; at ZeRO 2/3 a
   directory is built on the meta device and filled shard by shard after sharding, ``state/loading.py``;
   on resume the checkpoint's training state fills model and optimizer), ALST transforms (tiled MLP, activation checkpointing / offload);
2. sequence parallelism (``sp > 1``): ``UlyssesSPAttentionHF.register_with_transformers`` ->
   ``mpu``; the engine: ``initialize(model, cfg.training_config(), mpu=...)`` (ZeRO stage and partition,
   ``auto`` resolved for the world size: ``RunConfig.partition_for``; AdamW,
   warmup + cosine: the recipe is ``RunConfig``'s fields);
3. data: ``sp_dataloader`` per rank -> ``UlyssesSPDataLoaderAdapter``, so a run with ``sp = P``
   processes the same global batches as ``sp = 1`` with the same ``dp``;
4. per optimizer step: ``grad_accum`` micro-steps of ``engine.backward(engine(**batch).loss)`` (the
   output and its logits freed before the backward: ``micro_step``) / ``step``,
   a metrics line (``tokens``/``tokens_per_s``: real tokens, padding not counted, ``run.stream``;
   ``run.report``: ``metrics.jsonl``, and TensorBoard / W&B with ``--report-to``;
   ``loss.png`` when the run ends), and every ``save_every`` steps an atomic checkpoint (``state/checkpoint.py``, through
   ``rundir.checked_save``: finite weights, free space).

Reliability: rank 0 holds the output directory's ``RunLock`` for the whole run; a non-finite step
is skipped by the engine's divergence guard (its metrics line says ``"skipped": true``) and a
diverged run raises ``DivergenceError`` naming the last good checkpoint; ``stop`` (an event the
CLI sets on SIGTERM with ``--save-on-signal``) is agreed across ranks inside the per-step metrics
reduction, then the run saves and returns with ``"stopped": True``.

The library never reads argv or launcher variables; the CLI does and passes a ``RunConfig``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from contextlib import ExitStack
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from ulysses_sp import tasks
from ulysses_sp.engine.divergence import DivergenceError
from ulysses_sp.parallel import comm_timing
from ulysses_sp.parallel.comm import all_reduce_max, raise_if_any_rank_failed
from ulysses_sp.run.config import RunConfig, startup_summary, unpartitioned_warning
from ulysses_sp.run.lock import RunLock, RunLockedError
from ulysses_sp.run.model_checks import apply_techniques, built_attn, sp_attention_wanted
from ulysses_sp.run.report import MetricsReport
from ulysses_sp.run.resolve import ResolvedRun, resolve_run
from ulysses_sp.run.rundir import checked_save, prepare_output_dir
from ulysses_sp.run.stream import DataStream
from ulysses_sp.run.vlm import is_vlm_config, vlm_shard
from ulysses_sp.state import checkpoint as ckpt
from ulysses_sp.state.precision import DTYPES

logger = logging.getLogger(__name__)




# ---------------------------------------------------------------- the loop
def run(cfg: RunConfig, *, stop: Any = None, resolved: ResolvedRun | None = None) -> dict[str, Any]:
    """Train on every rank of the initialised process group; return a summary (same on every rank).

    ``resolved``: ``cfg`` as ``resolve_run`` checked and resolved it in the launching process (the
    ranks then check and load nothing again); ``None``: every rank resolves it here.
    A collective from start to end. Raises ``ValueError`` (on every rank) for bad input,
    ``RunLockedError`` when another run holds ``cfg.output_dir``, ``DivergenceError`` when the
    training diverged. ``stop``: an object with ``is_set()`` (a ``threading.Event``); once it is
    set on any rank, the run saves a checkpoint after the current step and returns early.
    """
    world = dist.get_world_size()
    if resolved is None:
        resolved = resolve_run(cfg, world, progress=cfg.progress and dist.get_rank() == 0)
    elif resolved.cfg != cfg or resolved.world_size != world:
        raise ValueError(
            f"run(): the resolved run is for {resolved.world_size} processes and its own config, this is "
            f"{world} processes{'' if resolved.cfg == cfg else ' and another config'}; resolve_run(cfg, {world})"
        )
    with ExitStack() as held:
        return _run(resolved, stop, held)


def _run(resolved: ResolvedRun, stop: Any, held: ExitStack) -> dict[str, Any]:
    from ulysses_sp.engine import initialize
    from ulysses_sp.memory.meter import track_peak_memory
    from ulysses_sp.parallel.mesh import init_mesh
    from ulysses_sp.state.loading import init_empty_model, load_pretrained_weights

    cfg, manifest, tokenizer, dataset = resolved.cfg, resolved.manifest, resolved.tokenizer, resolved.dataset
    world, rank = dist.get_world_size(), dist.get_rank()
    # eager without attention layers (Mamba-2); the ZeRO partition for this world size (auto resolved)
    cfg = replace(cfg, attn=built_attn(cfg, resolved.model_config), zero_partition=cfg.partition_for(world))
    mesh = init_mesh(
        sp_size=cfg.sp, ring_size=resolved.ring_size
    )  # the run's layout: attention, engine and loop share it
    resume_dir = ckpt.resolve_resume(cfg.resume, cfg.output_dir) if cfg.resume else None
    saved = ckpt.read_manifest(resume_dir) if resume_dir else {}
    resumed_step = saved.get("step")
    if rank == 0 and resume_dir and (saved.get("steps"), saved.get("lr")) != (cfg.steps, cfg.lr):
        logger.warning(
            "resuming with --steps %s --lr %s, the checkpoint's run had --steps %s --lr %s: the learning-rate "
            "schedule continues as saved in the checkpoint", cfg.steps, cfg.lr, saved.get("steps"), saved.get("lr"),
        )  # fmt: skip
    error = None
    if rank == 0:  # held from before prepare_output_dir (which --overwrite lets delete) to the end
        try:
            held.enter_context(RunLock(cfg.output_dir))
        except RunLockedError as e:
            error = str(e)
    raise_if_any_rank_failed(error, mesh.reduce_group, RunLockedError)
    report = None
    if rank == 0:
        prepare_output_dir(cfg, resumed_step)
        try:  # metrics file, TensorBoard, W&B: closed (and loss.png drawn) when the run ends, however it ends
            report = MetricsReport(cfg, resumed_step=resumed_step)
            held.callback(report.close)
        except Exception as e:  # noqa: BLE001 - every rank must hear of it, or the others wait in a collective
            error = f"metrics ({cfg.metrics_path}, --report-to {cfg.report_to}): {type(e).__name__}: {e}"
    raise_if_any_rank_failed(error, mesh.reduce_group)

    predicted = _preflight(cfg, world, resolved, mesh)  # before the model exists
    sharded_load = cfg.zero_stage >= 2 and not tasks.is_preset(cfg.model)
    if sharded_load:  # parameters on meta; each rank fills only its shards after sharding
        model = init_empty_model(cfg.model, attn_implementation=cfg.attn)
    else:
        model = tasks.build_model(cfg.model, vocab_size=len(tokenizer), seed=cfg.seed, attn_implementation=cfg.attn,
                                  config=resolved.model_config)  # fmt: skip
    handles, loss_fn = apply_techniques(cfg, model)
    mpu = register_attention(cfg, model, resolved.model_config, mesh)
    handles += vlm_shard(cfg, model, mesh)  # --split-images off: installed here, initialize() keeps it
    engine, _, _, _ = initialize(model, cfg.training_config(), mpu=mpu or mesh.mpu, loss_fn=loss_fn)
    state = {"step": 0, "tokens": 0, "data": {"epoch": 0, "offset": 0}}
    if resume_dir:  # model (fp32 master weights) + optimizer resharded to this layout
        state = ckpt.load_training_state(engine, resume_dir)
        engine.guard.steps = state["step"]  # the guard's messages count the run's steps
    elif sharded_load:
        load_pretrained_weights(engine.module, cfg.model)
    stream = DataStream(
        dataset, engine, micro_batch_size=cfg.micro_batch_size, seed=cfg.seed,
        shuffle=cfg.data != tasks.RECALL, pad_id=tokenizer.pad_token_id or 0, **state["data"],
        vlm=engine.module if is_vlm_config(resolved.model_config) else None, require_split=cfg.split_images == "on",
    )  # fmt: skip
    if rank == 0:
        blocks = getattr(mpu, "head_blocks", None)  # --head-chunks: which attention modules run per group, how
        logger.info(startup_summary(cfg, engine, model, dataset, resume_dir) + "\n" + predicted
                    + ("\n" + blocks.describe(cfg.head_chunks) if blocks is not None else "")
                    + ("; the next group's exchange behind each group's core" if cfg.head_chunk_overlap else ""))  # fmt: skip
        if unpartitioned_warning(cfg, world):
            logger.warning(unpartitioned_warning(cfg, world))
    try:
        return _loop(cfg, engine, stream, state, tokenizer, manifest, track_peak_memory, stop, report)
    finally:
        for h in handles:
            h.remove()
        if mpu is not None:
            mpu.remove()


def register_attention(cfg: RunConfig, model, model_config: Any, mesh) -> Any:
    """The run's attention: ``UlyssesSPAttentionHF`` registered on ``mesh`` with ``cfg``'s options where
    ``sp_attention_wanted``, returning its ``mpu``; else ``None`` (the model's own attention). ``eval``
    registers through it too, so it runs ``train``'s forward."""
    from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF

    if not sp_attention_wanted(cfg, model_config):
        return None
    reg = UlyssesSPAttentionHF.register_with_transformers(
        model, cfg.attn, cfg.sp, cfg.micro_batch_size, seq_length=cfg.seq_len, mesh=mesh,
        attn_chunk=cfg.attn_chunk, offload_attention=cfg.offload_attention, head_chunks=cfg.head_chunks,
        exchange=cfg.exchange,
    )  # fmt: skip
    reg.attention.head_chunk_overlap = cfg.head_chunk_overlap  # read at every call (attention/block_overlap.py)
    return reg


def _preflight(cfg: RunConfig, world: int, resolved: ResolvedRun, mesh) -> str:
    """The planner's predicted peak (summary line); every rank refuses alike when it cannot fit."""
    from ulysses_sp.parallel.comm import raise_if_any_rank_failed
    from ulysses_sp.run.preflight import check_fits, prediction, vision_patches

    patches = vision_patches(cfg, resolved.model_config, resolved.dataset)
    pred = prediction(cfg, world, resolved.model_config, mesh.device, vision_patches=patches)
    line, error = "", None
    try:
        line = check_fits(cfg, pred, mesh.device, world)
    except ValueError as e:
        error = str(e)
    raise_if_any_rank_failed(error, mesh.reduce_group)  # budgets may differ between hosts
    return line


def micro_step(engine, batch: dict[str, Any]) -> None:
    """One micro-step's forward and backward; the model output is dropped before the backward.

    Only ``.loss`` outlives the forward: the output's untiled logits ``[B, S_l, V]`` (autograd saves
    the fp32 log-softmax, not them) are freed before the backward starts instead of staying alive
    through it (and through the next micro-step's forward). ``bench/plan_check.py`` measures this.
    """
    engine.backward(engine(**batch).loss)


def _comm_fields(times, dt: float) -> dict[str, Any]:
    if times is None:
        return {}
    comm_s, dp_s = times.sp, times.dp
    return {"comm_s": comm_s, "dp_comm_s": dp_s, "compute_s": max(dt - comm_s - dp_s, 0.0),
            "comm_share": (comm_s + dp_s) / dt if dt > 0 else 0.0}  # fmt: skip


_UNMEASURED = SimpleNamespace(peak_bytes=0)
"""Stands in for ``track_peak_memory``'s result on a step whose peak is not measured."""


def _measures_memory(cfg: RunConfig, device: torch.device, step: int) -> bool:
    """Whether step ``step`` (1-based) measures its peak memory (``RunConfig.memory_every``)."""
    every = cfg.memory_every if cfg.memory_every is not None else (25 if device.type == "cpu" else 1)
    return step <= 3 or step == cfg.steps or step % every == 0


def _last_good(cfg: RunConfig) -> str:
    found = ckpt.list_checkpoints(cfg.output_dir)
    return found[-1][1] if found else "none (no checkpoint was saved yet)"


def _loop(cfg, engine, stream, state, tokenizer, manifest, track_peak_memory, stop, report) -> dict[str, Any]:
    from tqdm import tqdm

    rank = dist.get_rank()
    step, tokens = state["step"], state["tokens"]
    dp_rank, dp_size = engine.mesh.dp_rank, engine.mesh.dp_size
    batches = iter(stream)
    engine.train()
    bar = tqdm(
        total=cfg.steps, initial=step, disable=rank != 0 or not cfg.progress, unit="step", dynamic_ncols=True
    )
    losses: list[float] = []
    stopped = False
    start = time.perf_counter()
    try:
        while step < cfg.steps:
            t0 = time.perf_counter()
            lr = engine.get_lr()[0]
            profile = comm_timing.record_comm_times(engine.device) if cfg.profile_comm else contextlib.nullcontext()  # fmt: skip
            measured = _measures_memory(cfg, engine.device, step + 1)
            tracker = track_peak_memory(engine.device) if measured else contextlib.nullcontext(_UNMEASURED)
            with tracker as mem, profile as times:
                for _ in range(cfg.grad_accum):
                    micro_step(engine, next(batches))
                    try:
                        loss = engine.step()
                    except DivergenceError as e:
                        raise DivergenceError(f"{e} Last good checkpoint: {_last_good(cfg)}.",
                                              step=e.step, bad_steps=e.bad_steps) from None  # fmt: skip
                comm_dt = time.perf_counter() - t0  # the step's metric reductions are not in it
            # one reduction: the busiest rank's peak memory, whether any rank was asked to stop, and each
            # DP replica's real tokens in its own slot (the max of one value and zeros is that value;
            # the SP ranks of a replica hold the same count), so the sum of the slots needs no second
            # collective: dp int64 more in the tensor the step reduces anyway
            real = [0] * dp_size
            real[dp_rank] = stream.take_real_tokens()  # host ints from the data path, no device read
            flags = [mem.peak_bytes, int(stop is not None and stop.is_set()), *real]
            flags = all_reduce_max(torch.tensor(flags, dtype=torch.int64, device=engine.device),
                                   engine.mesh.reduce_group).tolist()  # fmt: skip
            step_tokens = int(sum(flags[2:]))
            step, tokens = step + 1, tokens + step_tokens
            dt = time.perf_counter() - t0
            record = {
                "step": step, "loss": loss, "grad_norm": engine.get_global_grad_norm(), "lr": lr,
                "tokens": tokens, "tokens_per_s": step_tokens / dt,
                **({"peak_mem_bytes": int(flags[0])} if measured else {}), **_comm_fields(times, comm_dt),
            }  # fmt: skip
            if engine.loss_scaler is not None:  # fp16: the scale and the overflowing steps skipped so far
                record.update(loss_scale=engine.loss_scaler.scale, skipped_steps=engine.skipped_steps)
            if engine.last_step_skipped:  # only then: the usual line keeps its schema
                record.update(skipped=True, skipped_steps=engine.skipped_steps)
                if rank == 0:
                    logger.warning("step %d skipped: loss %s, gradient norm %s (not finite)", step, loss,
                                   record["grad_norm"])  # fmt: skip
            losses.append(loss)
            if report is not None:
                report.log(record)
            shown = {"comm": f"{record['comm_share']:.0%}"} if "comm_share" in record else {}
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", **shown)
            bar.update(1)
            stopping = bool(flags[1])
            if stopping or step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0):
                train_state = {"step": step, "tokens": tokens, "data": stream.position()}
                path = checked_save(engine, cfg.output_dir, step, last_good=_last_good(cfg), tokenizer=tokenizer,
                                    manifest=manifest, train_state=train_state, core_attn=cfg.attn,
                                    save_dtype=DTYPES[cfg.save_dtype] if cfg.save_dtype else None)  # fmt: skip
                if rank == 0:
                    bar.write(f"saved {path}")
            if stopping:
                stopped = True
                break
    finally:
        bar.close()
    elapsed = time.perf_counter() - start
    summary = {"steps": step, "final_loss": losses[-1] if losses else None, "seconds": elapsed,
               "output_dir": cfg.output_dir, "checkpoint": os.path.join(cfg.output_dir, f"{ckpt.PREFIX}{step}"),
               "stopped": stopped, "skipped_steps": engine.skipped_steps}  # fmt: skip
    if rank == 0:
        logger.info("done: %d steps in %.1f s, final loss %s", step, elapsed, summary["final_loss"])
    return summary
