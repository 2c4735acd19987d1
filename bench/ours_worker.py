"""ulysses-sp's training loop on the benchmark model: the counterpart of bench/ds_worker.py.

    python -m torch.distributed.run --nproc-per-node 2 -m bench.ours_worker \\
        --dp 1 --sp 2 --zero 1 --steps 4 --seq-len 64 --out /tmp/ours.json

Same model (bench/spec.py, same seed), same per-rank DataLoader, same ``(dp, sp)``, ZeRO stage,
optimizer (AdamW, no weight decay), same timing protocol and the same meters as ds_worker; the
loop is ulysses-sp's documented one: ``register_with_transformers`` (sdpa core) ->
``ulysses_sp.engine.initialize(model, config, mpu=..., optimizer=AdamW)`` ->
``UlyssesSPDataLoaderAdapter`` -> ``loss = engine(**batch).loss; engine.backward(loss); engine.step()``.
Rank 0 writes the same JSON keys as ds_worker.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import resource
import time

import torch
import torch.distributed as dist

from bench import spec as S
from bench.counters import CollectiveCounter, PhaseTimer
from bench.memmeter import PeakMeter


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=S.ModelSpec().to_json(), help="ModelSpec JSON")
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--sp", type=int, default=2)
    ap.add_argument("--zero", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clip", type=float, default=0.0, help="gradient_clipping (0: off)")
    ap.add_argument("--optim", choices=("adamw", "sgd"), default="adamw")
    ap.add_argument(
        "--partition",
        choices=("all", "data_parallel"),
        default="all",
        help="ZeRO partition span; DeepSpeed partitions over all dp*sp ranks (its seq-data-parallel group)",
    )
    ap.add_argument("--out", required=True)
    return ap.parse_args(argv)


def full_grad_norm(module: torch.nn.Module) -> float:
    """Norm of the reduced gradient (FSDP2 DTensor shards gathered first)."""
    from torch.distributed.tensor import DTensor

    sq = 0.0
    for p in module.parameters():
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            g = g.full_tensor()
        sq += float(g.float().pow(2).sum())
    return sq**0.5


def param_spread(module: torch.nn.Module, group) -> float:
    from torch.distributed.tensor import DTensor

    parts = []
    for p in module.parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        parts.append(t.detach().float().reshape(-1))
    flat = torch.cat(parts)
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    return float((hi - lo).max())


def main(argv=None) -> None:
    args = parse_args(argv)
    from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
    from ulysses_sp.data import UlyssesSPDataLoaderAdapter
    from ulysses_sp.engine import initialize

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != args.dp * args.sp:
        raise ValueError(f"world {world} != dp {args.dp} * sp {args.sp}")
    torch.set_num_threads(1)
    spec = S.ModelSpec.from_json(args.model)
    model = S.build_model(spec, seed=args.seed, attn_implementation="sdpa")
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", args.sp, args.micro_batch)
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": args.clip,
        "zero_optimization": {"stage": args.zero, "partition": args.partition},
        "sequence_parallel_size": args.sp,
    }
    make_opt = functools.partial(S.make_optimizer, args.optim, lr=args.lr)
    engine, _, _, _ = initialize(model, config, mpu=mpu, optimizer=make_opt)
    sp_group = mpu.get_sequence_parallel_group()
    items = -(-args.steps // args.sp)
    dl = torch.utils.data.DataLoader(
        S.RankStream(rank, world, args.micro_batch, items, args.seq_len, spec.vocab_size),
        batch_size=args.micro_batch,
    )
    dl = UlyssesSPDataLoaderAdapter(
        dl, mpu.get_sequence_parallel_rank(), sp_group, args.sp, torch.device("cpu")
    )

    losses, times, grad_norm, local_norms = [], [], None, None
    counter = CollectiveCounter()
    timer = PhaseTimer()
    meter = PeakMeter()
    it = iter(dl)
    for step in range(args.steps):
        batch = next(it)
        measure = step == args.steps - 1 and args.steps > 1
        region = meter.step() if measure else contextlib.nullcontext()
        counting = counter if step == 0 else contextlib.nullcontext()
        timer.active = not measure  # the metered step is slower: time the others
        t0 = time.perf_counter()
        with region, counting:
            with counter.label("forward"), timer("forward"):
                inputs = {k: batch[k] for k in ("input_ids", "position_ids", "shift_labels")}
                loss = engine(**inputs).loss
            with counter.label("backward"), timer("backward"):
                engine.backward(loss)
            if step == 0:
                grad_norm = full_grad_norm(engine.module)
                local_norms = [None] * world
                dist.all_gather_object(local_norms, grad_norm)
            with counter.label("step"), timer("step"):
                engine.step()
        if not measure:
            times.append(time.perf_counter() - t0)
        lv = loss.detach().clone()
        dist.all_reduce(lv)
        losses.append(float(lv) / world)
    spread = param_spread(engine.module, sp_group)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    tokens_per_rank = args.micro_batch * batch["input_ids"].shape[1]
    if rank == 0:
        steady = times[1:] or times
        out = {
            "impl": "ulysses-sp",
            "torch_version": torch.__version__,
            "args": vars(args),
            "losses": losses,
            "step_times": times,
            "tokens_per_rank_per_step": tokens_per_rank,
            # min over the steady steps: the estimator least disturbed by other load on the machine
            "tokens_per_s_per_rank": tokens_per_rank / min(steady),
            "phase_s": timer.best(),
            # FSDP2 (ZeRO 2/3) gathers unsharded parameters into storages it resizes, invisible to the
            # dispatch meter: add them (stage 2 keeps all of them from forward to backward).
            "peak_bytes": meter.peak + (param_bytes if args.zero >= 2 else 0),
            "peak_bytes_measured": meter.peak,
            "unsharded_param_bytes": param_bytes if args.zero >= 2 else 0,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "grad_norm_step1": grad_norm,
            "grad_norm_step1_per_rank": local_norms,
            "param_spread_in_sp_group": spread,
            "param_numel": sum(p.numel() for p in model.parameters()),
            "comm_bytes": {f"{p}/{o}": v for (p, o), v in counter.sent.items()},
        }
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    dist.barrier()
    from ulysses_sp.parallel.mesh import shutdown

    shutdown()  # joins the gloo workers now, not during interpreter exit


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
