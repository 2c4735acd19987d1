"""GPU check for issue 11 — NOT YET RUN (written in a session without a GPU; run it where one is).

The CUDA path of mixed precision and offload: bf16 + sdpa, a ~1.2B-parameter Llama (Llama-3.2-1B shape, random
weights), sp = 1, one GPU, sequence lengths 32K / 64K / 128K, ZeRO 3 with and without CPU offload of the model
states (FSDP2 ``CPUOffloadPolicy``, pinned memory), with the ALST techniques a long sequence needs (tiled MLP,
tiled logits + loss, activation checkpointing). For each case: tokens/s (median of 3 steps after 1 warm-up),
``torch.cuda.max_memory_allocated``, the loss, or the exception if it failed (OOM included). Writes
``bench/results/gpu_check.md``.

Run on a CUDA machine (5-10 minutes): ``python -m bench.gpu_check [--lengths 32768]`` (or ``python
bench/gpu_check.py``). Benchmark code may name CUDA (the library does not): it measures this device's allocator.
"""

from __future__ import annotations

import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

if __package__ in (None, ""):  # `python bench/gpu_check.py` as well as `python -m bench.gpu_check`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

from bench import md
from bench.launch import parser
from ulysses_sp.engine import initialize
from ulysses_sp.memory.offload import enable_activation_checkpointing
from ulysses_sp.memory.tiling import TiledCausalLMLoss, apply_tiled_mlp

MODEL = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
             max_position_embeddings=131072, rope_theta=500000.0)  # fmt: skip


def run_case(seq: int, offload: bool) -> dict:
    """One case: a fresh model, 1 warm-up and 3 timed steps; tokens/s, peak allocated, the last loss."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**MODEL), attn_implementation="sdpa")
    n_params = sum(p.numel() for p in model.parameters())
    apply_tiled_mlp(model, None)
    enable_activation_checkpointing(model)
    zero = {"stage": 3, **({"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}} if offload else {})}
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}}  # fmt: skip
    engine, *_ = initialize(model, config, mesh_param=(1, 1), loss_fn=TiledCausalLMLoss(num_shards=None))
    device = engine.device
    ids = torch.randint(0, MODEL["vocab_size"], (1, seq), device=device)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    torch.cuda.reset_peak_memory_stats(device)
    times, loss = [], None
    for i in range(4):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        engine.backward(engine(input_ids=ids, shift_labels=labels).loss)  # as the CLI loop: output freed first
        loss = engine.step()
        torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - t0)
    del engine, model
    dist.barrier()
    return {"params": n_params, "tok_s": seq / statistics.median(times), "max_alloc": torch.cuda.max_memory_allocated(device),
            "loss": loss}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "gpu_check.md")
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536, 131072])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_check.py needs a CUDA device")
    run = md.provenance(md.command("bench.gpu_check", argv), backend=f"nccl, {torch.cuda.get_device_name(0)}")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    rows = []
    for seq in args.lengths:
        for offload in (False, True):
            try:
                r = run_case(seq, offload)
                rows.append([seq, "on" if offload else "off", f"{r['params'] / 1e9:.2f}B", f"{r['tok_s']:,.0f}",
                             f"{r['max_alloc'] / 2**30:.1f} GiB", f"{r['loss']:.3f}", ""])  # fmt: skip
            except Exception as e:  # noqa: BLE001 - a failing case (OOM) is a result to report
                rows.append([seq, "on" if offload else "off", "", "", "", "", f"{type(e).__name__}: {str(e)[:120]}"])
                traceback.print_exc()
            torch.cuda.empty_cache()
    md.page(args.out, "gpu_check: bf16 + ZeRO 3 (+ CPU offload) on one GPU", run, [
        "Llama-3.2-1B shape (random weights), sp = 1, bf16, sdpa, tiled MLP + tiled loss + activation checkpointing.",
        md.table(["tokens", "CPU offload", "params", "tokens/s", "max_memory_allocated", "loss", "failure"], rows)])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
