"""``ulysses-sp plan``: which settings fit, how long a sequence, at what speed — before any run.

A thin layer over ``ulysses_sp.plan.model``: it reads the model's config (a preset, a local HF model
directory, a ``config.json`` file, or a named shape such as ``llama-8b``), enumerates the candidate
settings (every ``sp`` that divides the GPUs and that the heads allow, ZeRO stages 0-3, a ladder of
memory techniques, optionally model-state offload), predicts each one's peak memory per rank and
step time, and recommends the fastest setting that fits (with ``--max``: the one that allows the
longest sequence) as the exact ``ulysses-sp train`` command line. ``--json`` prints one document
(schema: README, "ulysses-sp plan")::

    ulysses-sp plan --model llama-8b --gpus 8 --gpu-memory 80GB --max --dtype bf16
    ulysses-sp plan --model tiny-llama --device cpu --memory 2GB --gpus 2 --seq-len 4096 --json
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from typing import Any

TECHNIQUES: list[dict[str, bool]] = [
    {},
    {"tiled_loss": True},
    {"tiled_loss": True, "tiled_mlp": True},
    {"tiled_loss": True, "tiled_mlp": True, "activation_checkpointing": True},
    {"tiled_loss": True, "tiled_mlp": True, "activation_checkpointing": True, "offload_activations": True},
]


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-llama",
                   help="preset, local HF model dir, config.json file, or a named shape (llama-8b)")  # fmt: skip
    p.add_argument("--gpus", type=int, default=1, help="devices per node")
    p.add_argument("--nodes", type=int, default=1, help="nodes")
    p.add_argument(
        "--device", default=None, help="device kind from the table: h100 (default), h200, a100, cpu"
    )
    p.add_argument("--gpu-memory", default=None, help="memory per device, e.g. 80GB (overrides the table)")
    p.add_argument("--memory", default=None, help="with --device cpu: memory per rank, e.g. 20GB")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--seq-len", type=int, default=None, help="evaluate at this sequence length")
    length.add_argument("--max", action="store_true", help="find each setting's longest sequence (default)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="fp32 (what `train` runs today) or bf16 mixed precision")  # fmt: skip
    p.add_argument("--micro-batch-size", type=int, default=1, help="samples per micro-step per dp replica")
    p.add_argument(
        "--offload-states",
        action="store_true",
        help="also consider model states on the host (--cpu-offload, ZeRO 3)",
    )
    p.add_argument("--tflops", type=float, default=None, help="override the device's peak TFLOP/s (--dtype)")
    p.add_argument("--mfu", type=float, default=None, help="override the achieved fraction of peak")
    p.add_argument("--link-gbps", type=float, default=None, help="override intra-node GB/s per direction")
    p.add_argument("--inter-gbps", type=float, default=None, help="override inter-node GB/s per direction")
    p.add_argument("--reserve", default=None, help="override the reserve per device, e.g. 4GB")
    p.add_argument("--json", action="store_true", help="print one JSON document (schema in the README)")


def load_shape(model: str):
    """``ModelShape`` of a preset, named shape, model directory or ``config.json`` (``ValueError``)."""
    from ulysses_sp.plan.inputs import SHAPES, ModelShape

    if model in SHAPES:
        return SHAPES[model]
    if model.endswith(".json") and os.path.isfile(model):
        from transformers import AutoConfig

        try:
            with open(model, encoding="utf-8") as f:
                values = json.load(f)
            return ModelShape.from_hf_config(AutoConfig.for_model(values.pop("model_type"), **values))
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"--model {model!r}: not a transformers config.json ({e})") from e
    from ulysses_sp.run.checks import model_config
    from ulysses_sp.tasks import load_tokenizer

    return ModelShape.from_hf_config(model_config(model, len(load_tokenizer(None, model))))


def hardware(ns: argparse.Namespace):
    from ulysses_sp.plan.hardware import device, parse_bytes

    hw = device(ns.device or ("cpu" if ns.memory and not ns.gpu_memory else "h100"))
    if ns.memory and ns.gpu_memory:
        raise ValueError("pass --gpu-memory (accelerators) or --memory (--device cpu), not both")
    if ns.gpu_memory or ns.memory:
        hw = replace(hw, memory_bytes=parse_bytes(ns.gpu_memory or ns.memory, what="--gpu-memory/--memory"))
    for flag, name in (
        ("tflops", None),
        ("mfu", "mfu"),
        ("link_gbps", "intra_gbps"),
        ("inter_gbps", "inter_gbps"),
    ):
        value = getattr(ns, flag)
        if value is not None:
            if not value > 0:
                raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {value}")
            hw = (
                replace(hw, tflops={**hw.tflops, ns.dtype: value})
                if name is None
                else replace(hw, **{name: value})
            )
    if ns.reserve is not None:
        hw = replace(
            hw, reserve_bytes=0 if ns.reserve in ("0", 0) else parse_bytes(ns.reserve, what="--reserve")
        )
    return replace(hw, gpus_per_node=ns.gpus if hw.name != "cpu" else hw.gpus_per_node)


def train_args(model: str, s: Any, nodes: int) -> tuple[dict[str, Any], list[str]]:
    """The ``ulysses-sp train`` flags of a setting, as a dict and as the command line."""
    flags: dict[str, Any] = {"model": model, "sp": s.sp, "seq_len": s.seq_len, "zero_stage": s.zero_stage,
                             "micro_batch_size": s.micro_batch_size}  # fmt: skip
    if getattr(s, "ring_size", 1) > 1:
        flags["ring_size"] = s.ring_size
    if s.partition != "data_parallel":
        flags["zero_partition"] = s.partition
    if nodes == 1:
        flags["nproc"] = s.world
    for name in ("tiled_mlp", "tiled_loss", "activation_checkpointing", "offload_activations"):
        if getattr(s, name):
            flags[name] = True
    if s.dtype != "fp32":
        flags["dtype"] = s.dtype
    if s.offload_states:  # the product's model-state offload (FSDP2 CPUOffloadPolicy, ZeRO 3)
        flags["cpu_offload"] = True
    args = ["ulysses-sp", "train"]
    for k, v in flags.items():
        args += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return flags, args


def _layouts(sps: list[int], world: int):
    """``(sp, zero stage, partition)``: partitions over the DP axis, and over all ranks when SP
    ranks exist (a DP axis of one rank partitions nothing)."""
    for sp in sps:
        for stage in (0, 1, 2, 3):
            if stage == 0 or world // sp > 1:
                yield sp, stage, "data_parallel"
            if stage and sp > 1:
                yield sp, stage, "all"


def candidates(ns: argparse.Namespace) -> dict[str, Any]:
    """The ``--json`` document: every candidate and the recommended one."""
    from ulysses_sp.checks import positive_int
    from ulysses_sp.parallel.mesh_shape import resolve_ring_size
    from ulysses_sp.plan.inputs import Settings
    from ulysses_sp.plan.model import max_seq_len, predict

    for flag in ("gpus", "nodes", "micro_batch_size"):
        positive_int(f"--{flag.replace('_', '-')}", getattr(ns, flag))
    if ns.seq_len is not None:
        positive_int("--seq-len", ns.seq_len)
    shape, hw = load_shape(ns.model), hardware(ns)
    world = ns.gpus * ns.nodes
    sps = [p for p in range(1, world + 1) if world % p == 0]  # beyond the heads: a ring (auto size)
    out = []
    for sp, stage, part in _layouts(sps, world):
        for tech in TECHNIQUES:
            for offload in (False, True) if ns.offload_states and stage == 3 else (False,):
                ring = resolve_ring_size(sp, shape.heads, shape.kv_heads)
                multiple = sp * (2 if ring > 1 else 1)
                if ns.seq_len is not None and ns.seq_len % multiple:
                    continue
                s = Settings(seq_len=ns.seq_len or multiple, micro_batch_size=ns.micro_batch_size, dp=world // sp,
                             sp=sp, ring_size=ring, zero_stage=stage, partition=part, dtype=ns.dtype, offload_states=offload,
                             device_type="cpu" if hw.name == "cpu" else "cuda", **tech)  # fmt: skip
                longest = max_seq_len(shape, s, hw)
                if ns.seq_len is None:
                    s = replace(s, seq_len=max(longest - longest % multiple, multiple))
                pred = predict(shape, s, hw)
                settings, args = train_args(ns.model, s, ns.nodes)
                out.append({
                    "settings": settings, "train_args": args, "peak_bytes_per_rank": pred.peak_bytes,
                    "breakdown": pred.breakdown, "host_bytes_per_rank": pred.host_bytes,
                    "fits": pred.peak_bytes <= hw.memory_bytes, "max_seq_len": longest,
                    "tokens_per_s": pred.tokens_per_s, "comm_share": pred.comm_share,
                })  # fmt: skip
    fitting = [c for c in out if c["fits"]]
    key = (
        (lambda c: (c["max_seq_len"], c["tokens_per_s"]))
        if ns.seq_len is None
        else (lambda c: c["tokens_per_s"])
    )
    best = max(fitting, key=key) if fitting else None
    return {
        "model": ns.model, "gpus": ns.gpus, "nodes": ns.nodes, "device": hw.name,
        "memory_bytes_per_rank": hw.memory_bytes, "dtype": ns.dtype, "seq_len": ns.seq_len,
        "recommended": best, "candidates": out,
    }  # fmt: skip


def _label(c: dict[str, Any]) -> str:
    s = c["settings"]
    tech = [n for n, k in (("loss", "tiled_loss"), ("mlp", "tiled_mlp"), ("ckpt", "activation_checkpointing"),
                           ("offload", "offload_activations"), ("states->host", "offload_states")) if s.get(k)]  # fmt: skip
    part = "/all" if s.get("zero_partition") == "all" else ""
    ring = f" (ring {s['ring_size']})" if s.get("ring_size", 1) > 1 else ""
    return f"sp {s['sp']}{ring} zero {s['zero_stage']}{part} " + ("+".join(tech) or "plain")


def render(doc: dict[str, Any]) -> str:
    """The human table: one row per candidate, then the recommendation and its breakdown."""
    gib = 2**30
    rows = [f"{'setting':<44} {'peak GiB':>9} {'fits':>5} {'max S':>11} {'tokens/s':>10} {'comm':>5}"]
    for c in doc["candidates"]:
        rows.append(f"{_label(c):<44} {c['peak_bytes_per_rank'] / gib:>9.2f} {'yes' if c['fits'] else 'no':>5} "
                    f"{c['max_seq_len']:>11,} {c['tokens_per_s']:>10,.0f} {c['comm_share']:>5.0%}")  # fmt: skip
    best = doc["recommended"]
    if best is None:
        rows.append("\nnothing fits: more devices, a shorter --seq-len, or --offload-states")
    else:
        rows.append(f"\nrecommended: {_label(best)} at S = {best['settings']['seq_len']:,}")
        rows.append("  " + " ".join(best["train_args"]))
        rows.append(
            "  breakdown: " + ", ".join(f"{k} {v / gib:.2f} GiB" for k, v in best["breakdown"].items() if v)
        )
    return "\n".join(rows)


def run_plan(ns: argparse.Namespace) -> str:
    """The command's output (JSON or table)."""
    doc = candidates(ns)
    return json.dumps(doc, indent=1) if ns.json else render(doc)
