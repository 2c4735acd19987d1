"""The DeepSpeed comparison (section 5): one timed step loop, and both sides' training set-up around it.

    python -m torch.distributed.run --nproc-per-node 2 -m bench.steploop --impl ours --out /tmp/ours.json
    (bench/.venv-deepspeed/bin/python for ``--impl deepspeed``; --dp --sp --zero --steps --seq-len --data ...)

Both sides build the same model and per-rank data (bench/spec.py) and hand ``run`` their ``forward(batch) ->
loss``, ``backward(loss)`` and ``step()``, each as its library documents it:

* ``ours``: ``register_with_transformers`` (sdpa core) -> ``ulysses_sp.engine.initialize(model, config,
  mpu=..., optimizer=AdamW)`` -> ``UlyssesSPDataLoaderAdapter`` -> ``engine(**batch).loss``,
  ``engine.backward``, ``engine.step``; ZeRO partitions over all dp*sp ranks, as DeepSpeed's does.
* ``deepspeed`` (in bench/.venv-deepspeed; ``deepspeed`` imported only there): its
  ``UlyssesSPAttentionHF.register_with_transformers``, ``deepspeed.initialize(..., mpu=...)``, its
  ``UlyssesSPDataLoaderAdapter``, the per-shard loss combined over the SP group with a differentiable
  all-gather weighted by valid-token counts (an all-reduce at dp > 1: torch's gloo all-gather backward fails
  for SP groups without global rank 0); ZeRO buckets of the model's size (the default allocates 2 GB).

The loop is the protocol both sides are measured by: step 0 counts the bytes through the collectives
(``CollectiveCounter``) and records the gradient norm before the optimizer step; the last step (when there are
several) is metered for peak tensor memory (``ulysses_sp.memory.track_peak_memory`` over every live tensor:
parameters, gradients, optimizer state), the others are timed per phase. Rank 0 writes the same JSON keys for
both. The DeepSpeed venv finds the meter in this checkout's src/.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib.util
import resource
import sys
import time

import torch
import torch.distributed as dist

from bench import spec as S
from bench.counters import CollectiveCounter, PhaseTimer
from bench.launch import ROOT, finish_worker, init_worker

if importlib.util.find_spec("ulysses_sp") is None:  # the DeepSpeed venv: the meter from this checkout
    sys.path.append(str(ROOT / "src"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", choices=("ours", "deepspeed"), required=True)
    for flag, default in (("--dp", 1), ("--sp", 2), ("--zero", 1), ("--steps", 4), ("--seq-len", 64), ("--micro-batch", 1)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--data", choices=("causal", "packed"), default="causal", help="packed: spec.packed_positions")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    init_worker(120, deepspeed=args.impl == "deepspeed")
    model = S.build_model(S.ModelSpec())  # seed 0, as the oracle's (spec.reference_run)
    numel = sum(p.numel() for p in model.parameters())
    out = (ours if args.impl == "ours" else deepspeed)(args, model)
    finish_worker({**out, "param_numel": numel}, args.out)


def loader(args: argparse.Namespace) -> torch.utils.data.DataLoader:
    """This rank's ordinary DataLoader (before either side's SP adapter): enough items for ``--steps``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != args.dp * args.sp:
        raise ValueError(f"world size ({world}) != dp ({args.dp}) * sp ({args.sp})")
    items = S.rank_samples(rank, world, args.micro_batch, -(-args.steps // args.sp), args.seq_len, S.ModelSpec().vocab_size)
    items = [S.pack_documents(item) for item in items] if args.data == "packed" else items
    return torch.utils.data.DataLoader(items, batch_size=args.micro_batch)


def norm(grads) -> float:
    return sum(float(g.float().pow(2).sum()) for g in grads if g is not None) ** 0.5


def spread(params, group) -> float:
    """Largest |difference| of any parameter between the ranks of ``group`` (0 when replicas agree)."""
    flat = torch.cat([p.detach().float().reshape(-1) for p in params])
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    return float((hi - lo).max())


def _live_tensors() -> list[torch.Tensor]:
    gc.collect()
    live = [t for t in gc.get_objects() if isinstance(t, torch.Tensor)]
    return live + [t.grad for t in live if t.is_leaf and t.grad is not None]


def run(args, batches, *, forward, backward, step, grad_norm) -> dict:
    """``args.steps`` steps of ``forward``/``backward``/``step``; the measurements every worker reports."""
    from ulysses_sp.memory.meter import track_peak_memory

    world = dist.get_world_size()
    losses, times, cpu, counter, timer, it, peak = [], [], [], CollectiveCounter(), PhaseTimer(), iter(batches), 0
    for i in range(args.steps):
        batch = next(it)
        measure = i == args.steps - 1 and args.steps > 1  # the meter slows every op: time the others
        region = track_peak_memory("cpu", include=_live_tensors()) if measure else contextlib.nullcontext()
        timer.active = not measure
        t0, c0 = time.perf_counter(), time.process_time()  # process CPU time: robust to other load
        with region as mem, counter if i == 0 else contextlib.nullcontext():  # bytes of one step
            with counter.label("forward"), timer("forward"):
                loss = forward(batch)
            with counter.label("backward"), timer("backward"):
                backward(loss)
            if i == 0:
                local_norms = [None] * world
                dist.all_gather_object(local_norms, grad_norm())
            with counter.label("step"), timer("step"):
                step()
        if measure:
            peak = mem.peak_bytes
        else:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        lv = loss.detach().clone()
        dist.all_reduce(lv)  # the DP mean of the SP-group losses (what the oracle reports)
        losses.append(float(lv) / world)
    tokens = args.micro_batch * batch["input_ids"].shape[1]
    steady = times[1:] or times
    return {"torch_version": torch.__version__, "args": vars(args), "losses": losses, "step_times": times,
            # min over the steady steps: the estimator least disturbed by other load on the machine
            "tokens_per_rank_per_step": tokens, "tokens_per_s_per_rank": tokens / min(steady), "phase_s": timer.best(),
            "cpu_s_per_step": min(cpu[1:] or cpu),
            "peak_bytes": peak, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "grad_norm_step1": local_norms[dist.get_rank()], "grad_norm_step1_per_rank": local_norms,
            "comm_bytes": {f"{p}/{o}": v for (p, o), v in counter.sent.items()}}  # fmt: skip


def ours(args, model) -> dict:
    from torch.distributed.tensor import DTensor

    from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
    from ulysses_sp.data import UlyssesSPDataLoaderAdapter
    from ulysses_sp.engine import initialize

    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", args.sp, args.micro_batch)
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.0, "zero_optimization": {"stage": args.zero, "partition": "all"},
              "sequence_parallel_size": args.sp}  # fmt: skip
    engine, _, _, _ = initialize(model, config, mpu=mpu, optimizer=functools.partial(S.make_optimizer, lr=args.lr))
    group = mpu.get_sequence_parallel_group()
    batches = UlyssesSPDataLoaderAdapter(loader(args), mpu.get_sequence_parallel_rank(), group, args.sp,
                                         torch.device("cpu"))  # fmt: skip
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731  (FSDP2 shards gathered)
    out = run(args, batches, backward=engine.backward, step=engine.step,
              forward=lambda b: engine(**{k: b[k] for k in ("input_ids", "position_ids", "shift_labels")}).loss,
              grad_norm=lambda: norm(full(p.grad) for p in engine.module.parameters() if p.grad is not None))  # fmt: skip
    # FSDP2 (ZeRO 2/3) gathers unsharded parameters into storages it resizes, invisible to the dispatch
    # meter: add them (stage 2 keeps all of them from forward to backward).
    unsharded = sum(p.numel() * p.element_size() for p in model.parameters()) if args.zero >= 2 else 0
    out.update(impl="ulysses-sp", attention_path=mpu.attention.last_path, peak_bytes=out["peak_bytes"] + unsharded, peak_bytes_measured=out["peak_bytes"],
               unsharded_param_bytes=unsharded, param_spread_in_sp_group=spread(map(full, engine.module.parameters()), group))
    return out


def deepspeed(args, model) -> dict:
    import deepspeed as ds
    from deepspeed.runtime.sequence_parallel import ulysses_sp as ds_sp
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    mpu = ds_sp.UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=args.sp,
        micro_batch_size=args.micro_batch, seq_length_is_variable=True)  # fmt: skip
    numel = sum(p.numel() for p in model.parameters())
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.0, "sequence_parallel_size": args.sp,
              "zero_optimization": {"stage": args.zero, "reduce_bucket_size": numel, "allgather_bucket_size": numel},
              "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
              "steps_per_print": 10**9, "wall_clock_breakdown": False}  # fmt: skip
    opt = S.make_optimizer(model.parameters(), args.lr)
    engine, _, _, _ = ds.initialize(model=model, optimizer=opt, config=config, mpu=mpu)
    group = mpu.get_sequence_parallel_group()
    batches = ds_sp.UlyssesSPDataLoaderAdapter(loader(args), sp_rank=mpu.get_sequence_parallel_rank(), sp_group=group,
                                               sp_world_size=args.sp, device=torch.device("cpu"))  # fmt: skip
    combine = "all_gather" if args.dp == 1 else "all_reduce"

    def forward(b):
        logits, shift = engine(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits, b["shift_labels"]
        loss_sum = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), shift.reshape(-1),
                                                     ignore_index=S.IGNORE_INDEX, reduction="sum")  # fmt: skip
        return S.sp_loss_combine(loss_sum, (shift != S.IGNORE_INDEX).sum(), group, combine)

    out = run(args, batches, forward=forward, backward=engine.backward, step=engine.step,
              grad_norm=lambda: norm(safe_get_full_grad(p) for p in engine.module.parameters()))  # fmt: skip
    # safe_get_full_fp32_param is None at ZeRO 0, where the parameter itself is the master copy
    fp32 = [p if (f := safe_get_full_fp32_param(p)) is None else f for p in engine.module.parameters()]
    out.update(impl="deepspeed", deepspeed_version=ds.__version__, loss_combine=combine,
               param_spread_in_sp_group=spread(fp32, group))  # fmt: skip
    return out


if __name__ == "__main__":
    main()
