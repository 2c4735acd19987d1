"""A real GPU step's ``max_memory_allocated`` beside ``train --rehearse`` of the same run (issue 31 item 3).

A ~1.2B Llama (h 2048, 16 layers), 32K tokens, bf16, ZeRO 3 on one rank, tiled MLP and loss,
checkpointing: two real steps through the library's engine (the second one measured), then the
rehearsal on fake CUDA tensors (where PyTorch has CUDA) and emulated on fake CPU tensors, in a
second process (the rehearsal starts a fake process group). Random weights: memory does not
depend on values. ``PYTHONPATH=src python -m bench.gpu_rehearsal [--device cpu --layers 2 --seq-len 2048]``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

import torch


def _cfg(model: str, seq_len: int, alst: bool = False):
    from ulysses_sp.run.config import config_from_dict

    return config_from_dict(dict(model=model, sp=1, seq_len=seq_len, micro_batch_size=1, zero_stage=3, dtype="bf16",
                                 tiled_mlp=True, tiled_loss=True, activation_checkpointing=True, progress=False,
                                 offload_activations=alst, recompute_norms=alst))  # fmt: skip


def real_peak(model_dir: str, seq_len: int, device: str, alst: bool = False) -> int:
    import torch.distributed as dist

    from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
    from ulysses_sp.data.shard import prepare_batch
    from ulysses_sp.engine import initialize
    from ulysses_sp.memory.meter import track_peak_memory
    from ulysses_sp.parallel.mesh import init_mesh, shutdown
    from ulysses_sp.run.loop import micro_step
    from ulysses_sp.run.model_checks import apply_techniques, sp_attention_wanted
    from ulysses_sp.state.loading import init_empty_model

    cfg = _cfg(model_dir, seq_len, alst)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_mesh(sp_size=1, device_type=device)
    model = init_empty_model(model_dir)
    _, loss_fn = apply_techniques(cfg, model)
    mpu = mesh.mpu
    if sp_attention_wanted(cfg, model.config):  # as train does: the SP attention at sp 1 too
        mpu = UlyssesSPAttentionHF.register_with_transformers(model, cfg.attn, 1, 1, seq_length=seq_len, mesh=mesh)
    engine, *_ = initialize(model, cfg.training_config(1), mpu=mpu, loss_fn=loss_fn)
    for p in engine.module.parameters():
        torch.nn.init.normal_(p.to_local(), std=0.02)
    batch = prepare_batch({"input_ids": torch.randint(0, 32000, (1, seq_len))}, 1)
    for _ in range(2):  # the second step is a steady-state one (optimizer state made)
        params = list(engine.module.parameters()) if device == "cpu" else ()
        with track_peak_memory(engine.device, include=params) as mem:
            micro_step(engine, {k: v.to(engine.device) for k, v in batch.items()})
            engine.step()
    shutdown()
    return mem.peak_bytes


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--model-dir")
    p.add_argument("--alst", action="store_true", help="also offload the checkpoints and recompute the norms")
    p.add_argument("--rehearse", action="store_true", help="(internal) the rehearsal half")
    a = p.parse_args()
    if a.rehearse:
        from ulysses_sp.rehearse.run import rehearse_run

        out = {}
        for dev in ["cuda", "cpu"] if a.device == "cuda" else ["cpu"]:
            r = rehearse_run(_cfg(a.model_dir, a.seq_len, a.alst), gpus=1, device=dev, ranks=(0,))
            out[r.device] = (r.device_peak, r.predicted["peak_bytes"] - r.reserve)
        print("JSON" + json.dumps(out))
        return
    from transformers import LlamaConfig

    a.model_dir = tempfile.mkdtemp()
    LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=a.layers, num_attention_heads=16,
                num_key_value_heads=8, vocab_size=32000, max_position_embeddings=1 << 17,
                tie_word_embeddings=False).save_pretrained(a.model_dir)  # fmt: skip
    cmd = [sys.executable, "-m", "bench.gpu_rehearsal", "--rehearse", "--device", a.device, "--seq-len",
           str(a.seq_len), "--model-dir", a.model_dir, *["--alst"] * a.alst]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    rehearsed = json.loads(next(ln for ln in res.stdout.splitlines() if ln.startswith("JSON"))[4:])
    real = real_peak(a.model_dir, a.seq_len, a.device, a.alst)
    print(f"| what | peak (GiB) | vs real |\n|---|---|---|\n| real step, {a.device} | {real / 2**30:.3f} | 1.000 |")
    for where, (peak, planned) in rehearsed.items():
        print(f"| rehearsal, {where} | {peak / 2**30:.3f} | {peak / real:.3f} |")
        print(f"| planner (no reserve) | {planned / 2**30:.3f} | {planned / real:.3f} |")


if __name__ == "__main__":
    main()
