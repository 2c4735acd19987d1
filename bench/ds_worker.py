"""DeepSpeed's own Ulysses/ALST on the benchmark model: one worker process (runs in bench/.venv-deepspeed).

Launched by ``python -m bench`` (sections deepspeed, findings), never imported by ulysses-sp:

    bench/.venv-deepspeed/bin/python -m torch.distributed.run --nproc-per-node 2 -m bench.ds_worker \\
        --dp 1 --sp 2 --zero 1 --steps 4 --seq-len 64 --out /tmp/ds.json

The loop is the one DeepSpeed documents for ALST: ``UlyssesSPAttentionHF.register_with_transformers`` on
the model (sdpa core attention), ``deepspeed.initialize(model, optimizer, config with
sequence_parallel_size, mpu=...)``, ``UlyssesSPDataLoaderAdapter`` around an ordinary DataLoader, the
per-shard loss combined over the SP group with a differentiable all-gather weighted by valid-token counts,
``engine.backward`` and ``engine.step``; timed and metered by bench/steploop.py exactly as ours.
``deepspeed`` is imported only when the worker runs: the module imports without it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from bench import spec as S
from bench import steploop
from bench.launch import finish_worker, init_worker, recorded_errors


def parse_args(argv=None):
    ap = steploop.parser()
    ap.add_argument("--seq-lens", default="", help="comma list: per-global-rank lengths (unequal lengths test)")
    ap.add_argument("--loss-combine", choices=("auto", "all_gather", "all_reduce"), default="auto",
                    help="differentiable combine of per-rank loss sums over SP: DeepSpeed's documented all_gather, "
                    "or all_reduce (same gradient); auto = all_gather unless dp > 1 (torch's gloo all_gather "
                    "backward fails for SP groups that do not contain global rank 0)")  # fmt: skip
    ap.add_argument("--mesh-param", action="store_true", help="deepspeed.initialize(mesh_param=(dp, sp)), no mpu")
    ap.add_argument("--bucket-elems", type=int, default=-1, help="ZeRO bucket: -1 model numel, 0 DS default")
    return ap.parse_args(argv)


def run(args) -> None:
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import (
        UlyssesSPAttentionHF,
        UlyssesSPDataLoaderAdapter,
    )
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    init_worker(120, deepspeed=True)
    rank = dist.get_rank()
    batches = steploop.loader(args, int(args.seq_lens.split(",")[rank]) if args.seq_lens else None)
    model = S.build_model(S.ModelSpec.from_json(args.model), seed=args.seed)
    register = lambda: UlyssesSPAttentionHF.register_with_transformers(  # noqa: E731
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=args.sp,
        micro_batch_size=args.micro_batch, seq_length_is_variable=True)  # fmt: skip
    mpu = register() if args.sp > 1 and not args.mesh_param else None
    zero = {"stage": args.zero}
    numel = sum(p.numel() for p in model.parameters())
    if args.bucket_elems:
        bucket = numel if args.bucket_elems < 0 else args.bucket_elems
        zero.update(reduce_bucket_size=bucket, allgather_bucket_size=bucket)
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
              "gradient_clipping": args.clip, "zero_optimization": zero, "sequence_parallel_size": args.sp,
              "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
              "steps_per_print": 10**9, "wall_clock_breakdown": False}  # fmt: skip
    opt = S.make_optimizer(args.optim, model.parameters(), args.lr)
    init = {"mesh_param": (args.dp, args.sp)} if args.mesh_param else {"mpu": mpu}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config, **init)
    if args.mesh_param and args.sp > 1:  # the mesh path makes its own groups; attention registers on them
        mpu = register()
    group = None
    if args.sp > 1:
        group = mpu.get_sequence_parallel_group()
        batches = UlyssesSPDataLoaderAdapter(batches, sp_rank=mpu.get_sequence_parallel_rank(), sp_group=group,
                                             sp_world_size=args.sp, device=torch.device("cpu"))  # fmt: skip
    combine = args.loss_combine if args.loss_combine != "auto" else "all_gather" if args.dp == 1 else "all_reduce"

    def forward(b):
        shift = b.pop("shift_labels") if "shift_labels" in b else \
            torch.nn.functional.pad(b.pop("labels"), (0, 1), value=S.IGNORE_INDEX)[:, 1:]  # fmt: skip
        logits = engine(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
        loss_sum = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), shift.reshape(-1),
                                                     ignore_index=S.IGNORE_INDEX, reduction="sum")  # fmt: skip
        return S.sp_loss_combine(loss_sum, (shift != S.IGNORE_INDEX).sum(), group, combine)

    out = steploop.run(args, batches, forward=forward, backward=engine.backward, step=engine.step,
                       grad_norm=lambda: steploop.norm(safe_get_full_grad(p) for p in engine.module.parameters()))  # fmt: skip
    # safe_get_full_fp32_param is None at ZeRO 0, where the parameter itself is the master copy
    fp32 = [p if (f := safe_get_full_fp32_param(p)) is None else f for p in engine.module.parameters()]
    out.update(impl="deepspeed", deepspeed_version=deepspeed.__version__, loss_combine=combine, param_numel=numel,
               param_spread_in_sp_group=steploop.spread(fp32, group) if group is not None else 0.0)  # fmt: skip
    finish_worker(out, args.out)


def main(argv=None) -> None:
    args = parse_args(argv)
    with recorded_errors(args.out):  # for deepspeed_findings.md, then re-raised
        run(args)


if __name__ == "__main__":
    main()
