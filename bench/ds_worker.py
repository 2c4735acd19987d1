"""DeepSpeed's own Ulysses/ALST on the benchmark model: one worker process (runs in bench/.venv-deepspeed).

Launched by bench/vs_deepspeed.py, never imported by ulysses-sp:

    bench/.venv-deepspeed/bin/python -m torch.distributed.run --nproc-per-node 2 -m bench.ds_worker \\
        --dp 1 --sp 2 --zero 1 --steps 4 --seq-len 64 --out /tmp/ds.json

The loop is the one DeepSpeed documents for ALST: ``UlyssesSPAttentionHF.register_with_transformers`` on
the model (sdpa core attention), ``deepspeed.initialize(model, optimizer, config with
sequence_parallel_size, mpu=...)``, ``UlyssesSPDataLoaderAdapter`` around an ordinary DataLoader, the
per-shard loss combined over the SP group with a differentiable all-gather weighted by valid-token counts,
``engine.backward`` and ``engine.step``. Rank 0 writes a JSON summary (losses, step times, tokens/s,
peak memory, gradient norm at step 1, bytes through the collectives).
"""

from __future__ import annotations

import argparse
import contextlib
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
    ap.add_argument(
        "--seq-lens", default="", help="comma list: per-global-rank lengths (unequal lengths test)"
    )
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clip", type=float, default=0.0, help="gradient_clipping (0: off)")
    ap.add_argument("--optim", choices=("adamw", "sgd"), default="adamw")
    ap.add_argument(
        "--loss-combine",
        choices=("auto", "all_gather", "all_reduce"),
        default="auto",
        help="differentiable combine of per-rank loss sums over SP: DeepSpeed's documented all_gather, or "
        "all_reduce (same gradient); auto = all_gather unless dp > 1 (torch's gloo all_gather backward "
        "fails for SP groups that do not contain global rank 0)",
    )
    ap.add_argument(
        "--mesh-param", action="store_true", help="deepspeed.initialize(mesh_param=(dp, sp)), no mpu"
    )
    ap.add_argument(
        "--bucket-elems",
        type=int,
        default=-1,
        help="ZeRO reduce/allgather bucket: -1 model numel, 0 DS default",
    )
    ap.add_argument("--out", required=True)
    return ap.parse_args(argv)


def global_grad_norm(engine) -> float:
    from deepspeed.utils import safe_get_full_grad

    sq = 0.0
    for p in engine.module.parameters():
        g = safe_get_full_grad(p)
        if g is not None:
            sq += float(g.float().pow(2).sum())
    return sq**0.5


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        run(args)
    except Exception as e:  # recorded for deepspeed_findings.md, then re-raised
        rank = int(os.environ.get("RANK", "0"))
        with open(f"{args.out}.rank{rank}.err", "w") as f:
            f.write(f"{type(e).__name__}: {e}"[:4000])
        raise


def param_spread(engine, group) -> float:
    """Largest |difference| of any parameter between the ranks of ``group`` (0 when replicas agree)."""
    from deepspeed.utils import safe_get_full_fp32_param

    parts = []
    for p in engine.module.parameters():
        full = safe_get_full_fp32_param(p)  # None at ZeRO 0, where the parameter itself is the master copy
        parts.append((p if full is None else full).detach().float().reshape(-1))
    flat = torch.cat(parts)
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    return float((hi - lo).max())


def run(args: argparse.Namespace) -> None:
    import datetime

    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import (
        UlyssesSPAttentionHF,
        UlyssesSPDataLoaderAdapter,
    )

    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == args.dp * args.sp, f"world {world} != dp {args.dp} * sp {args.sp}"
    torch.set_num_threads(1)
    spec = S.ModelSpec.from_json(args.model)
    model = S.build_model(spec, seed=args.seed, attn_implementation="sdpa")

    mpu = None
    if args.sp > 1 and not args.mesh_param:
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model,
            core_attn_implementation="sdpa",
            sequence_parallel_size=args.sp,
            micro_batch_size=args.micro_batch,
            seq_length_is_variable=True,
        )
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": args.clip,
        "zero_optimization": {"stage": args.zero},
        "sequence_parallel_size": args.sp,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    numel = sum(p.numel() for p in model.parameters())
    if args.bucket_elems:
        bucket = numel if args.bucket_elems < 0 else args.bucket_elems
        config["zero_optimization"].update(reduce_bucket_size=bucket, allgather_bucket_size=bucket)
    opt = S.make_optimizer(args.optim, model.parameters(), args.lr)
    init_kwargs = {"mesh_param": (args.dp, args.sp)} if args.mesh_param else {"mpu": mpu}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config, **init_kwargs)

    if args.mesh_param and args.sp > 1:
        # the mesh path makes its own groups; Ulysses attention still needs registering, on those groups
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model,
            core_attn_implementation="sdpa",
            sequence_parallel_size=args.sp,
            micro_batch_size=args.micro_batch,
            seq_length_is_variable=True,
        )
    seq_len = int(args.seq_lens.split(",")[rank]) if args.seq_lens else args.seq_len
    items = -(-args.steps // args.sp)
    dl = torch.utils.data.DataLoader(
        S.RankStream(rank, world, args.micro_batch, items, seq_len, spec.vocab_size),
        batch_size=args.micro_batch,
    )
    if args.sp > 1:
        sp_group = mpu.get_sequence_parallel_group()
        dl = UlyssesSPDataLoaderAdapter(
            dl,
            sp_rank=mpu.get_sequence_parallel_rank(),
            sp_group=sp_group,
            sp_world_size=args.sp,
            device=torch.device("cpu"),
        )
    else:
        sp_group = None

    combine = args.loss_combine
    if combine == "auto":
        combine = "all_gather" if args.dp == 1 else "all_reduce"
    losses, times, grad_norm = [], [], None
    counter = CollectiveCounter()
    timer = PhaseTimer()
    meter = PeakMeter()
    it = iter(dl)
    for step in range(args.steps):
        batch = next(it)
        # the last step is measured for memory (the meter slows every op), the others are timed
        measure = step == args.steps - 1 and args.steps > 1
        region = meter.step() if measure else contextlib.nullcontext()
        timer.active = not measure  # the metered step is slower: time the others
        t0 = time.perf_counter()
        counting = counter if step == 0 else contextlib.nullcontext()  # bytes of one step
        with region, counting:
            with counter.label("forward"), timer("forward"):
                if "shift_labels" in batch:
                    shift = batch.pop("shift_labels")
                else:
                    shift = torch.nn.functional.pad(batch.pop("labels"), (0, 1), value=S.IGNORE_INDEX)[:, 1:]
                logits = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
                loss_sum = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]).float(),
                    shift.reshape(-1),
                    ignore_index=S.IGNORE_INDEX,
                    reduction="sum",
                )
                good = (shift != S.IGNORE_INDEX).sum()
                if sp_group is not None:
                    # DeepSpeed's documented recipe: all-gather (differentiable) the per-rank loss and count
                    if combine == "all_gather":
                        sums = torch.distributed.nn.functional.all_gather(loss_sum, group=sp_group)
                        goods = torch.distributed.nn.functional.all_gather(good, group=sp_group)
                        loss = sum(sums) / max(int(sum(goods)), 1)
                    else:  # the same value and the same (P x local share) gradient as the all_gather recipe
                        total = torch.distributed.nn.functional.all_reduce(loss_sum, group=sp_group)
                        goods = good.clone()
                        dist.all_reduce(goods, group=sp_group)
                        loss = total / max(int(goods), 1)
                else:
                    loss = loss_sum / max(int(good), 1)
            with counter.label("backward"), timer("backward"):
                engine.backward(loss)
            if step == 0:
                grad_norm = global_grad_norm(engine)
                local_norms = [None] * world
                dist.all_gather_object(local_norms, grad_norm)
            with counter.label("step"), timer("step"):
                engine.step()
        if not measure:
            times.append(time.perf_counter() - t0)
        # the DP mean of the SP-group losses (what the oracle reports)
        lv = loss.detach().clone()
        dist.all_reduce(lv)
        losses.append(float(lv) / world)
    spread = param_spread(engine, sp_group) if sp_group is not None else 0.0
    tokens_per_rank = args.micro_batch * (batch["input_ids"].shape[1])
    if rank == 0:
        steady = times[1:] or times
        out = {
            "impl": "deepspeed",
            "deepspeed_version": deepspeed.__version__,
            "torch_version": torch.__version__,
            "args": vars(args),
            "losses": losses,
            "step_times": times,
            "tokens_per_rank_per_step": tokens_per_rank,
            # min over the steady steps: the estimator least disturbed by other load on the machine
            "tokens_per_s_per_rank": tokens_per_rank / min(steady),
            "phase_s": timer.best(),
            "loss_combine": combine,
            "peak_bytes": meter.peak,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "grad_norm_step1": grad_norm,
            "grad_norm_step1_per_rank": local_norms,
            "param_spread_in_sp_group": spread,
            "param_numel": numel,
            "comm_bytes": {f"{p}/{o}": v for (p, o), v in counter.sent.items()},
        }
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
