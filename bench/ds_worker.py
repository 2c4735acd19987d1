"""DeepSpeed's own Ulysses/ALST on the benchmark model: one worker process (runs in bench/.venv-deepspeed).

Launched by ``python -m bench`` (section deepspeed), never imported by ulysses-sp:

    bench/.venv-deepspeed/bin/python -m torch.distributed.run --nproc-per-node 2 -m bench.ds_worker \\
        --dp 1 --sp 2 --zero 1 --steps 4 --seq-len 64 --out /tmp/ds.json

The loop is the one DeepSpeed documents for ALST: ``UlyssesSPAttentionHF.register_with_transformers`` on
the model (sdpa core attention), ``deepspeed.initialize(model, optimizer, config with
sequence_parallel_size, mpu=...)``, ``UlyssesSPDataLoaderAdapter`` around an ordinary DataLoader, the
per-shard loss combined over the SP group with a differentiable all-gather weighted by valid-token counts
(an all-reduce at dp > 1: torch's gloo all-gather backward fails for SP groups without global rank 0),
``engine.backward`` and ``engine.step``; timed and metered by bench/steploop.py exactly as ours. ZeRO
buckets are the model's size (DeepSpeed's default allocates 2 GB). ``deepspeed`` is imported only when
the worker runs: the module imports without it.
"""

from __future__ import annotations

import torch

from bench import spec as S
from bench import steploop
from bench.launch import finish_worker, init_worker


def main(argv=None) -> None:
    args = steploop.parser().parse_args(argv)
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import (
        UlyssesSPAttentionHF,
        UlyssesSPDataLoaderAdapter,
    )
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    init_worker(120, deepspeed=True)
    batches = steploop.loader(args)
    model = S.build_model(S.ModelSpec.from_json(args.model), seed=args.seed)
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=args.sp,
        micro_batch_size=args.micro_batch, seq_length_is_variable=True)  # fmt: skip
    numel = sum(p.numel() for p in model.parameters())
    zero = {"stage": args.zero, "reduce_bucket_size": numel, "allgather_bucket_size": numel}
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.0, "zero_optimization": zero, "sequence_parallel_size": args.sp,
              "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
              "steps_per_print": 10**9, "wall_clock_breakdown": False}  # fmt: skip
    opt = S.make_optimizer(model.parameters(), args.lr)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config, mpu=mpu)
    group = mpu.get_sequence_parallel_group()
    batches = UlyssesSPDataLoaderAdapter(batches, sp_rank=mpu.get_sequence_parallel_rank(), sp_group=group,
                                         sp_world_size=args.sp, device=torch.device("cpu"))  # fmt: skip
    combine = "all_gather" if args.dp == 1 else "all_reduce"

    def forward(b):
        logits = engine(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
        shift = b["shift_labels"]
        loss_sum = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), shift.reshape(-1),
                                                     ignore_index=S.IGNORE_INDEX, reduction="sum")  # fmt: skip
        return S.sp_loss_combine(loss_sum, (shift != S.IGNORE_INDEX).sum(), group, combine)

    out = steploop.run(args, batches, forward=forward, backward=engine.backward, step=engine.step,
                       grad_norm=lambda: steploop.norm(safe_get_full_grad(p) for p in engine.module.parameters()))  # fmt: skip
    # safe_get_full_fp32_param is None at ZeRO 0, where the parameter itself is the master copy
    fp32 = [p if (f := safe_get_full_fp32_param(p)) is None else f for p in engine.module.parameters()]
    out.update(impl="deepspeed", deepspeed_version=deepspeed.__version__, loss_combine=combine, param_numel=numel,
               param_spread_in_sp_group=steploop.spread(fp32, group))  # fmt: skip
    finish_worker(out, args.out)


if __name__ == "__main__":
    main()
