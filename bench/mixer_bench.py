"""Sequence mixers under Ulysses SP: exchanges and bytes per mixer layer, step time, memory growth.

    python -m bench.mixer_bench [--smoke] [--out bench/results/mixer_bench.md]

Gloo ranks on CPU (``bench.launch.run_worker``: ``torch.distributed.run``, one world per sp size).

* **Bytes**: one forward + backward of a single mixer module (LFM2's short conv; a Nemotron-H
  Mamba-2 mixer with ``G < P`` and ``G >= P``), sharded by ``mixers.apply.apply_mixers``; every
  ``all_to_all_single`` counted (``bench.counters``: bytes this rank sends to others) against the
  analytic minimum of the head-sharded design, forward + backward: short conv
  ``4 B S_l Hd (P-1)/P b``; Mamba-2 ``2 B S_l (P-1) b [I/P + H/P + 2 G_l N] + 2 B S_l I (P-1)/P b``
  (in: x, dt and the B/C groups each destination needs; out: y).
* **Step time**: forward + backward of a whole model on one sequence of ``S`` tokens (the same
  global batch at every sp): a Nemotron-H hybrid (mamba, attention, mamba, mlp) beside a dense
  Llama of the same width and depth; fastest of 5 steps after a warm-up; max over ranks.
* **Memory**: the hybrid's peak tensor bytes per rank (``memory.meter.track_peak_memory``, CPU
  storage tracking, parameters included) at two lengths; the growth between them per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

WIDTH = {"hidden": 64, "heads": 4, "mamba_heads": 8, "head_dim": 8, "state": 16, "groups": 2}


def hybrid(kind: str, groups: int = WIDTH["groups"]):
    """A small model of ``kind`` (``lfm2``, ``nemotron_h``, ``llama``), fp32, seeded."""
    import transformers as tf

    torch.manual_seed(0)
    h = WIDTH["hidden"]
    common = dict(vocab_size=256, hidden_size=h, intermediate_size=2 * h, num_attention_heads=WIDTH["heads"],
                  num_key_value_heads=WIDTH["heads"], max_position_embeddings=1 << 16)  # fmt: skip
    if kind == "lfm2":
        cfg = tf.Lfm2Config(
            num_hidden_layers=2, layer_types=["conv", "full_attention"], conv_L_cache=3, **common
        )
    elif kind == "nemotron_h":
        cfg = tf.NemotronHConfig(mamba_num_heads=WIDTH["mamba_heads"], mamba_head_dim=WIDTH["head_dim"],
                                 ssm_state_size=WIDTH["state"], n_groups=groups, chunk_size=64, conv_kernel=4,
                                 layers_block_type=["mamba", "attention", "mamba", "mlp"], **common)  # fmt: skip
    else:
        cfg = tf.LlamaConfig(num_hidden_layers=4, **common)
    return tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()


def analytic_bytes(kind: str, mixer, b: int, s_local: int, p: int, itemsize: int = 4) -> int:
    """The head-sharded minimum, forward + backward, bytes this rank sends (module docstring)."""
    if kind == "short_conv":
        return 4 * b * s_local * mixer.conv.in_channels * (p - 1) // p * itemsize
    i, h, g, n = mixer.intermediate_size, mixer.num_heads, mixer.n_groups, mixer.ssm_state_size
    g_l = max(g // p, 1)
    return 2 * b * s_local * (p - 1) * itemsize * (i // p + h // p + 2 * g_l * n + i // p)


def mixer_bytes(mesh, s: int) -> list[dict]:
    from bench.counters import CollectiveCounter
    from ulysses_sp.mixers.apply import apply_mixers

    rows, p, b = [], mesh.sp_size, 1
    for kind, model, path in (
        ("short_conv", hybrid("lfm2"), "model.layers.0.conv"),
        ("mamba2 G=2", hybrid("nemotron_h", groups=2), "model.layers.0.mixer"),
        ("mamba2 G=8", hybrid("nemotron_h", groups=8), "model.layers.0.mixer"),
    ):
        mixer = model.get_submodule(path)
        handle = apply_mixers(mixer, mesh)  # the mixer alone: no position ids, one document
        x = torch.randn(b, s // p, WIDTH["hidden"], requires_grad=True)
        with CollectiveCounter() as counter:
            mixer(x).square().sum().backward()
        handle.remove()
        sent = counter.total("other", "all_to_all_single")
        want = analytic_bytes(kind.split()[0], mixer, b, s // p, p)
        rows.append({"mixer": kind, "sp": p, "a2a_calls": counter.ncalls("other", "all_to_all_single"),
                     "bytes": sent, "analytic": want})  # fmt: skip
    return rows


def step(mesh, kind: str, s: int, repeats: int, memory: bool) -> dict:
    from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
    from ulysses_sp.memory.meter import track_peak_memory
    from ulysses_sp.mixers.apply import apply_mixers

    model, p = hybrid(kind), mesh.sp_size
    # at sp 1 too: the causal path without an S x S mask, as at sp > 1
    reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", p, 1, mesh=mesh)
    handle = apply_mixers(model, mesh)
    cols = slice(mesh.sp_rank * s // p, (mesh.sp_rank + 1) * s // p)
    ids = torch.randint(0, 256, (1, s), generator=torch.Generator().manual_seed(1))[:, cols]
    pos = torch.arange(s)[None, cols]

    def run() -> None:
        model(input_ids=ids, position_ids=pos, use_cache=False).logits.float().square().mean().backward()

    run()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    out = {"model": kind, "sp": p, "S": s, "step_s": _max(best)}
    if memory:
        with track_peak_memory("cpu", include=list(model.parameters())) as peak:
            run()
        out["peak_mib"] = _max(peak.peak_bytes) / 2**20
    handle.remove()
    reg.remove()
    return out


def _max(x: float) -> float:
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def worker(out: str, smoke: bool) -> None:
    from ulysses_sp.parallel.mesh import init_mesh

    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # every rank alike: sp 1 and sp 2 compare at one thread per rank
    mesh = init_mesh((1, dist.get_world_size()))
    s_time, s_mem = (256, (512, 1024)) if smoke else (2048, (8192, 16384))
    res = {"bytes": mixer_bytes(mesh, 256) if mesh.sp_size > 1 else []}
    res["time"] = [step(mesh, k, s_time, 1 if smoke else 5, memory=False) for k in ("nemotron_h", "llama")]
    res["memory"] = [step(mesh, "nemotron_h", s, 0, memory=True) for s in s_mem]
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


def report(results: dict[int, dict]) -> str:
    lines = ["## Mixer exchanges per layer (forward + backward, bytes this rank sends)", "",
             "| mixer | sp | all-to-alls | bytes | analytic minimum |", "|---|---|---|---|---|"]  # fmt: skip
    for res in results.values():
        lines += [
            f"| {r['mixer']} | {r['sp']} | {r['a2a_calls']} | {r['bytes']} | {r['analytic']} |"
            for r in res["bytes"]
        ]
    lines += ["", "## Step time (forward + backward, one sequence, same global batch)", "",
              "| model | S | " + " | ".join(f"sp {p}" for p in results) + " |", "|---|---|" + "---|" * len(results)]  # fmt: skip
    for i, row in enumerate(next(iter(results.values()))["time"]):
        cells = " | ".join(f"{res['time'][i]['step_s']:.3f} s" for res in results.values())
        lines.append(f"| {row['model']} | {row['S']} | {cells} |")
    lines += ["", "## Hybrid memory per rank (peak tensor MiB, parameters included)", "",
              "| sp | " + " | ".join(f"S {m['S']}" for m in next(iter(results.values()))["memory"]) + " | growth |",
              "|---|---|---|---|"]  # fmt: skip
    for p, res in results.items():
        mem = [m["peak_mib"] for m in res["memory"]]
        lines.append(f"| {p} | " + " | ".join(f"{m:.1f}" for m in mem) + f" | {mem[-1] - mem[0]:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[argv.index("--out") + 1], "--smoke" in argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/mixer_bench.md")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args(argv)
    from bench.launch import run_worker

    results = {}
    for p in args.sp:
        results[p], cmd, wall = run_worker(
            "bench.mixer_bench", p, ["--worker"] + ["--smoke"] * args.smoke, timeout=3600
        )
        print(f"{cmd}: {wall:.0f} s", file=sys.stderr)
    text = report(results)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
