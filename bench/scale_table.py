"""The mission's scale, rehearsed: the planner's longest length per row against ``train --rehearse``.

Each row is a model shape (a ``config.json`` written here, positions extended as a long-context
fine-tune's config does: no weights), a GPU count and the settings ``plan`` recommends at that scale
(bf16, ZeRO 3 over all ranks, tiled MLP and loss, checkpointing with the layer inputs on the host,
norm recompute, model states on the host). The length is the planner's longest for those settings
on 80 GB H100s (``plan.model.max_seq_len``, rounded down to 64K), or the record being judged. Each
rehearsal runs in its own process (the fake process group), rank 0 only. The table: predicted and
rehearsed device peak (without the reserve), their ratio, host bytes per node (predicted and
rehearsed, 2 TB = 2,048 GB per node available), the verdict, and the projected step time.

``python -m bench.scale_table [--rows NAME ...] [--out FILE]`` (CPU minutes a row: 1-25, Llama-3-8B on one GPU the most).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

from bench import md

SHAPES = {  # transformers config fields (the published config.json: nvidia/Nemotron-H-8B-Base-8K, Qwen/Qwen3-Next-80B-A3B-Instruct)
    "Llama-3-8B": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "Qwen3-32B": dict(model_type="qwen3", hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                      num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "Nemotron-H-8B": dict(model_type="nemotron_h", hybrid_override_pattern="M-M-M-M*-" + "M-M-M-M-M*-" * 3 + "M-" * 5, hidden_size=4096,
                          intermediate_size=21504, mamba_num_heads=128, mamba_head_dim=64, n_groups=8, ssm_state_size=128, vocab_size=131072),
    "Qwen3-Next-80B-A3B": dict(model_type="qwen3_next"),  # transformers' defaults are its config.json's (48 layers, 512 experts)
    "Qwen3-Next-80B-A3B, 4 of 48 layers": dict(model_type="qwen3_next", num_hidden_layers=4),  # one period: 3 delta-net + 1 attention
    "Qwen2.5-VL-7B": dict(model_type="qwen2_5_vl", text_config=dict(  # Qwen/Qwen2.5-VL-7B-Instruct's config.json
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        vocab_size=152064, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
        max_position_embeddings=1 << 25, tie_word_embeddings=False), vision_config=dict(
        depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14, spatial_merge_size=2,
        temporal_patch_size=2, window_size=112, out_hidden_size=3584, fullatt_block_indexes=[7, 15, 23, 31]),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653),
}  # fmt: skip
VLM_OVER = {k: False for k in ("tiled_mlp", "tiled_loss", "offload_activations", "recompute_norms")}
"""What a VLM run refuses (``run.vlm.check_vlm_options``): its rows keep ZeRO 3, bf16, checkpointing, host states."""
ROWS = {  # name: (shape, gpus, tokens or None for the planner's longest, settings over SETTINGS)
    "8b-1gpu": ("Llama-3-8B", 1, None, {}),
    "8b-8gpu": ("Llama-3-8B", 8, None, {}),
    "8b-8gpu-states": ("Llama-3-8B", 8, None, {"cpu_offload": False}),  # states on the device: less host
    "8b-8gpu-8m": ("Llama-3-8B", 8, 8_388_608, {"cpu_offload": False, "head_chunks": 4}),  # the 8M goal
    "8b-8gpu-8m-host": ("Llama-3-8B", 8, 8_388_608, {"head_chunks": 4, "host_memory": "2.5TB"}),  # a bigger node
    "8b-8gpu-8m-disk": ("Llama-3-8B", 8, 8_388_608, {"head_chunks": 4, "disk_layers": 5}),  # 5 layers' inputs on NVMe
    "8b-32gpu": ("Llama-3-8B", 32, None, {}),
    "32b-8gpu": ("Qwen3-32B", 8, None, {}),
    "32b-32gpu": ("Qwen3-32B", 32, None, {}),
    "nemotron-h-8gpu": ("Nemotron-H-8B", 8, None, {}),
    "qwen3-next-8gpu": ("Qwen3-Next-80B-A3B", 8, None, {"tiled_mlp": False}),  # --tiled-mlp refuses its experts' router
    "qwen3-next-8gpu-64k": ("Qwen3-Next-80B-A3B", 8, 65_536, {"tiled_mlp": False}),  # all 48 layers at a length a rehearsal reaches
    "qwen3-next-4l-8gpu": ("Qwen3-Next-80B-A3B, 4 of 48 layers", 8, 720_896, {"tiled_mlp": False}),  # the 48-layer model's longest
    "8b-8gpu-trainer": ("Llama-3-8B", 8, None, {"trainer": True}),  # HF Trainer + prepare(): trainer_row
    "vl7b-8gpu": ("Qwen2.5-VL-7B", 8, None, VLM_OVER),  # 1 image of 1344x1344 pixels per 8,192 tokens (rehearse.vlm)
    "vl7b-8gpu-sp4": ("Qwen2.5-VL-7B", 8, None, {**VLM_OVER, "sp": 4}),  # Ulysses alone: 28 heads split 4 ways, not 8 (a ring)
}
SETTINGS = dict(zero_stage=3, zero_partition="all", dtype="bf16", tiled_mlp=True, tiled_loss=True,
                activation_checkpointing=True, offload_activations=True, recompute_norms=True, cpu_offload=True)  # fmt: skip
GIB = float(1 << 30)


def _model_dir(shape: str) -> str:
    from transformers import AutoConfig

    fields = dict(SHAPES[shape])
    outer = {} if "text_config" in fields else dict(max_position_embeddings=1 << 25, tie_word_embeddings=False)
    config = AutoConfig.for_model(fields.pop("model_type"), **outer, **fields)
    d = tempfile.mkdtemp(prefix="scale-")
    config.save_pretrained(d)
    return d


def _cfg(model_dir: str, gpus: int, seq_len: int, head_chunks: int = 1, over: dict | None = None):
    from ulysses_sp.run.config import config_from_dict

    over = {k: v for k, v in (over or {}).items() if k != "trainer"}  # the Trainer's equivalent is these settings
    return config_from_dict(dict(model=model_dir, seq_len=seq_len, micro_batch_size=1, progress=False,
                                 **{"sp": gpus, **SETTINGS, "head_chunks": head_chunks, **(over or {})}))  # fmt: skip


def planner_longest(model_dir: str, gpus: int, over: dict | None = None) -> tuple[int, int]:
    """The planner's longest sequence for the row's settings on 80 GB H100s and 2 TB of host memory
    per node (rounded down to 64K), with the head groups ``plan --max`` would add (1: none)."""
    from ulysses_sp.plan.hardware import DEVICES
    from ulysses_sp.plan.head_groups import with_head_groups
    from ulysses_sp.plan.model import max_seq_len
    from ulysses_sp.rehearse.run import DEFAULT_HOST_MEMORY
    from ulysses_sp.run.preflight import model_shape, settings_for
    from ulysses_sp.state.model_dir import load_config

    if "tiled_loss" in (over or {}):  # a VLM row: its images grow with the length
        return vlm_longest(model_dir, gpus, over), 1
    hw, s, m = DEVICES["h100"], settings_for(_cfg(model_dir, gpus, gpus, over=over), gpus, "cuda"), model_shape(load_config(model_dir))
    fit = lambda s: max_seq_len(m, s, hw, host_budget=DEFAULT_HOST_MEMORY, ranks_per_node=min(gpus, hw.gpus_per_node))  # noqa: E731
    s, longest = with_head_groups(m, s, fit, None)[-1]
    return max(longest // 65536 * 65536, 65536), s.head_chunks


def vlm_longest(model_dir: str, gpus: int, over: dict) -> int:
    """A VLM row's longest length (multiple of 64K) the planner fits on 80 GB H100s and 2 TB per node, its
    tower's patches per rank those of ``rehearse.vlm``'s default load at each length (``run.preflight.prediction``)."""
    import torch

    from ulysses_sp.plan.hardware import DEVICES
    from ulysses_sp.rehearse.run import DEFAULT_HOST_MEMORY
    from ulysses_sp.rehearse.vlm import synthetic_vlm_batch, vision_patches
    from ulysses_sp.run.preflight import prediction
    from ulysses_sp.state.model_dir import load_config

    config, hw, lo, hi = load_config(model_dir), DEVICES["h100"], 0, 64

    def fits(n: int) -> bool:
        cfg = _cfg(model_dir, gpus, n * 65536, over=over)
        pred = prediction(cfg, gpus, config, torch.device("cuda"),
                          vision_patches=vision_patches(cfg, synthetic_vlm_batch(cfg, config)))  # fmt: skip
        return pred.peak_bytes <= hw.memory_bytes and pred.host_bytes * min(gpus, 8) <= DEFAULT_HOST_MEMORY

    while lo + 1 < hi:
        lo, hi = ((lo + hi) // 2, hi) if fits((lo + hi) // 2) else (lo, (lo + hi) // 2)
    return max(lo, 1) * 65536


def rehearse_row(model_dir: str, gpus: int, seq_len: int, head_chunks: int, over: dict) -> dict:
    """One rehearsal (run in a child process): its JSON document."""
    from ulysses_sp.rehearse.run import rehearse_run

    host = over.pop("host_memory", None)  # per node (default: rehearse_run's, 2 TB)
    if over.pop("trainer", False):
        return trainer_row(model_dir, gpus, seq_len, head_chunks, host)
    r = rehearse_run(_cfg(model_dir, gpus, seq_len, head_chunks, over), gpus=gpus, device="cuda", ranks=(0,), host_memory=host)
    return r.as_dict()


def trainer_row(model_dir: str, gpus: int, seq_len: int, head_chunks: int, host: str | None) -> dict:
    """The HF Trainer path with SETTINGS' equivalents: a meta model in a ``Trainer`` (bf16, gradient
    checkpointing), ``prepare()``'s ALST options, FSDP2 ``full_shard offload`` (``rehearse.trainer``)."""
    import torch
    from transformers import AutoConfig, Trainer, TrainingArguments

    from ulysses_sp.rehearse.trainer import meta_model, rehearse_trainer

    args = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="scale-trainer-"), bf16=True, report_to=[],
                             use_cpu=not torch.cuda.is_available(), gradient_checkpointing=True,
                             gradient_checkpointing_kwargs={"use_reentrant": False}, per_device_train_batch_size=1)  # fmt: skip
    trainer = Trainer(model=meta_model(AutoConfig.from_pretrained(model_dir)), args=args)
    return rehearse_trainer(trainer, sp_size=gpus, seq_len=seq_len, gpus=gpus, fsdp="full_shard offload", ranks=(0,),
                            host_memory=host, tiled_mlp=True, tiled_loss=True, offload_activations=True,
                            recompute_norms=True, head_chunks=head_chunks).as_dict()  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--out", default="bench/results/scale_table.md")
    p.add_argument("--child", nargs=5, metavar=("MODEL_DIR", "GPUS", "SEQ_LEN", "HEADS", "OVER"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print("JSON" + json.dumps(rehearse_row(a.child[0], *map(int, a.child[1:4]), json.loads(a.child[4])), default=str))
        return
    rows, run = [], md.provenance(md.command("bench.scale_table", argv))
    for name in a.rows:
        shape, gpus, tokens, over = ROWS[name]
        model_dir, over = _model_dir(shape), dict(over)
        seq_len, heads = (tokens, over.pop("head_chunks", 1)) if tokens else planner_longest(model_dir, gpus, over)
        print(f"{name}: {shape} on {gpus} GPU(s) at {seq_len:,} tokens, {heads} head group(s)", file=sys.stderr)
        cmd = [sys.executable, "-m", "bench.scale_table", "--child", model_dir, str(gpus), str(seq_len), str(heads),
               json.dumps(over)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        line = next((ln for ln in res.stdout.splitlines() if ln.startswith("JSON")), None)
        if line is None:
            rows.append([shape, gpus, f"{seq_len:,}", "failed: " + res.stderr.strip().splitlines()[-1][:200]])
            continue
        r = json.loads(line[4:])
        planned = r["predicted"]["peak_bytes"] - r["reserve"]
        host_planned = r["predicted"]["host_bytes"] * min(gpus, r["gpus_per_node"])
        t = r["time"]
        rows.append([shape, gpus, f"{seq_len:,}", ", ".join(f"{k} {v}" for k, v in over.items()) or "", heads, f"{planned / GIB:.2f}",
                     f"{r['device_peak'] / GIB:.2f}", f"{planned / r['device_peak']:.3f}",
                     f"{host_planned / GIB:,.0f}", f"{r['host_per_node'] / GIB:,.0f}",
                     "fits" if r["fits"] else "does not fit", f"{t['step_s']:,.0f}",
                     f"{t['tokens_per_s_per_gpu']:,.0f}", f"{r['ranks'][0]['seconds']:.0f}"])  # fmt: skip
        print(f"  {rows[-1]}", file=sys.stderr, flush=True)
    header = ["model", "GPUs", "tokens", "settings changed", "head groups", "planner peak GiB", "rehearsed peak GiB", "planner / rehearsal",
              "planner host GiB/node", "rehearsed host GiB/node", "verdict (80 GB, 6 GB reserve, 2 TB host)",
              "projected step s", "projected tokens/s/GPU", "rehearsal CPU s"]  # fmt: skip
    note = ("Settings: " + ", ".join(f"{k} {v}" for k, v in SETTINGS.items()) + "; sp = GPUs; head groups (--head-chunks) where "
            "the planner reaches longer with them. Peaks are rank 0's "
            "device bytes without the planner's 6 GB reserve; the projected time is the rehearsal's FLOPs and bytes "
            "on an H100 table at 40 % of peak FLOP/s (rehearse/timing.py), not a measurement.")  # fmt: skip
    md.page(a.out, "The mission's scale: planner vs rehearsal", md.finish(run), [md.table(header, rows), note])


if __name__ == "__main__":
    main()
