"""Scale check for issue 11: sharded loading's peak host memory, and bf16 vs fp32 steps on CPU.

Run (a few minutes on 2 CPU cores)::

    PYTHONPATH=src python bench/scale_check.py            # writes bench/results/scale_check.md

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

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "bench", "results", "scale_check.md")
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


def write_model(path: str, shard_bytes: int = 200 * 2**20) -> int:
    """A random Llama-shaped checkpoint, tensor by tensor (never the whole model); returns #params."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**BIG)
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


def _load_worker(rank: int, world: int, store_path: str, path: str, mode: str, out: dict) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint  # noqa: F401 - library code imported before the baseline
    import torch.distributed.fsdp  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoModelForCausalLM

    from ulysses_sp.engine import initialize
    from ulysses_sp.state.loading import init_empty_model, load_pretrained_weights

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
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
    peak = _peak_rss()
    local = sum(p.to_local().numel() * p.element_size() for p in engine.module.parameters())
    out[(mode, rank)] = {"before": before, "peak": peak, "local": local, "seconds": seconds}
    dist.destroy_process_group()


def measure_loading(path: str) -> dict:
    results = mp.Manager().dict()
    for mode in ("sharded", "from_pretrained"):
        store = tempfile.mktemp(prefix="scale-store-")
        mp.spawn(_load_worker, args=(2, store, path, mode, results), nprocs=2, join=True)
    return dict(results)


def _step_worker(rank: int, out: dict) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ulysses_sp.engine import initialize
    from ulysses_sp.memory.meter import track_peak_memory

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    seq = 2048
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
            out[(stage, dtype)] = {
                "seconds": statistics.median(times),
                "peak": peak,
                "loss": loss,
                "tokens": seq,
            }
    dist.destroy_process_group()


def measure_steps() -> dict:
    results = mp.Manager().dict()
    mp.spawn(_step_worker, args=(results,), nprocs=1, join=True)
    return dict(results)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="scale-check-") as path:
        numel = write_model(path)
        loading = measure_loading(path)
    steps = measure_steps()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    model_bytes = numel * 4
    lines = [
        "# scale_check (issue 11): sharded loading and bf16 on CPU",
        "",
        f"Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, git {commit}, host {platform.node()} "
        f"({os.cpu_count()} CPUs, {platform.machine()}), torch {torch.__version__}; "
        "command `PYTHONPATH=src python bench/scale_check.py`.",
        "",
        f"## Loading a {numel / 1e6:.0f}M-parameter Llama-shaped model at dp = 2, ZeRO 3 (2 gloo ranks)",
        "",
        f"Weights on disk: bf16 sharded safetensors + index ({_mib(numel * 2)}); in memory fp32 master weights: "
        f"the full model is {_mib(model_bytes)}. `growth` = peak RSS - RSS before loading (after imports).",
        "",
        "| path | rank | RSS before | peak RSS | growth | growth / model | own shards | seconds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode in ("sharded", "from_pretrained"):
        for rank in (0, 1):
            r = loading[(mode, rank)]
            growth = r["peak"] - r["before"]
            lines.append(f"| {mode} | {rank} | {_mib(r['before'])} | {_mib(r['peak'])} | {_mib(growth)} | "
                         f"{growth / model_bytes:.2f}x | {_mib(r['local'])} | {r['seconds']:.1f} |")  # fmt: skip
    lines += [
        "",
        f"## bf16 vs fp32 on CPU: one process, Llama h={SMALL['hidden_size']} L={SMALL['num_hidden_layers']} "
        f"V={SMALL['vocab_size']}, {steps[(0, 'fp32')]['tokens']} tokens, AdamW",
        "",
        "| ZeRO stage | dtype | step time (median of 4) | bf16 / fp32 time | peak tensor memory | bf16 / fp32 peak | loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for stage in (0, 3):
        base = steps[(stage, "fp32")]
        for dtype in ("fp32", "bf16"):
            r = steps[(stage, dtype)]
            lines.append(f"| {stage} | {dtype} | {r['seconds']:.3f} s | {r['seconds'] / base['seconds']:.2f} | "
                         f"{_mib(r['peak'])} | {r['peak'] / base['peak']:.2f} | {r['loss']:.4f} |")  # fmt: skip
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        f.write("\n".join(lines) + "\n")
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
