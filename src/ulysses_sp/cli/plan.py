"""``ulysses-sp plan``: which settings fit, how long a sequence, at what speed — before any run.

A thin layer over ``ulysses_sp.plan.model``: it reads the model's config (a preset, a local HF model
directory, a ``config.json`` file, or a named shape such as ``llama-8b``), enumerates the candidate
settings (every ``sp`` that divides the GPUs and that the heads allow, ZeRO stages 0-3, a ladder of
memory techniques, model states on the host with ``--offload-states`` or when nothing fits on the
devices alone; beside each, head groups where they reach longer: ``plan.head_groups``), predicts each one's peak memory per rank and step time, and recommends the fastest
setting that fits (with ``--max``: the one that allows the longest sequence, capped at the model's
positions so that ``train`` accepts it) as the exact ``ulysses-sp train`` command line; ``notes``
say how it was reached. ``--json`` prints one document
(schema: ``cli.plan_schema``)::

    ulysses-sp plan --model llama-8b --gpus 8 --gpu-memory 80GB --max --dtype bf16
    ulysses-sp plan --model tiny-llama --device cpu --memory 2GB --gpus 2 --seq-len 4096 --json
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from typing import Any

from ulysses_sp.cli.plan_render import TOP_ROWS, complete_command, label, render

TECHNIQUES: list[dict[str, bool]] = [
    {},
    {"tiled_loss": True},
    {"tiled_loss": True, "tiled_mlp": True},
    {"tiled_loss": True, "tiled_mlp": True, "activation_checkpointing": True},
    {"tiled_loss": True, "tiled_mlp": True, "activation_checkpointing": True, "offload_activations": True},
    {"tiled_loss": True, "tiled_mlp": True, "activation_checkpointing": True, "offload_activations": True,
     "recompute_norms": True},
]


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-llama",
                   help="preset, local HF model dir, config.json file, or a named shape (llama-8b)")  # fmt: skip
    p.add_argument("--gpus", type=int, default=1, help="devices per node")
    p.add_argument("--nodes", type=int, default=1, help="nodes")
    p.add_argument("--device", default=None,
                   help="device kind from the table: h100, h200, a100, cpu (default h100; cpu with --memory)")  # fmt: skip
    p.add_argument("--gpu-memory", default=None, help="memory per device, e.g. 80GB (default: the device table's)")
    p.add_argument("--memory", default=None, help="with --device cpu: memory per rank, e.g. 20GB")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--seq-len", type=int, default=None,
                        help="evaluate every setting at this sequence length (without it: --max)")  # fmt: skip
    length.add_argument("--max", action="store_true",
                        help="find each setting's longest sequence, recommend the longest (what plan does "
                             "without --seq-len); capped at the model's max_position_embeddings")  # fmt: skip
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="compute dtype, as train's --dtype: fp32, or bf16/fp16 mixed precision (fp32 master "
                        "weights and optimizer state); default bf16 on an accelerator, fp32 with --device cpu")  # fmt: skip
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="samples per micro-step per dp replica; default train's: 1 for a model directory or "
                        "a named shape, 8 for a preset")  # fmt: skip
    p.add_argument("--all", action="store_true",
                   help=f"print every candidate row (without it: the best {TOP_ROWS}, then how many more)")  # fmt: skip
    p.add_argument("--offload-states", action="store_true",
                   help="also consider model states on the host (train's --cpu-offload, ZeRO 3); without "
                        "this flag only when nothing fits on the devices alone")  # fmt: skip
    p.add_argument("--tflops", type=float, default=None,
                   help="peak TFLOP/s of a device at --dtype (default: the device table's)")  # fmt: skip
    p.add_argument("--mfu", type=float, default=None,
                   help="achieved fraction of that peak, in (0, 1] (default: the device table's)")  # fmt: skip
    p.add_argument("--link-gbps", type=float, default=None,
                   help="intra-node GB/s per direction (default: the device table's)")  # fmt: skip
    p.add_argument("--inter-gbps", type=float, default=None,
                   help="inter-node GB/s per direction (default: the device table's)")  # fmt: skip
    p.add_argument("--reserve", default=None,
                   help="memory per device kept back for the runtime, e.g. 4GB (default: the device table's)")  # fmt: skip
    p.add_argument("--host-memory", default=None,
                   help="host memory of one node, e.g. 2TiB (default: 2 TB = 2,048 GB, a DGX H100-class node, which one GPU "
                        "may use whole); a setting whose host bytes per node exceed it does not fit")  # fmt: skip
    p.add_argument("--rehearse", action="store_true",
                   help="rehearse the recommended train command (one step on fake tensors); with --max "
                        "(no --seq-len) confirm the longest length by rehearsal, bisecting to 2 %%")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON document (schema: ulysses_sp.cli.plan_schema)")


def load_shape(model: str, config: Any = None):
    """``ModelShape`` of a preset, named shape, model directory or ``config.json`` (``ValueError``),
    with the positions limit ``train`` checks ``--seq-len`` against; ``config``: the model's config
    when already read (``plan_judge.read_config``)."""
    from ulysses_sp.cli.plan_judge import read_config
    from ulysses_sp.plan.inputs import SHAPES
    from ulysses_sp.run.preflight import planned_shape
    from ulysses_sp.run.prelaunch import max_trained_length

    if model in SHAPES:
        return SHAPES[model]
    config = read_config(model) if config is None else config
    text = config.get_text_config()  # a VLM: its language model, with its vision tower's parameters
    return planned_shape(config, max_positions=max_trained_length(text)[0])


def mixers_shard(shape, sp: int, ring: int) -> bool:
    """Whether the model's sequence mixers (if any) shard at ``sp`` (heads divide; Ulysses only:
    the mixers refuse the ring layout)."""
    from ulysses_sp.plan.mixers import shardable

    mixers = [k.mixer for k in shape.layer_kinds if k.mixer is not None]
    return not mixers or (ring == 1 and all(shardable(mx, sp) for mx in mixers))


def layer_notes(shape) -> list[str]:
    """``layers 0-2, 4: mamba2 (...)`` lines: which layers are sequence mixers, which attention."""
    from ulysses_sp.plan.mixers import describe

    groups: dict[str, list[int]] = {}
    for i, k in enumerate(shape.layer_kinds):
        parts = ([describe(k.mixer)] if k.mixer else []) + (["attention"] if k.attention else [])
        label = " + ".join(parts) or "MLP only"
        groups.setdefault(label + ("" if k.mlp or not parts else ", no MLP"), []).append(i)
    return [f"layers {', '.join(map(str, ids))}: {label}" for label, ids in groups.items()]


def _device_name(ns: argparse.Namespace) -> str:
    return ns.device or ("cpu" if ns.memory and not ns.gpu_memory else "h100")


def with_defaults(ns: argparse.Namespace) -> argparse.Namespace:
    """``ns`` with train's defaults where a flag was left out: ``--dtype`` bf16 on an accelerator (the
    planner's devices all have it; fp32 with ``--device cpu``), ``--micro-batch-size`` the model's
    (``run.config.model_defaults``: 1 for a directory or named shape, 8 for a preset)."""
    from ulysses_sp.run.config import model_defaults

    dtype = ns.dtype or ("fp32" if _device_name(ns) == "cpu" else "bf16")
    micro = ns.micro_batch_size or model_defaults(ns.model)["micro_batch_size"]
    return argparse.Namespace(**{**vars(ns), "dtype": dtype, "micro_batch_size": micro})


def hardware(ns: argparse.Namespace):
    from ulysses_sp.plan.hardware import device, parse_bytes

    hw = device(_device_name(ns))
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
            if not 0 < value < math.inf:  # NaN and inf too: JSON has no number for them
                raise ValueError(f"--{flag.replace('_', '-')} must be a finite number > 0, got {value}")
            if flag == "mfu" and value > 1:
                raise ValueError(
                    f"--mfu is the achieved fraction of the device's peak, in (0, 1]; got {value} "
                    "(a percentage? 40% is --mfu 0.4)"
                )
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


def train_args(model: str, s: Any, nodes: int, attn: str = "sdpa") -> tuple[dict[str, Any], list[str]]:
    """The ``ulysses-sp train`` flags of a setting, as a dict and as the command line (``attn``:
    written when not train's default)."""
    flags: dict[str, Any] = {"model": model, "sp": s.sp, "seq_len": s.seq_len, "zero_stage": s.zero_stage,
                             "micro_batch_size": s.micro_batch_size}  # fmt: skip
    if attn != "sdpa":
        flags["attn"] = attn
    if getattr(s, "ring_size", 1) > 1:
        flags["ring_size"] = s.ring_size
    if getattr(s, "head_chunks", 1) > 1:
        flags["head_chunks"] = s.head_chunks
    if s.partition != "data_parallel":
        flags["zero_partition"] = s.partition
    if nodes == 1:
        flags["nproc"] = s.world
    for name in ("tiled_mlp", "tiled_loss", "activation_checkpointing", "offload_activations", "recompute_norms"):
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


def _layouts(sps: list[int], world: int, offload: str):
    """``(sp, zero stage, partition, states on the host)``. Partitions over the DP axis, and over
    all ranks when SP ranks exist (a DP axis of one rank partitions nothing). ``offload``: ``"no"``,
    ``"also"`` (ZeRO 3 rows with and without host states) or ``"only"`` (only host-state rows)."""
    for sp in sps:
        dp = world // sp
        rows = [(stage, "data_parallel") for stage in (0, 1, 2, 3) if stage == 0 or dp > 1]
        rows += [(stage, "all") for stage in (1, 2, 3) if sp > 1]
        if world == 1:  # nothing to partition, but train's --cpu-offload runs at ZeRO 3
            rows.append((3, "data_parallel"))
        for stage, part in rows:
            partitions = stage > 0 and (dp > 1 or part == "all")
            if offload != "only" and (partitions or stage == 0):
                yield sp, stage, part, False
            if offload != "no" and stage == 3:
                yield sp, stage, part, True


def host_limit(hw: Any, ns: argparse.Namespace) -> int | None:
    """Host bytes of one node (``--host-memory``, default 2 TB = 2,048 GB); ``None`` on a CPU "device" (the host)."""
    from ulysses_sp.plan.hardware import parse_bytes
    from ulysses_sp.rehearse.run import DEFAULT_HOST_MEMORY

    if hw.name == "cpu":
        return None
    return DEFAULT_HOST_MEMORY if ns.host_memory is None else parse_bytes(ns.host_memory, what="--host-memory")


def host_fits(host_bytes_per_rank: int, world: int, hw: Any, ns: argparse.Namespace) -> bool:
    """Whether one node's ranks' host bytes fit ``--host-memory`` (a CPU "device" is the host)."""
    limit = host_limit(hw, ns)
    return limit is None or host_bytes_per_rank * min(world, hw.gpus_per_node) <= limit


def _ladder(judge: Any, ns: argparse.Namespace) -> list[dict[str, bool]]:
    """``TECHNIQUES`` without the techniques train refuses for this model (``PlanJudge.admitted``)."""
    names = list(dict.fromkeys(k for rung in TECHNIQUES for k in rung))
    base = {"model": ns.model, "sp": 1, "seq_len": 2, "zero_stage": 0, "micro_batch_size": ns.micro_batch_size}
    kept = judge.admitted(names, base)
    rungs = [{k: v for k, v in rung.items() if k in kept} for rung in TECHNIQUES]
    return [dict(r) for r in dict.fromkeys(tuple(r.items()) for r in rungs)]


def _evaluate(ns: argparse.Namespace, shape: Any, hw: Any, offload: str, judge: Any) -> list[dict[str, Any]]:
    """One candidate per layout x technique: its prediction at ``--seq-len`` or, without it, at
    its longest sequence capped at the model's positions limit. Settings ``train`` refuses before
    launch (``judge``: ``plan_judge.PlanJudge``) are left out, the reason noted."""
    from ulysses_sp.parallel.mesh_shape import resolve_ring_size
    from ulysses_sp.plan.head_groups import with_head_groups
    from ulysses_sp.plan.inputs import Settings
    from ulysses_sp.plan.model import max_seq_len, predict

    world = ns.gpus * ns.nodes
    sps = [p for p in range(1, world + 1) if world % p == 0]  # beyond the heads: a ring (auto size)
    out = []
    for sp, stage, part, states_on_host in _layouts(sps, world, offload):
        attention = any(k.attention for k in shape.kinds())  # none (Mamba-2 alone): no ring to choose
        ring = resolve_ring_size(sp, shape.heads, shape.kv_heads) if attention else 1
        if not mixers_shard(shape, sp, ring):
            continue
        for tech in _ladder(judge, ns):
            multiple = sp * (2 if ring > 1 else 1)
            if ns.seq_len is not None and ns.seq_len % multiple:
                continue
            base = Settings(seq_len=ns.seq_len or multiple, micro_batch_size=ns.micro_batch_size, dp=world // sp,
                         sp=sp, ring_size=ring, zero_stage=stage, partition=part, dtype=ns.dtype,
                         offload_states=states_on_host, device_type="cpu" if hw.name == "cpu" else "cuda", **tech)  # fmt: skip
            fit = lambda s: max_seq_len(shape, s, hw, host_budget=host_limit(hw, ns),  # noqa: E731
                                        ranks_per_node=min(world, hw.gpus_per_node))  # fmt: skip
            for s, longest in with_head_groups(shape, base, fit, ns.seq_len):  # and its head-group setting
                if ns.seq_len is None:
                    seq_len = max(longest - longest % multiple, multiple)
                    if shape.max_positions is not None:  # train refuses more: cap, "capped" says so
                        seq_len = min(seq_len, max(shape.max_positions - shape.max_positions % multiple, multiple))
                    s = replace(s, seq_len=seq_len)
                flags, args = train_args(ns.model, s, ns.nodes, judge.attn)
                why = judge.refusal(flags)
                if why is not None:
                    judge.withhold(label({"settings": flags}), why)
                    continue
                pred = predict(shape, s, hw)
                out.append({
                    "settings": flags, "train_args": args, "peak_bytes_per_rank": pred.peak_bytes,
                    "breakdown": pred.breakdown, "host_bytes_per_rank": pred.host_bytes,
                    "fits": pred.peak_bytes <= hw.memory_bytes and host_fits(pred.host_bytes, world, hw, ns),
                    "max_seq_len": longest,
                    "tokens_per_s": pred.tokens_per_s, "comm_share": pred.comm_share,
                })  # fmt: skip
    return out


def candidates(ns: argparse.Namespace) -> dict[str, Any]:
    """The ``--json`` document: every candidate, the recommended one, and notes on how it was chosen."""
    from ulysses_sp.checks import positive_int
    from ulysses_sp.plan.inputs import SHAPES

    ns = with_defaults(ns)
    for flag in ("gpus", "nodes", "micro_batch_size"):
        positive_int(f"--{flag.replace('_', '-')}", getattr(ns, flag))
    if ns.seq_len is not None:
        positive_int("--seq-len", ns.seq_len)
    from ulysses_sp.cli.plan_judge import PlanJudge
    from ulysses_sp.plan.inputs import routed_experts_note

    hw = hardware(ns)
    judge = PlanJudge(ns.model)
    shape = load_shape(ns.model, judge.config)
    limit = shape.max_positions
    if ns.seq_len is not None and limit is not None and ns.seq_len > limit:
        raise ValueError(
            f"--seq-len {ns.seq_len} is longer than model {ns.model!r} covers (max_position_embeddings "
            f"{limit}, RoPE scaling included): `train` refuses it. Plan at --seq-len <= {limit}, or for a model "
            "whose config.json extends its context (rope_scaling)"
        )
    offload = "also" if ns.offload_states else "no"
    out, notes = _evaluate(ns, shape, hw, offload, judge), layer_notes(shape) + routed_experts_note(judge.config)
    if not ns.offload_states and out and not any(c["fits"] for c in out):
        out += _evaluate(ns, shape, hw, "only", judge)
        offload = "auto"
        notes.append("nothing fits on the devices alone: model states on the host considered too "
                     "(--offload-states; train's --zero-stage 3 --cpu-offload)")  # fmt: skip
    # best first: the settings that fit, the fastest (--max: the longest sequence train accepts, capped,
    # then the fastest at it); the recommendation is the first row
    key = (lambda c: (c["fits"], c["settings"]["seq_len"], c["tokens_per_s"])) if ns.seq_len is None else (
        lambda c: (c["fits"], c["tokens_per_s"]))  # fmt: skip
    out.sort(key=key, reverse=True)
    best = out[0] if out and out[0]["fits"] else None
    if best is not None and ns.seq_len is None and limit is not None and best["max_seq_len"] > limit:
        notes.append(f"S capped at {best['settings']['seq_len']:,}: the model's positions end at {limit:,} "
                     f"(max_position_embeddings, RoPE scaling included) and train refuses a longer --seq-len; "
                     f"memory allows {best['max_seq_len']:,}")  # fmt: skip
    notes += judge.summary()
    if best is not None and ns.model in SHAPES:
        notes.append(f"--model {ns.model} is a named shape: give train your local model directory as --model")
    command = complete_command(best, ns.model, notes)
    return {
        "model": ns.model, "gpus": ns.gpus, "nodes": ns.nodes, "device": hw.name,
        "memory_bytes_per_rank": hw.memory_bytes, "dtype": ns.dtype, "seq_len": ns.seq_len,
        "max_positions": limit, "offload_states": offload, "recommended": best, "command": command, "candidates": out,
        "notes": notes, "layers": [
            {"attention": k.attention, "mlp": k.mlp, "mixer": k.mixer.kind if k.mixer else None}
            for k in shape.layer_kinds
        ],
    }  # fmt: skip


def run_plan(ns: argparse.Namespace) -> str:
    """The command's output (JSON or table)."""
    ns = with_defaults(ns)
    doc = candidates(ns)
    if not ns.rehearse:
        return json.dumps(doc, indent=1) if ns.json else render(doc, rows=None if ns.all else TOP_ROWS)
    from ulysses_sp.cli.plan_rehearse import rehearse_plan, render_rehearsal

    out = rehearse_plan(ns, doc, load_shape(ns.model), hardware(ns))
    if ns.json:
        return json.dumps({**doc, "rehearsal": {k: v for k, v in out.items() if k != "report"}}, indent=1, default=str)
    return render(doc, rows=None if ns.all else TOP_ROWS) + "\n" + render_rehearsal(out)
