"""Peak host memory of sharded loading at ZeRO 3: RSS growth per rank / the model's fp32 bytes.

Run: ``python -m bench.load_memory [--small] [--dp 2 4]`` (minutes on 2 CPU cores; ``--small --dp 2``: quick).

A random Llama (hidden 1024, 8 layers, vocab 32000, untied: 155M parameters, 594 MiB in fp32) is written with
``save_pretrained(max_shard_size="150MB")`` as fp32 and as bf16 files under /tmp. For each file dtype and dp
in (2, 4), dp gloo ranks run ``init_empty_model`` -> ``initialize`` (ZeRO 3, fp32 master weights) ->
``load_pretrained_weights``. Each rank resets its peak RSS (``VmHWM``, via ``/proc/self/clear_refs``) after
imports and the process group, so ``growth = VmHWM - VmRSS before`` counts everything loading adds: the model
object, its shards, and the file pages it maps. The goal: growth <= (1/dp + 0.05) x the model's fp32 bytes.
``stock reader`` rows run the same load with DCP's own ``HuggingFaceStorageReader.read_data`` (a file stays
mapped while this rank reads its parts of every tensor in it) instead of the library's block reader.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile

import torch

if __package__ in (None, ""):  # `python bench/load_memory.py` as well as `python -m bench.load_memory`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import md
from bench.launch import parser, run_worker, serve
from bench.spec import llama

CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
              num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False)  # fmt: skip
SMALL = {**CONFIG, "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 2}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def write_model(path: str, dtype: torch.dtype, config: dict = CONFIG) -> int:
    """Save a random ``config`` Llama in ``dtype`` to ``path``; return its parameter count."""
    model = llama(**config)
    model.to(dtype).save_pretrained(path, max_shard_size="150MB")
    return sum(p.numel() for p in model.parameters())


def worker(path: str, stock: bool) -> list[dict]:
    """Under torchrun (dp ranks, ZeRO 3): every rank's RSS growth while loading ``path``, and its shards."""
    import torch.distributed as dist
    import transformers.models.llama.modeling_llama  # noqa: F401 - imported before the baseline
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from ulysses_sp.engine import initialize
    from ulysses_sp.state import loading

    if stock:
        loading._BlockReader.read_data = HuggingFaceStorageReader.read_data  # type: ignore[method-assign]
    world = dist.get_world_size()
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
    got = [None] * world
    dist.all_gather_object(got, {"growth": _status("VmHWM") - before, "shards": shards})
    return got


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "load_memory.md")
    ap.add_argument("--small", action="store_true", help="a 2-layer, hidden-256 model (a quick check)")
    ap.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--load", nargs=2, metavar=("DIR", "READER"), help=argparse.SUPPRESS)  # the torchrun worker
    args = ap.parse_args(argv)
    if serve(lambda: worker(args.load[0], args.load[1] == "stock"), args.out):
        return
    run = md.provenance(md.command("bench.load_memory", argv))
    config, rows = SMALL if args.small else CONFIG, []
    with tempfile.TemporaryDirectory(prefix="load-memory-") as tmp:
        for dtype in (torch.float32, torch.bfloat16):
            path = os.path.join(tmp, str(dtype))
            model_bytes = 4 * write_model(path, dtype, config)
            for dp in args.dp:
                for reader in ("library", "stock"):
                    out = run_worker("bench.load_memory", dp, ["--load", path, reader])[0]
                    growth = max(r["growth"] for r in out) / model_bytes
                    shards = max(r["shards"] for r in out) / model_bytes
                    rows.append([str(dtype).removeprefix("torch."), dp, "stock reader" if reader == "stock" else "library",
                                 f"{shards:.3f}", f"{growth:.3f}", f"{1 / dp + 0.05:.3f}",
                                 "yes" if growth <= 1 / dp + 0.05 else "no"])  # fmt: skip
    md.page(args.out, "load_memory: peak RSS growth per rank while loading at ZeRO 3", run, [
        f"Model: Llama {config}, {model_bytes / 2**20:,.0f} MiB in fp32; files of at most 150 MB. Columns are "
        "fractions of the model's fp32 bytes (the max over ranks).",
        md.table(["file dtype", "dp", "reader", "own shards", "RSS growth", "goal (1/dp + 0.05)", "within"], rows)])


if __name__ == "__main__":
    main()
