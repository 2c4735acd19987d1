"""Head-chunked attention and the per-document packed path, sp 2 on CPU (gloo): ``python -m bench.head_chunks``.

One attention layer's peak and kept memory (``memory.meter``) and the step time for head groups 1 / 2 / 4
(overlap on/off); packed documents (S/2, S/4, S/4): the blockwise core (before: ``attn_chunk`` as auto
picks) against one sdpa call per document (after). Writes ``bench/results/head_chunks.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

from bench import md
from bench.launch import finish_worker, init_worker, max_over_ranks, run_worker, under_torchrun
from bench.spec import llama, packed_positions
from ulysses_sp.attention.blockwise import resolve_chunk
from ulysses_sp.attention.positions import capture_call
from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
from ulysses_sp.memory.meter import track_peak_memory
from ulysses_sp.parallel.mesh import init_mesh

HEADS, KV_HEADS, HIDDEN = 8, 2, 128  # head dim 16; GQA 4:1 as Llama-3 8B; 4 head groups split over 2 ranks
CHUNKS = [(1, True), (2, False), (2, True), (4, False), (4, True)]


def _setup(seq: int, chunks: int, overlap: bool, attn_chunk: int | None = None):
    mesh = init_mesh((1, 2))
    model = llama(vocab_size=256, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=2 * seq)  # fmt: skip
    reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 1, mesh=mesh, head_chunks=chunks,
                                                          attn_chunk=attn_chunk)  # fmt: skip
    reg.attention.head_chunk_overlap = overlap
    return mesh, model, reg


def layer_peak(seq: int, chunks: int, overlap: bool) -> list[int]:
    mesh, model, reg = _setup(seq, chunks, overlap)
    pos = torch.arange(mesh.sp_rank * seq // 2, (mesh.sp_rank + 1) * seq // 2)[None]
    x = torch.randn(1, seq // 2, HIDDEN, requires_grad=True)
    cos_sin = model.model.rotary_emb(x, pos)
    attn = model.model.layers[0].self_attn
    reg.attention.call = capture_call(model, (), {"position_ids": pos})  # what the model's pre-hook records
    with track_peak_memory("cpu", include=[x]) as mem:
        out, _ = attn(x, position_embeddings=cos_sin, attention_mask=None, position_ids=pos)
        kept = mem.current_bytes  # what the layer keeps for its backward (+ x and its output)
        out.sum().backward()
    reg.remove()
    return [int(max_over_ranks(mem.peak_bytes)), int(max_over_ranks(kept))]


def step_time(seq: int, chunks: int, overlap: bool, packed: bool, attn_chunk: int | None, steps: int) -> float:
    mesh, model, reg = _setup(seq, chunks, overlap, attn_chunk)
    s_l, r = seq // 2, mesh.sp_rank
    pos = (packed_positions(seq) if packed else torch.arange(seq)[None])[:, r * s_l : (r + 1) * s_l]
    ids = torch.randint(0, 256, (1, s_l), generator=torch.Generator().manual_seed(r))
    times = []
    for _ in range(steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        model(input_ids=ids, position_ids=pos).logits.float().logsumexp(-1).sum().backward()
        times.append(time.perf_counter() - t0)
    reg.remove()
    return statistics.median(times[1:])


def worker(args) -> dict:
    out = {"peak": {}, "causal": {}, "packed": {}}
    for n, overlap in CHUNKS:
        out["peak"][f"{n} {overlap}"] = layer_peak(args.seq, n, overlap)
        out["causal"][f"{n} {overlap}"] = step_time(args.seq, n, overlap, False, None, args.steps)
    for seq in args.packed_seqs:
        auto = resolve_chunk(None, seq, HIDDEN // HEADS)  # blockwise (before), per-document sdpa (after)
        out["packed"][seq] = [step_time(seq, 1, True, True, chunk, args.steps) for chunk in (auto, None)]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=8192, help="S of the head-group rows")
    ap.add_argument("--packed-seqs", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=str(md.ROOT / "bench" / "results" / "head_chunks.md"))
    args = ap.parse_args(argv)
    if under_torchrun():
        return init_worker() or finish_worker(worker(args), args.out)
    run = md.provenance("python -m bench.head_chunks " + " ".join(argv or sys.argv[1:]))
    forward = ["--seq", str(args.seq), "--steps", str(args.steps), "--packed-seqs", *map(str, args.packed_seqs)]
    res, _, _ = run_worker("bench.head_chunks", 2, forward)
    mem, step = (lambda n, o, i=0: res["peak"][f"{n} {o}"][i]), (lambda n, o: res["causal"][f"{n} {o}"])  # noqa: E731
    rows = [[n if n > 1 else "1 (unchunked)", "-" if n == 1 else "on" if o else "off", f"{mem(n, o) / 2**20:.1f}",
             f"{mem(n, o) / mem(1, True):.2f}x", f"{mem(n, o, 1) / 2**20:.1f}", f"{mem(n, o, 1) / mem(1, True, 1):.2f}x",
             f"{step(n, o):.3f}", f"{step(n, o) / step(1, True):.2f}x"] for n, o in CHUNKS]  # fmt: skip
    packed = [[seq, f"{a:.3f}", f"{b:.3f}", f"{a / b:.1f}x"] for seq, (a, b) in res["packed"].items()]
    md.page(args.out, "Head-chunked attention and the per-document packed path (sp 2, CPU)", run, [
        f"Tiny Llama ({HEADS}/{KV_HEADS} heads, hidden {HIDDEN}, fp32), sp 2, gloo, shared 2-core CPU. One `LlamaAttention`"
        f" at S {args.seq}: peak (forward + backward) and kept (live after its forward), max over ranks; "
        f"step: median of {args.steps}, causal.",
        md.table(["groups", "overlap", "layer peak MiB", "ratio", "kept MiB", "ratio", "step s", "ratio"], rows),
        "Packed documents (S/2, S/4, S/4), same model, step seconds (median):",
        md.table(["S", "blockwise (before)", "per-document sdpa (after)", "speed-up"], packed)])  # fmt: skip


if __name__ == "__main__":
    main()
