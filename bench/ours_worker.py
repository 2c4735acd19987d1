"""ulysses-sp's training loop on the benchmark model: the counterpart of bench/ds_worker.py.

    python -m torch.distributed.run --nproc-per-node 2 -m bench.ours_worker \\
        --dp 1 --sp 2 --zero 1 --steps 4 --seq-len 64 --out /tmp/ours.json

The loop is ulysses-sp's documented one: ``register_with_transformers`` (sdpa core) ->
``ulysses_sp.engine.initialize(model, config, mpu=..., optimizer=AdamW)`` ->
``UlyssesSPDataLoaderAdapter`` -> ``loss = engine(**batch).loss; engine.backward(loss); engine.step()``,
timed and metered by bench/steploop.py exactly as DeepSpeed's; ZeRO partitions over all dp*sp ranks,
as DeepSpeed's does. Rank 0 writes the same JSON keys.
"""

from __future__ import annotations

import functools

import torch

from bench import spec as S
from bench import steploop
from bench.launch import finish_worker, init_worker


def main(argv=None) -> None:
    args = steploop.parser().parse_args(argv)
    from torch.distributed.tensor import DTensor

    from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
    from ulysses_sp.data import UlyssesSPDataLoaderAdapter
    from ulysses_sp.engine import initialize

    init_worker(120)
    batches = steploop.loader(args)
    model = S.build_model(S.ModelSpec.from_json(args.model), seed=args.seed)
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", args.sp, args.micro_batch)
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.0, "zero_optimization": {"stage": args.zero, "partition": "all"},
              "sequence_parallel_size": args.sp}  # fmt: skip
    engine, _, _, _ = initialize(model, config, mpu=mpu, optimizer=functools.partial(S.make_optimizer, lr=args.lr))
    group = mpu.get_sequence_parallel_group()
    batches = UlyssesSPDataLoaderAdapter(batches, mpu.get_sequence_parallel_rank(), group, args.sp, torch.device("cpu"))
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731  (FSDP2 shards gathered)
    out = steploop.run(
        args, batches,
        forward=lambda b: engine(**{k: b[k] for k in ("input_ids", "position_ids", "shift_labels")}).loss,
        backward=engine.backward, step=engine.step,
        grad_norm=lambda: steploop.norm(full(p.grad) for p in engine.module.parameters() if p.grad is not None),
    )  # fmt: skip
    # FSDP2 (ZeRO 2/3) gathers unsharded parameters into storages it resizes, invisible to the dispatch
    # meter: add them (stage 2 keeps all of them from forward to backward).
    unsharded = sum(p.numel() * p.element_size() for p in model.parameters()) if args.zero >= 2 else 0
    out.update(impl="ulysses-sp", peak_bytes=out["peak_bytes"] + unsharded, peak_bytes_measured=out["peak_bytes"],
               unsharded_param_bytes=unsharded, param_numel=sum(p.numel() for p in model.parameters()),
               param_spread_in_sp_group=steploop.spread([full(p) for p in engine.module.parameters()], group))  # fmt: skip
    finish_worker(out, args.out)


if __name__ == "__main__":
    main()
