"""Scale check for issue 11: sharded loading's peak host memory, and bf16 vs fp32 steps on CPU.

    python -m bench.scale_check [--small] [--out bench/results/scale_check.md]    # a few minutes

1. **Loading a 309M-parameter Llama-shaped model** (random weights written as bf16 sharded
   safetensors + index into a temp dir; fp32 master weights in memory) on 2 gloo ranks at dp = 2,
   ZeRO 3: the peak RSS of each rank (``VmHWM``) and its growth over the rank's RSS before
   loading, for the sharded path (``loading.init_empty_model`` -> ``initialize`` ->
   ``load_pretrained_weights``) and the old path (``from_pretrained`` on every rank, then
   ``initialize``), against the model's fp32 bytes. Goal: growth <= 0.6x the model.
2. **bf16 vs fp32 step time and peak tensor memory** of one process (ZeRO 0: autocast; ZeRO 3:
   FSDP2 ``MixedPrecisionPolicy``) on a small Llama at 2048 tokens: median of 4 timed steps after
   2 warm-up steps; peak via ``ulysses_sp.memory.meter.track_peak_memory`` (model states included).
   CPU bf16 speed depends on the CPU's bf16 support (AVX512-BF16 / AMX); this is not a GPU number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # `python bench/scale_check.py` as well as `python -m bench.scale_check`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import md
from bench.launch import finish_worker, init_worker, run_worker, under_torchrun

BIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=16,
           num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False)  # fmt: skip
SMALL = dict(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)  # fmt: skip


def _peak_rss() -> int:
    """This process's peak RSS (``VmHWM``: per address space, so a fresh one after ``exec``;
    ``ru_maxrss`` would carry the spawning parent's peak over into the child)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def write_model(path: str, fields: dict, shard_bytes: int = 200 * 2**20) -> int:
    """A random Llama-shaped checkpoint, tensor by tensor (never the whole model); returns #params."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**fields)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    parts, shard, size, numel = [], {}, 0, 0
    for name, p in meta.named_parameters():
        t = (torch.randn(p.shape) * 0.02).to(torch.bfloat16)
        if shard and size + t.nbytes > shard_bytes:
            parts.append(shard)
            save_file(shard, os.path.join(path, f"part{len(parts)}"), metadata={"format": "pt"})
            shard, size = {}, 0
        shard[name], size, numel = t, size + t.nbytes, numel + p.numel()
    parts.append(shard)
    save_file(shard, os.path.join(path, f"part{len(parts)}"), metadata={"format": "pt"})
    n, weight_map = len(parts), {}
    for i, part in enumerate(parts):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(os.path.join(path, f"part{i + 1}"), os.path.join(path, name))
        weight_map.update(dict.fromkeys(part, name))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": numel * 2}, "weight_map": weight_map}, f)
    cfg.save_pretrained(path)
    return numel


def load_worker(path: str, mode: str) -> list[dict]:
    """Under torchrun (dp = 2, ZeRO 3): load ``path`` by ``mode``; every rank's RSS before and peak."""
    import torch.distributed as dist
    import torch.distributed.checkpoint  # noqa: F401 - library code imported before the baseline
    import torch.distributed.fsdp  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoModelForCausalLM

    from ulysses_sp.engine import initialize
    from ulysses_sp.state.loading import init_empty_model, load_pretrained_weights

    world = dist.get_world_size()
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}  # fmt: skip
    before = _rss()
    t0 = time.perf_counter()
    if mode == "sharded":
        engine, *_ = initialize(init_empty_model(path), config, mesh_param=(world, 1))
        load_pretrained_weights(engine.module, path)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        engine, *_ = initialize(model, config, mesh_param=(world, 1))
        del model
    seconds = time.perf_counter() - t0
    local = sum(p.to_local().numel() * p.element_size() for p in engine.module.parameters())
    got = [None] * world
    dist.all_gather_object(got, {"before": before, "peak": _peak_rss(), "local": local, "seconds": seconds})
    return got


def measure_steps(seq: int) -> dict:
    """bf16 vs fp32 steps in this process (a one-rank gloo group), ZeRO 0 and 3."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ulysses_sp.engine import initialize
    from ulysses_sp.memory.meter import track_peak_memory

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    out = {}
    ids = torch.randint(0, SMALL["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(0))
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    for stage in (0, 3):
        for dtype in ("fp32", "bf16"):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(LlamaConfig(**SMALL), attn_implementation="sdpa")
            config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                      **({"bf16": {"enabled": True}} if dtype == "bf16" else {})}  # fmt: skip
            engine, *_ = initialize(model, config, mesh_param=(1, 1))
            times, peak, loss = [], 0, None
            for i in range(6):
                t0 = time.perf_counter()
                with track_peak_memory("cpu", include=[*engine.module.parameters()]) as mem:
                    o = engine(input_ids=ids, shift_labels=labels)
                    engine.backward(o.loss)
                    loss = engine.step()
                if i >= 2:
                    times.append(time.perf_counter() - t0)
                    peak = max(peak, mem.peak_bytes)
            out[(stage, dtype)] = {"seconds": statistics.median(times), "peak": peak, "loss": loss, "tokens": seq}
    dist.destroy_process_group()
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="load the small model, 256-token steps (a quick check)")
    ap.add_argument("--out", default=str(md.ROOT / "bench" / "results" / "scale_check.md"))
    ap.add_argument("--load", nargs=2, metavar=("DIR", "MODE"), help=argparse.SUPPRESS)  # the torchrun worker
    args = ap.parse_args(argv)
    if under_torchrun():
        init_worker()
        return finish_worker(load_worker(*args.load), args.out)
    run = md.provenance(" ".join(["python -m bench.scale_check", *(argv if argv is not None else sys.argv[1:])]))
    with tempfile.TemporaryDirectory(prefix="scale-check-") as path:
        numel = write_model(path, SMALL if args.small else BIG)
        loading = {m: run_worker("bench.scale_check", 2, ["--load", path, m])[0] for m in ("sharded", "from_pretrained")}
    steps = measure_steps(256 if args.small else 2048)
    model_bytes, rows = numel * 4, []
    for mode, ranks in loading.items():
        for rank, r in enumerate(ranks):
            growth = r["peak"] - r["before"]
            rows.append([mode, rank, _mib(r["before"]), _mib(r["peak"]), _mib(growth), f"{growth / model_bytes:.2f}x",
                         _mib(r["local"]), f"{r['seconds']:.1f}"])  # fmt: skip
    step_rows = []
    for stage in (0, 3):
        base = steps[(stage, "fp32")]
        for dtype in ("fp32", "bf16"):
            r = steps[(stage, dtype)]
            step_rows.append([stage, dtype, f"{r['seconds']:.3f} s", f"{r['seconds'] / base['seconds']:.2f}",
                              _mib(r["peak"]), f"{r['peak'] / base['peak']:.2f}", f"{r['loss']:.4f}"])  # fmt: skip
    md.page(args.out, "scale_check: sharded loading and bf16 on CPU", run, [
        f"## Loading a {numel / 1e6:.0f}M-parameter Llama-shaped model at dp = 2, ZeRO 3 (2 gloo ranks)",
        f"Weights on disk: bf16 sharded safetensors + index ({_mib(numel * 2)}); in memory fp32 master weights: "
        f"the full model is {_mib(model_bytes)}. `growth` = peak RSS - RSS before loading (after imports).",
        md.table(["path", "rank", "RSS before", "peak RSS", "growth", "growth / model", "own shards", "seconds"], rows),
        f"## bf16 vs fp32 on CPU: one process, Llama h={SMALL['hidden_size']} L={SMALL['num_hidden_layers']} "
        f"V={SMALL['vocab_size']}, {steps[(0, 'fp32')]['tokens']} tokens, AdamW",
        md.table(["ZeRO stage", "dtype", "step time (median of 4)", "bf16 / fp32 time", "peak tensor memory",
                  "bf16 / fp32 peak", "loss"], step_rows)])  # fmt: skip


if __name__ == "__main__":
    main()
