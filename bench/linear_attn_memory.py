"""Linear-attention layers under Ulysses: peak memory growth S 8K -> 16K per rank at sp 1, 2, 4, and
step time of a hybrid vs a dense model at sp 1 and 2 on the same global batch.

    for n in 1 2 4; do python -m torch.distributed.run --nproc-per-node $n -m bench.linear_attn_memory; done

(the lines each run prints are collected in ``bench/results/linear_attn_memory.md``).

Memory: a tiny Qwen3-Next made only of gated delta-net layers (2 layers, hidden 64, 2 key / 4 value
heads of 16, conv kernel 4), ``apply_mixers`` over all ranks, one forward + backward of one sequence
per length, peak tensor memory by ``ulysses_sp.memory.meter.track_peak_memory`` (CPU storage
tracking, parameters included, max over ranks). The *growth* from 8K to 16K is what the layers
add per 8K tokens; it should fall as 1/sp (the scan runs over the full sequence for ``H/P`` of the
heads, ``[B, S, H/P, D]``; the projections and the halo convolution on the ``S/P`` local tokens).

Time: the same gated delta-net model with one softmax-attention layer added (a hybrid) and a
Llama of the same width and depth, one step (forward + backward) at S = 4096, best of 3 after a
warm-up, max over ranks. Rank 0 writes a markdown table headed by the run.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time

import torch
import torch.distributed as dist

SEQS = (8192, 16384)
TIME_SEQ = 4096


def build(kind: str):
    import transformers as T

    common = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=max(SEQS), tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    if kind == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(**common, intermediate_size=128, num_hidden_layers=3)).train()
    types = ["linear_attention"] * 2 + (["full_attention"] if kind == "hybrid" else [])
    cfg = T.Qwen3NextConfig(**common, intermediate_size=128, num_hidden_layers=len(types), layer_types=types,
                            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                            linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=0)  # fmt: skip
    return T.Qwen3NextForCausalLM(cfg).train()


def shard(model):
    from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
    from ulysses_sp.mixers.apply import apply_mixers
    from ulysses_sp.parallel.mesh import init_mesh

    mesh = init_mesh((1, dist.get_world_size()))
    reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", mesh.sp_size, 1, mesh=mesh)
    return mesh, reg, apply_mixers(model, mesh)


def step(model, mesh, seq: int) -> None:
    from ulysses_sp.parallel.loss import sp_causal_lm_loss

    ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(seq))
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)
    s_l = seq // mesh.sp_size
    cols = slice(mesh.sp_rank * s_l, (mesh.sp_rank + 1) * s_l)
    out = model(input_ids=ids[:, cols], position_ids=torch.arange(seq)[None, cols], use_cache=False)
    sp_causal_lm_loss(out.logits, labels[:, cols], mesh.sp_group).backward()
    model.zero_grad(set_to_none=True)


def _max(x: float) -> float:
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def memory() -> list[tuple[int, float]]:
    from ulysses_sp.memory.meter import track_peak_memory

    model = build("linear")
    mesh, reg, handle = shard(model)
    rows = []
    for seq in SEQS:
        with track_peak_memory("cpu", include=model.parameters()) as mem:
            step(model, mesh, seq)
        rows.append((seq, _max(mem.peak_bytes)))
    handle.remove()
    reg.remove()
    return rows


def timing(kind: str) -> float:
    model = build(kind)
    mesh, reg, handle = shard(model)
    step(model, mesh, TIME_SEQ)  # warm-up
    best = float("inf")
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        step(model, mesh, TIME_SEQ)
        best = min(best, _max(time.perf_counter() - t0))
    handle.remove()
    reg.remove()
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    sp = dist.get_world_size()
    rows = memory()
    times = {kind: timing(kind) for kind in ("hybrid", "llama")}
    if dist.get_rank() == 0:
        mib = 2**20
        growth = rows[1][1] - rows[0][1]
        lines = [f"<!-- {datetime.datetime.now():%Y-%m-%d %H:%M} {platform.node()} torch {torch.__version__} -->",
                 f"sp={sp}: peak per rank " + ", ".join(f"S={s}: {p / mib:.1f} MiB" for s, p in rows)
                 + f"; growth 8K->16K {growth / mib:.1f} MiB",
                 f"sp={sp}: step at S={TIME_SEQ}: hybrid {times['hybrid']:.3f} s, llama {times['llama']:.3f} s"]  # fmt: skip
        text = "\n".join(lines) + "\n"
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
