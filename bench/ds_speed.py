"""Speed side by side with DeepSpeed (issue 26): ``python -m bench.ds_speed [--rounds 3]`` -> results/deepspeed_speed.md.

Interleaved rounds of bench/steploop.py, both sides, sp 2, ZeRO 1, S 8192, causal and packed (``--data``); ratios
within a round. CPU s: process CPU seconds per step. Causal bound: DeepSpeed's step over the sdpa kernels' time.
"""

import itertools
import os
import time
from statistics import median as med

import torch

from bench import md
from bench.launch import DS_PYTHON, parser, run_worker
from bench.spec import ModelSpec


def attention_cpu_s(seq: int, sp: int, spec: ModelSpec) -> float:
    """Thread CPU seconds of one step's attention kernels on one rank (its ``H/sp`` heads, every layer)."""
    torch.set_num_threads(1)
    h, d = spec.num_attention_heads // sp, spec.hidden_size // spec.num_attention_heads
    q, k, v = (torch.randn(1, h, seq, d, requires_grad=True) for _ in range(3))
    times = []
    for _ in range(4):  # the first call allocates: the minimum is the kernel
        t0 = time.thread_time()
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        times.append(time.thread_time() - t0)
    return min(times) * spec.num_hidden_layers


def cells(ours: list[dict], ds: list[dict]) -> list[str]:
    tps, cpu = ([o[k] / d[k] for o, d in zip(*sides)] for k, sides in (("tokens_per_s_per_rank", (ours, ds)), ("cpu_s_per_step", (ds, ours))))
    side = lambda x: "{:.0f}, {:.3f}+{:.3f}, {:.3f}".format(*(med(r["tokens_per_s_per_rank"] for r in x), *(  # noqa: E731
        med(r["phase_s"][p] for r in x) for p in ("forward", "backward")), med(r["cpu_s_per_step"] for r in x)))
    return [f"{med(tps):.2f} ({min(tps):.2f}-{max(tps):.2f})", f"{med(cpu):.2f} ({min(cpu):.2f}-{max(cpu):.2f})",
            f"{side(ours)} / {side(ds)}", f"{ours[0]['losses'][0]:.4f} / {ds[0]['losses'][0]:.4f}",
            ours[0]["attention_path"], "met" if min(med(tps), med(cpu)) >= 1.2 else "**not met**"]  # fmt: skip


def main(argv=None) -> None:
    ap = parser(__doc__, "deepspeed_speed.md")
    for flag, default in (("--rounds", 3), ("--seq-len", 8192), ("--steps", 5)):
        ap.add_argument(flag, type=int, default=default)
    args = ap.parse_args(argv)
    run, res, data, load = md.provenance(md.command("bench.ds_speed", argv)), {}, ("causal", "packed"), os.getloadavg()[0]
    for r, d in itertools.product(range(args.rounds), data):
        for impl in ("ours", "deepspeed")[:: 1 - 2 * (r % 2)]:  # the order alternates between rounds
            flags = ["--impl", impl, "--data", d, "--seq-len", str(args.seq_len), "--steps", str(args.steps)]
            res.setdefault((d, impl), []).append(run_worker("bench.steploop", 2, flags, launches=run["launches"],
                                                            python=DS_PYTHON if impl == "deepspeed" else None)[0])  # fmt: skip
    attn, (ds_cpu, ours_cpu) = attention_cpu_s(args.seq_len, 2, ModelSpec()), (
        med(s["cpu_s_per_step"] for s in res[("causal", i)]) for i in ("deepspeed", "ours"))  # fmt: skip
    header = ["data", "tok/s ours / DS: median (range)", "CPU s/step DS / ours", "ours / DS: tok/s, fwd+bwd s, CPU s/step",
              "step-1 loss ours / DS", "ours' attention", "tok/s and CPU >= 1.2x"]  # fmt: skip
    bound = (f"Causal bound: the sdpa kernels ({ModelSpec().num_hidden_layers} layers) take {attn:.3f} CPU s of ours' "
             f"{ours_cpu:.3f} s step ({attn / ours_cpu:.0%}); with nothing else in its step ulysses-sp would reach "
             f"DeepSpeed's {ds_cpu:.3f} / {attn:.3f} = {ds_cpu / attn:.2f}x. Load average (1 min) {load:.1f} at the start, "
             f"{os.getloadavg()[0]:.1f} at the end: wall ratios move with it, CPU ratios hardly.")  # fmt: skip
    rows = [[d, *cells(res[(d, "ours")], res[(d, "deepspeed")])] for d in data]
    md.page(args.out, "Speed side by side with DeepSpeed (sp 2, ZeRO 1)", run, [md.table(header, rows), bound])


if __name__ == "__main__":
    main()
