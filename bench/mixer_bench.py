"""Sequence mixers under Ulysses SP: exchanges and bytes per mixer layer, step time, memory growth.

``python -m bench.mixer_bench [--smoke] [--sp 1 2 4]``: gloo ranks on CPU, one world per sp size, one thread each.

* **Bytes**: one forward + backward of a single mixer module (LFM2's short conv; a Nemotron-H Mamba-2 mixer
  with ``G < P`` and ``G >= P``; Mamba's Mamba-1 mixer), sharded by ``mixers.apply.apply_mixers``; every
  ``all_to_all_single`` counted (``bench.counters``: bytes this rank sends to others) against the analytic
  minimum of the head-sharded design, forward + backward: short conv ``4 B S_l Hd (P-1)/P b``; Mamba-2 ``2 B
  S_l (P-1) b [I/P + H/P + 2 G_l N] + 2 B S_l I (P-1)/P b`` (in: x, dt and the B/C groups each destination
  needs; out: y); Mamba-1 ``2 B S_l (P-1) b [3 I/P + 2 N] + 2 B S_l I (P-1)/P b`` (in: x, dt, z by channel,
  B and C to every rank; out: y) plus its conv halo, ``B (K-1) I b`` to the next rank forward and back.
* **Step time**: forward + backward of a whole model on one sequence of ``S`` tokens (the same global batch at
  every sp): a Nemotron-H hybrid (mamba, attention, mamba, mlp), a Qwen3-Next hybrid (two gated delta-net
  layers, one attention) and a dense Llama of the same width; fastest of 5 steps after a warm-up; max over
  ranks.
* **Memory**: peak tensor bytes per rank (``memory.meter.track_peak_memory``, CPU storage tracking, parameters
  included, max over ranks) of the Nemotron-H hybrid and of a Qwen3-Next made only of gated delta-net layers,
  at two lengths; the growth between them should fall as 1/sp (the scan runs over the full sequence for
  ``H/P`` of the heads, the projections and the halo convolution on ``S/P`` tokens).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import transformers as tf

from bench import md
from bench.counters import CollectiveCounter, timed
from bench.launch import max_over_ranks, parser, run_worker, serve
from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
from ulysses_sp.memory.meter import track_peak_memory
from ulysses_sp.mixers.apply import apply_mixers
from ulysses_sp.parallel.mesh import init_mesh

WIDTH = {"hidden": 64, "heads": 4, "mamba_heads": 8, "head_dim": 8, "state": 16, "groups": 2}


def hybrid(kind: str, groups: int = WIDTH["groups"]):
    """A small fp32 seeded model of ``kind``: ``lfm2``, ``nemotron_h``, ``mamba`` (Mamba-1), ``llama``,
    ``gated_deltanet`` (a Qwen3-Next of two gated delta-net layers) or ``qwen3_next`` (the same plus one
    attention layer)."""
    torch.manual_seed(0)
    h = WIDTH["hidden"]
    common = dict(vocab_size=256, hidden_size=h, intermediate_size=2 * h, num_attention_heads=WIDTH["heads"],
                  num_key_value_heads=WIDTH["heads"], max_position_embeddings=1 << 16)  # fmt: skip
    if kind == "lfm2":
        cfg = tf.Lfm2Config(num_hidden_layers=2, layer_types=["conv", "full_attention"], conv_L_cache=3, **common)
    elif kind == "nemotron_h":
        cfg = tf.NemotronHConfig(mamba_num_heads=WIDTH["mamba_heads"], mamba_head_dim=WIDTH["head_dim"],
                                 ssm_state_size=WIDTH["state"], n_groups=groups, chunk_size=64, conv_kernel=4,
                                 layers_block_type=["mamba", "attention", "mamba", "mlp"], **common)  # fmt: skip
    elif kind in ("gated_deltanet", "qwen3_next"):
        types = ["linear_attention"] * 2 + ["full_attention"] * (kind == "qwen3_next")
        cfg = tf.Qwen3NextConfig(**{**common, "num_key_value_heads": 2}, num_hidden_layers=len(types),
                                 layer_types=types, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                                 linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                                 num_experts=0, tie_word_embeddings=False)  # fmt: skip
    elif kind == "mamba":
        cfg = tf.MambaConfig(vocab_size=256, hidden_size=h, expand=2, state_size=WIDTH["state"], conv_kernel=4,
                             num_hidden_layers=1)  # fmt: skip
        return tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()
    else:
        cfg = tf.LlamaConfig(num_hidden_layers=4, **common)
    return tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()


def analytic_bytes(kind: str, mixer, b: int, s_local: int, p: int, itemsize: int = 4) -> int:
    """The head-sharded minimum, forward + backward, bytes this rank sends (module docstring)."""
    if kind == "short_conv":
        return 4 * b * s_local * mixer.conv.in_channels * (p - 1) // p * itemsize
    if kind == "mamba1":  # on a middle rank the halo goes out twice: forward to r+1, its gradient back to r-1
        i, n, k, r = mixer.intermediate_size, mixer.ssm_state_size, mixer.conv_kernel_size, dist.get_rank()
        halo = ((r < p - 1) + (r > 0)) * b * (k - 1) * i * itemsize
        return 2 * b * s_local * (p - 1) * itemsize * (3 * i // p + 2 * n + i // p) + halo
    i, h, g, n = mixer.intermediate_size, mixer.num_heads, mixer.n_groups, mixer.ssm_state_size
    return 2 * b * s_local * (p - 1) * itemsize * (i // p + h // p + 2 * max(g // p, 1) * n + i // p)


def mixer_bytes(mesh, s: int) -> list[dict]:
    """Bytes each mixer layer's all-to-alls send at ``S = s`` on this rank, against ``analytic_bytes``."""
    rows, p, b = [], mesh.sp_size, 1
    for kind, model, path in (
        ("short_conv", hybrid("lfm2"), "model.layers.0.conv"),
        ("mamba2 G=2", hybrid("nemotron_h", groups=2), "model.layers.0.mixer"),
        ("mamba2 G=8", hybrid("nemotron_h", groups=8), "model.layers.0.mixer"),
        ("mamba1", hybrid("mamba"), "backbone.layers.0.mixer"),
    ):
        mixer = model.get_submodule(path)
        handle = apply_mixers(mixer, mesh)  # the mixer alone: no position ids, one document
        x = torch.randn(b, s // p, WIDTH["hidden"], requires_grad=True)
        with CollectiveCounter() as counter:
            mixer(x).square().sum().backward()
        handle.remove()
        rows.append({"mixer": kind, "sp": p, "a2a_calls": counter.ncalls("other", "all_to_all_single"),
                     "bytes": counter.total("other", "all_to_all_single"),
                     "analytic": analytic_bytes(kind.split()[0], mixer, b, s // p, p)})  # fmt: skip
    return rows


def step(mesh, kind: str, s: int, repeats: int, memory: bool) -> dict:
    """The fastest of ``repeats`` steps of model ``kind`` at ``S = s`` (and its peak when ``memory``)."""
    model, p = hybrid(kind), mesh.sp_size
    # at sp 1 too: the causal path without an S x S mask, as at sp > 1
    reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", p, 1, mesh=mesh)
    handle = apply_mixers(model, mesh)
    cols = slice(mesh.sp_rank * s // p, (mesh.sp_rank + 1) * s // p)
    ids = torch.randint(0, 256, (1, s), generator=torch.Generator().manual_seed(1))[:, cols]
    pos = torch.arange(s)[None, cols]

    def run() -> None:
        model(input_ids=ids, position_ids=pos, use_cache=False).logits.float().square().mean().backward()
        model.zero_grad(set_to_none=True)

    run()  # warm-up
    best = min((timed(run) for _ in range(repeats)), default=float("inf"))
    out = {"model": kind, "sp": p, "S": s, "step_s": max_over_ranks(best)}
    if memory:
        with track_peak_memory("cpu", include=list(model.parameters())) as peak:
            run()
        out["peak_mib"] = max_over_ranks(peak.peak_bytes) / 2**20
    handle.remove()
    reg.remove()
    return out


def worker(smoke: bool) -> dict:
    mesh = init_mesh((1, dist.get_world_size()))
    s_time, s_mem = (256, (512, 1024)) if smoke else (2048, (8192, 16384))
    return {"bytes": mixer_bytes(mesh, 256) if mesh.sp_size > 1 else [],
            "time": [step(mesh, k, s_time, 1 if smoke else 5, memory=False) for k in ("nemotron_h", "qwen3_next", "llama")],
            "memory": [step(mesh, k, s, 0, memory=True) for k in ("nemotron_h", "gated_deltanet") for s in s_mem]}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "mixer_bench.md")
    ap.add_argument("--smoke", action="store_true", help="short sequences (seconds)")
    ap.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args(argv)
    if serve(lambda: worker(args.smoke), args.out, 3600):
        return
    run = md.provenance(md.command("bench.mixer_bench", argv))
    res = {p: run_worker("bench.mixer_bench", p, ["--smoke"] * args.smoke, timeout=3600)[0] for p in args.sp}
    first = next(iter(res.values()))
    mem = {(m["model"], m["S"]): i for i, m in enumerate(first["memory"])}
    seqs = sorted({s for _, s in mem})
    md.page(args.out, "Sequence mixers under Ulysses SP: bytes, step time, memory", run, [
        "Gloo on CPU, one thread per rank (on a shared 2-core machine times are noisy, and sp 4 runs 4 ranks on "
        "2 cores).", "## Mixer exchanges per layer (forward + backward, bytes this rank sends)",
        md.table(["mixer", "sp", "all-to-alls", "bytes", "analytic minimum"],
                 [[r["mixer"], r["sp"], r["a2a_calls"], r["bytes"], r["analytic"]] for x in res.values()
                  for r in x["bytes"]]),
        "## Step time (forward + backward, one sequence, same global batch)",
        md.table(["model", "S", *(f"sp {p}" for p in res)], [[row["model"], row["S"], *(
            f"{x['time'][i]['step_s']:.3f} s" for x in res.values())] for i, row in enumerate(first["time"])]),
        "## Memory per rank (peak tensor MiB, parameters included)",
        md.table(["model", "sp", *(f"S {s}" for s in seqs), "growth"], [[k, p, *(
            f"{x['memory'][mem[k, s]]['peak_mib']:.1f}" for s in seqs),
            f"{x['memory'][mem[k, seqs[-1]]]['peak_mib'] - x['memory'][mem[k, seqs[0]]]['peak_mib']:.1f}"]
            for k in ("nemotron_h", "gated_deltanet") for p, x in res.items()])])  # fmt: skip


if __name__ == "__main__":
    main()
