"""The rehearsal against a real step on one GPU: ``torch.cuda.max_memory_allocated`` vs ``--rehearse``.

Issue 31 item 3 on a GPU: one configuration that fits one H100 — a ~1.2B Llama at 32K tokens, bf16,
ZeRO 3 on one rank (FSDP2), tiled MLP and loss, activation checkpointing — trained for two steps
through the library's own engine (``run.loop.apply_techniques``, ``initialize``, ``micro_step``);
the second step's peak (``max_memory_allocated`` after ``reset_peak_memory_stats``) is compared with
the rehearsal of the same run, on fake CUDA tensors where this PyTorch has CUDA and emulated on
fake CPU tensors. Run::

    PYTHONPATH=src python -m bench.gpu_rehearsal            # on a GPU machine
    PYTHONPATH=src python -m bench.gpu_rehearsal --device cpu --layers 2 --seq-len 2048   # a CPU smoke run

It prints one table; the weights are random (memory does not depend on values).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

import torch


def _config_dir(layers: int) -> str:
    from transformers import LlamaConfig

    d = tempfile.mkdtemp()
    LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers, num_attention_heads=16,
                num_key_value_heads=8, vocab_size=32000, max_position_embeddings=1 << 17,
                tie_word_embeddings=False).save_pretrained(d)  # fmt: skip
    return d


def _run_config(model: str, seq_len: int):
    from ulysses_sp.run.config import config_from_dict

    return config_from_dict(dict(model=model, sp=1, seq_len=seq_len, micro_batch_size=1, zero_stage=3,
                                 dtype="bf16", tiled_mlp=True, tiled_loss=True, activation_checkpointing=True,
                                 progress=False))  # fmt: skip


def real_peak(model_dir: str, seq_len: int, device: str) -> dict:
    """Two real steps on one rank; the second step's peak bytes and time."""
    import torch.distributed as dist

    from ulysses_sp.data.shard import prepare_batch
    from ulysses_sp.engine import initialize
    from ulysses_sp.memory.meter import track_peak_memory
    from ulysses_sp.parallel.mesh import init_mesh, shutdown
    from ulysses_sp.run.loop import apply_techniques, micro_step
    from ulysses_sp.state.loading import init_empty_model

    cfg = _run_config(model_dir, seq_len)
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_mesh(sp_size=1, device_type=device)
        model = init_empty_model(model_dir)
        _, loss_fn = apply_techniques(cfg, model)
        engine, *_ = initialize(model, cfg.training_config(), mpu=mesh.mpu, loss_fn=loss_fn)
        for p in engine.module.parameters():  # random weights: memory does not depend on values
            torch.nn.init.normal_(p.to_local() if hasattr(p, "to_local") else p, std=0.02)
        vocab = 32000
        batch = prepare_batch({"input_ids": torch.randint(0, vocab, (1, seq_len))}, 1)
        out = {}
        for step in range(2):
            batch_dev = {k: v.to(engine.device) for k, v in batch.items()}
            params = list(engine.module.parameters())
            with track_peak_memory(engine.device, include=params if device == "cpu" else ()) as mem:
                t0 = time.perf_counter()
                micro_step(engine, batch_dev)
                engine.step()
                if device == "cuda":
                    torch.cuda.synchronize()
                out = {"peak_bytes": mem.peak_bytes, "step_s": time.perf_counter() - t0, "step": step}
        return out
    finally:
        shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--part", default="all", choices=("all", "real", "rehearse"))
    p.add_argument("--model-dir", default=None)
    args = p.parse_args()
    model_dir = args.model_dir or _config_dir(args.layers)
    if args.part == "real":
        print("JSON" + json.dumps(real_peak(model_dir, args.seq_len, args.device)))
        return
    if args.part == "rehearse":
        from ulysses_sp.rehearse.run import rehearse_run

        out = {}
        for dev in (["cuda", "cpu"] if args.device == "cuda" else ["cpu"]):
            try:
                r = rehearse_run(_run_config(model_dir, args.seq_len), gpus=1, device=dev, ranks=(0,))
                out[dev] = {"device_peak": r.device_peak, "predicted": r.predicted["peak_bytes"] - r.reserve,
                            "describe": r.device, "phase_peaks": r.ranks[0].phase_peaks, "top": r.ranks[0].top[:5]}  # fmt: skip
            except Exception as e:  # noqa: BLE001 - reported in the table
                out[dev] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        print("JSON" + json.dumps(out, default=str))
        return
    rows = {}
    for part in ("real", "rehearse"):  # separate processes: the rehearsal starts a fake process group
        cmd = [sys.executable, "-m", "bench.gpu_rehearsal", "--part", part, "--device", args.device,
               "--seq-len", str(args.seq_len), "--model-dir", model_dir]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        line = [ln for ln in res.stdout.splitlines() if ln.startswith("JSON")]
        rows[part] = json.loads(line[0][4:]) if line else {"error": res.stderr[-1500:]}
    print(json.dumps(rows, indent=1, default=str))
    real = rows["real"].get("peak_bytes")
    print(f"\n| what | peak (GiB) | vs real |\n|---|---|---|\n| real step, {args.device} | "
          f"{real / 2**30 if real else float('nan'):.3f} | 1.000 |")  # fmt: skip
    for dev, r in rows["rehearse"].items() if isinstance(rows["rehearse"], dict) else []:
        if "device_peak" in r and real:
            print(f"| rehearsal ({dev}) | {r['device_peak'] / 2**30:.3f} | {r['device_peak'] / real:.3f} |")
            print(f"| planner (no reserve) | {r['predicted'] / 2**30:.3f} | {r['predicted'] / real:.3f} |")


if __name__ == "__main__":
    main()
