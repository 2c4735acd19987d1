"""Peak host memory of sharded loading at ZeRO 3: RSS growth per rank / the model's fp32 bytes.

Run (a few minutes on 2 CPU cores)::

    PYTHONPATH=src python bench/load_memory.py          # writes bench/results/load_memory.md

A random Llama (hidden 1024, 8 layers, vocab 32000, untied: 155M parameters, 594 MiB in fp32) is
written with ``save_pretrained(max_shard_size="150MB")`` as fp32 and as bf16 files under /tmp. For
each file dtype and dp in (2, 4), dp gloo ranks run ``init_empty_model`` -> ``initialize`` (ZeRO 3,
fp32 master weights) -> ``load_pretrained_weights``. Each rank resets its peak RSS (``VmHWM``, via
``/proc/self/clear_refs``) after imports and the process group, so ``growth = VmHWM - VmRSS before``
counts everything loading adds: the model object, its shards, and the file pages it maps. The goal:
growth <= (1/dp + 0.05) x the model's fp32 bytes. ``stock reader`` rows run the same load with DCP's
own ``HuggingFaceStorageReader.read_data`` (a file stays mapped while this rank reads its parts of
every tensor in it) instead of the library's block reader.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import tempfile

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "bench", "results", "load_memory.md")
CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
              num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False)  # fmt: skip


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def write_model(path: str, dtype: torch.dtype) -> int:
    """Save a random ``CONFIG`` Llama in ``dtype`` to ``path``; return its parameter count."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG))
    model.to(dtype).save_pretrained(path, max_shard_size="150MB")
    return sum(p.numel() for p in model.parameters())


def _worker(rank: int, world: int, store: str, path: str, stock: bool, out: dict) -> None:
    import torch.distributed as dist
    import transformers.models.llama.modeling_llama  # noqa: F401 - imported before the baseline
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from ulysses_sp.engine import initialize
    from ulysses_sp.state import loading

    if stock:
        loading._BlockReader.read_data = HuggingFaceStorageReader.read_data  # type: ignore[method-assign]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}  # fmt: skip
    gc.collect()
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _status("VmRSS")
    engine, *_ = initialize(loading.init_empty_model(path), config, mesh_param=(world, 1))
    loading.load_pretrained_weights(engine.module, path)
    shards = sum(p.to_local().nbytes for p in engine.module.parameters())
    out[rank] = {"growth": _status("VmHWM") - before, "shards": shards}
    dist.destroy_process_group()


def main() -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    rows = []
    with tempfile.TemporaryDirectory(prefix="load-memory-") as tmp:
        for dtype in (torch.float32, torch.bfloat16):
            path = os.path.join(tmp, str(dtype))
            model_bytes = 4 * write_model(path, dtype)
            for dp in (2, 4):
                for stock in (False, True):
                    out = mp.Manager().dict()
                    mp.spawn(
                        _worker,
                        args=(dp, os.path.join(tmp, f"store-{dp}-{stock}"), path, stock, out),
                        nprocs=dp,
                    )
                    growth = max(r["growth"] for r in out.values()) / model_bytes
                    shards = max(r["shards"] for r in out.values()) / model_bytes
                    reader = "stock reader" if stock else "library"
                    row = (f"| {str(dtype).removeprefix('torch.')} | {dp} | {reader} | {shards:.3f} | {growth:.3f} | "
                           f"{1 / dp + 0.05:.3f} | {'yes' if growth <= 1 / dp + 0.05 else 'no'} |")  # fmt: skip
                    rows.append(row)
                    print(row, flush=True)
    lines = [
        "# load_memory: peak RSS growth per rank while loading at ZeRO 3",
        "",
        f"git {commit.stdout.strip()}, torch {torch.__version__}, {os.cpu_count()} CPUs; command "
        f"`PYTHONPATH=src python bench/load_memory.py`. Model: Llama {CONFIG}, {model_bytes / 2**20:,.0f} MiB "
        "in fp32; files of at most 150 MB. Columns are fractions of the model's fp32 bytes (the max over ranks).",
        "",
        "| file dtype | dp | reader | own shards | RSS growth | goal (1/dp + 0.05) | within |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        f.write("\n".join(lines) + "\n")
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
