"""The library API end to end: register -> initialize -> adapter -> train loop.

Launch (CPU or GPU, any number of ranks divisible by --sp):

    torchrun --nproc-per-node 2 examples/train_sp.py --sp 2
    torchrun --nproc-per-node 4 examples/train_sp.py --sp 2 --zero-stage 3   # dp=2 x sp=2

A tiny Llama (random weights, built from a config: nothing is downloaded) trains on a copy task:
each sequence is a random first half repeated, so the second half can only be predicted by
attending across shards (a few steps only show the mechanics; `ulysses-sp train` shows learning).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

from ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter, initialize, shutdown


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sp", type=int, default=2)
    ap.add_argument("--zero-stage", type=int, default=0)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq_len,
    )
    model = AutoModelForCausalLM.from_config(config)

    # 1. Route attention through Ulysses SP; builds the (dp, sp) mesh and returns the mpu.
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model, core_attn_implementation="sdpa", sequence_parallel_size=args.sp, micro_batch_size=1
    )

    # 2. Data: full-length samples; initialize() builds the DataLoader with the SP-aware sampler.
    g = torch.Generator().manual_seed(1)
    half = torch.randint(0, 64, (64, args.seq_len // 2), generator=g)
    samples = [{"input_ids": torch.cat([h, h])} for h in half]

    # 3. The engine: sum gradients over SP, average over DP, ZeRO stage from the config.
    engine, optimizer, loader, _ = initialize(
        model=model,
        mpu=mpu,
        training_data=samples,
        config={
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": args.zero_stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "gradient_clipping": 1.0,
        },
    )

    # 4. Shard every sequence over the SP group (labels shifted before sharding).
    loader = UlyssesSPDataLoaderAdapter(
        loader,
        sp_rank=mpu.get_sequence_parallel_rank(),
        sp_group=mpu.get_sequence_parallel_group(),
        sp_world_size=mpu.get_sequence_parallel_world_size(),
        device=engine.device,
    )

    for step, batch in enumerate(loader):
        if step == args.steps:
            break
        loss = engine(**batch).loss  # the mean over every valid token of the whole sequence
        engine.backward(loss)
        step_loss = engine.step()
        if dist.get_rank() == 0:
            print(f"step {step} loss {step_loss:.4f} grad_norm {engine.get_global_grad_norm():.4f}")
    mpu.remove()


if __name__ == "__main__":
    try:
        main()
    finally:
        shutdown()  # after main(): its engine and loader are gone, so every group is released now
