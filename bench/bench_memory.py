"""Peak memory per rank vs sequence length for the ALST techniques, and their time cost.

One tiny-but-wide Llama (large vocabulary so the logits matter, a wide MLP), one forward+backward
per measurement (no optimizer state), CPU + gloo, one thread per rank. Configurations, each
adding one technique to the previous one:

    baseline            sp=1, nothing else
    +sp2                Ulysses SP over 2 ranks (per-rank numbers)
    +tiled_loss         lm_head + cross-entropy over tiles
    +tiled_mlp          MLP blocks over tiles
    +checkpointing      HF activation checkpointing of every decoder layer
    +offload            checkpointed layer inputs to host memory (device-side count)

Memory is measured with ``ulysses_sp.memory.track_peak_memory`` (CPU: deterministic peak of live
tensor storage, parameters included); it is the highest of the ranks. For each configuration
the sequence length grows (powers of two and the 1.5x points between) until the peak exceeds the
per-rank budget; the longest length that fit is reported. Time: one step at a common length,
without the tracker, the configurations interleaved round after round on the same two ranks (the
baseline runs the whole sequence on each), best round, as a ratio to the baseline.

Run (a few minutes on 2 cores)::

    python bench/bench_memory.py                 # writes bench/results/bench_memory.{json,md}
    python bench/bench_memory.py --smoke         # seconds: tiny sizes, for CI
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MIB = 2**20
_KEEP_ALIVE: list[torch.Tensor] = []
CONFIGS = ["baseline", "+sp2", "+tiled_loss", "+tiled_mlp", "+checkpointing", "+offload"]


@dataclass(frozen=True)
class Setup:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    vocab: int
    budget_mib: float
    seqs: tuple[int, ...]
    time_seq: int
    time_steps: int
    loss_shards: int | None
    mlp_shards: int | None


FULL = Setup(
    hidden=64, intermediate=512, layers=4, heads=4, vocab=16384, budget_mib=64.0,
    seqs=(128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384),
    time_seq=1024, time_steps=5, loss_shards=None, mlp_shards=None,
)  # fmt: skip
SMOKE = Setup(
    hidden=32, intermediate=128, layers=2, heads=4, vocab=1024, budget_mib=2.0,
    seqs=(32, 64, 128, 256, 512), time_seq=64, time_steps=1, loss_shards=None, mlp_shards=None,
)  # fmt: skip


def _techniques(config: str) -> set[str]:
    return set(CONFIGS[1 : CONFIGS.index(config) + 1])


# ---------------------------------------------------------------- one rank


def _build(setup: Setup, config: str, reg):
    """A fresh model with ``config``'s techniques (SP through the one registration ``reg``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ulysses_sp.attention import ATTN_NAME
    from ulysses_sp.offload import enable_activation_checkpointing, enable_activation_offload
    from ulysses_sp.tiling import TiledCausalLMLoss, apply_tiled_mlp

    cfg = LlamaConfig(
        hidden_size=setup.hidden, intermediate_size=setup.intermediate, num_hidden_layers=setup.layers,
        num_attention_heads=setup.heads, num_key_value_heads=setup.heads, vocab_size=setup.vocab,
        max_position_embeddings=max(setup.seqs), tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).train()
    tech = _techniques(config)
    group = None
    if "+sp2" in tech:  # one registration shared by the SP models, each with its own guardrail
        model.set_attn_implementation(ATTN_NAME)
        reg.attach(model)
        group = reg.get_sequence_parallel_group()
    if "+checkpointing" in tech:
        enable_activation_checkpointing(model)
    if "+offload" in tech:
        enable_activation_offload(model)
    if "+tiled_mlp" in tech:
        apply_tiled_mlp(model, setup.mlp_shards)
    loss_fn = TiledCausalLMLoss(num_shards=setup.loss_shards) if "+tiled_loss" in tech else None
    return model, group, loss_fn


def _step(model, group, loss_fn, seq: int, vocab: int) -> None:
    from ulysses_sp.loss import sp_causal_lm_loss

    sp = dist.get_world_size(group) if group is not None else 1
    k = dist.get_rank(group) if group is not None else 0
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, vocab, (1, seq), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    s_l = seq // sp
    cols = slice(k * s_l, (k + 1) * s_l)  # this rank's shard: [1, S] -> [1, S/sp]
    positions = torch.arange(seq)[cols].unsqueeze(0)
    # Kept alive for the whole run: attention.py caches the gathered positions by id(position_ids),
    # and an id recycled on one rank only makes that rank skip a collective (a hang; reported).
    _KEEP_ALIVE.append(positions)
    batch = {"input_ids": ids[:, cols], "position_ids": positions, "use_cache": False}
    if loss_fn is None:
        loss = sp_causal_lm_loss(model(**batch).logits, labels[:, cols], group)
    else:
        loss = loss_fn(model, batch, labels[:, cols], group).loss
    loss.backward()
    model.zero_grad(set_to_none=True)


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _memory_sweep(setup: Setup, model, group, loss_fn) -> list[dict]:
    from ulysses_sp.memory import track_peak_memory

    rows = []
    for seq in setup.seqs:
        with track_peak_memory("cpu", include=model.parameters()) as mem:
            _step(model, group, loss_fn, seq, setup.vocab)
        peak = _max_over_ranks(mem.peak_bytes)
        host = _max_over_ranks(mem.host_peak_bytes)
        rows.append({"seq": seq, "peak_bytes": int(peak), "host_peak_bytes": int(host)})
        if peak > setup.budget_mib * MIB:
            break
    return rows


def _worker(rank: int, world: int, store: str, setup: Setup, out_path: str) -> None:
    """Every configuration on the same 2 ranks; the baseline (no SP) runs the whole sequence on each."""
    from ulysses_sp.attention import UlyssesSPAttentionHF
    from ulysses_sp.mesh import init_mesh

    torch.set_num_threads(1)
    # A file store in a private directory: no port to race other programs for.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        # One registration (a throwaway model of the same shape fills its own slot); every SP
        # model attaches to it, since transformers resolves "ulysses_sp" to one function.
        reg = UlyssesSPAttentionHF.register_with_transformers(
            _build(setup, "baseline", None)[0], "sdpa", world, 1, mesh=init_mesh((1, world))
        )
        built = {c: _build(setup, c, reg) for c in CONFIGS}
        results = {}
        for config, (model, group, loss_fn) in built.items():
            t0 = time.perf_counter()
            results[config] = {"rows": _memory_sweep(setup, model, group, loss_fn)}
            if rank == 0:
                fit = _fits(results[config]["rows"], setup.budget_mib * MIB)
                print(f"{config:16s} longest S in budget {fit} ({time.perf_counter() - t0:.0f}s)", flush=True)
        # Time: the configurations interleaved, round after round, so that a shared machine's load
        # hits them alike; the best round of each.
        times: dict[str, list[float]] = {c: [] for c in CONFIGS}
        for round_ in range(setup.time_steps + 1):
            for config, (model, group, loss_fn) in built.items():
                dist.barrier()
                t0 = time.perf_counter()
                _step(model, group, loss_fn, setup.time_seq, setup.vocab)
                if round_:  # round 0 warms up
                    times[config].append(_max_over_ranks(time.perf_counter() - t0))
        for config in CONFIGS:
            results[config]["step_seconds"] = min(times[config])
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f)
    finally:
        from ulysses_sp.mesh import shutdown

        shutdown()


def _run(setup: Setup) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        store = os.path.join(tmp, "store")
        mp.spawn(_worker, args=(2, store, setup, out), nprocs=2, join=True)
        with open(out) as f:
            return json.load(f)


# ---------------------------------------------------------------- report


def _fits(rows: list[dict], budget: float) -> int | None:
    ok = [r["seq"] for r in rows if r["peak_bytes"] <= budget]
    return max(ok) if ok else None


def _slope_and_projection(rows: list[dict], budget: float) -> tuple[float | None, int | None]:
    """Bytes per extra token between the last two measured lengths, and where that line meets the
    budget (peak memory is affine in S at these lengths: the rows show it)."""
    if len(rows) < 2:
        return None, None
    (s1, p1), (s2, p2) = ((r["seq"], r["peak_bytes"]) for r in rows[-2:])
    slope = (p2 - p1) / (s2 - s1)
    if slope <= 0:
        return slope, None
    return slope, int(s1 + (budget - p1) / slope)


def _markdown(result: dict) -> str:
    setup, budget = result["setup"], result["setup"]["budget_mib"] * MIB
    shown = [s for s in setup["seqs"] if s & (s - 1) == 0]  # the powers of two of the sweep
    lines = [
        f"Peak memory per rank in MiB (parameters, activations, gradients; no optimizer state) of one "
        f"forward+backward; Llama h={setup['hidden']}, I={setup['intermediate']}, L={setup['layers']}, "
        f"V={setup['vocab']}, fp32, CPU/gloo. Budget **{setup['budget_mib']:g} MiB per rank**; each row adds "
        f"one technique to the row above.",
        "",
        "| config | " + " | ".join(f"S={s}" for s in shown)
        + " | longest S in budget | KiB per token | budget reached at S≈ | time vs baseline | vs row above |",
        "|---|" + "---:|" * (len(shown) + 5),
    ]  # fmt: skip
    for i, name in enumerate(CONFIGS):
        r = result["configs"][name]
        above = result["configs"][CONFIGS[max(i - 1, 0)]]["step_seconds"]
        by_seq = {row["seq"]: row for row in r["rows"]}
        cells = []
        for s in shown:
            row = by_seq.get(s)
            mib = row["peak_bytes"] / MIB if row else None
            cells.append(
                "—" if row is None else f"{mib:.1f}" if row["peak_bytes"] <= budget else f"*{mib:.1f}*"
            )
        fit = r["longest_seq_in_budget"]
        fit_txt = (
            "none" if fit is None else f"≥ {fit} (largest tried)" if fit == setup["seqs"][-1] else str(fit)
        )
        slope, proj = r["slope_bytes_per_token"], r["projected_seq_at_budget"]
        lines.append(
            f"| {name} | " + " | ".join(cells) + f" | {fit_txt} | {slope / 1024:.2f} | "
            f"{proj if fit == setup['seqs'][-1] else '(measured)'} | {r['time_ratio']:.2f}x | "
            f"{r['step_seconds'] / above:.2f}x |"
        )  # fmt: skip
    off = result["configs"]["+offload"]["rows"]
    lines += [
        "",
        "*italic*: over budget; `—`: not run (a shorter length already exceeded the budget). Lengths "
        f"measured (the table shows the powers of two): {', '.join(map(str, setup['seqs']))}. "
        "KiB per token: the peak's growth between the last two lengths measured; where a configuration "
        "never reached the budget, *budget reached at* extends that (affine) growth, a projection, not a "
        "measurement.",
        "",
        f"`+offload` counts device-side memory; the offloaded layer inputs (host side) peaked at "
        f"{max((r['host_peak_bytes'] for r in off), default=0) / MIB:.1f} MiB. Time: one step at "
        f"S={setup['time_seq']} (best of {setup['time_steps']}), the slowest rank, relative to the "
        f"baseline's {result['configs']['baseline']['step_seconds']:.3f} s; the configurations are timed "
        "interleaved, round after round, on the same two single-thread ranks (the baseline runs the whole "
        "sequence on each), so `+sp2` includes the 2x compute split and the all-to-alls. On CPU, offload is a copy to a second CPU buffer: its time here says nothing about a GPU.",
        "",
        f"Command: `{result['command']}` (torch {result['env']['torch']}, {result['env']['cpus']} CPUs).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds (CI)")
    parser.add_argument("--budget-mib", type=float, help="per-rank memory budget")
    parser.add_argument(
        "--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    )
    args = parser.parse_args(argv)
    setup = SMOKE if args.smoke else FULL
    if args.budget_mib is not None:
        setup = Setup(**{**asdict(setup), "budget_mib": args.budget_mib})
    command = "python bench/bench_memory.py" + (" " + shlex.join(argv if argv is not None else sys.argv[1:]))
    result = {"command": command.strip(), "setup": asdict(setup), "configs": {}, "env": {
        "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count()}}  # fmt: skip
    result["configs"].update(_run(setup))
    for r in result["configs"].values():
        r["longest_seq_in_budget"] = _fits(r["rows"], setup.budget_mib * MIB)
        r["slope_bytes_per_token"], r["projected_seq_at_budget"] = _slope_and_projection(
            r["rows"], setup.budget_mib * MIB
        )
    base = result["configs"]["baseline"]["step_seconds"]
    for r in result["configs"].values():
        r["time_ratio"] = r["step_seconds"] / base if base > 0 else math.nan
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, "bench_memory" + ("_smoke" if args.smoke else ""))
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(_markdown(result))
    print(_markdown(result))
    return result


if __name__ == "__main__":
    main()
