"""Head-chunked attention and the per-document packed path, sp 2 on CPU (gloo): ``python -m bench.head_chunks``.

One attention layer's peak and kept memory (``memory.meter``) and the step time for head groups 1 / 2 / 4
(overlap on/off); packed documents (S/2, S/4, S/4): the blockwise core (before: ``attn_chunk`` as auto picks)
against one sdpa call per document (after). Writes ``bench/results/head_chunks.md``.
"""

from __future__ import annotations

import statistics

import torch

from bench import md
from bench.counters import timed
from bench.launch import max_over_ranks, parser, run_worker, serve
from bench.spec import llama, packed_positions
from ulysses_sp.attention.blockwise import resolve_chunk
from ulysses_sp.attention.positions import capture_call
from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
from ulysses_sp.memory.meter import track_peak_memory
from ulysses_sp.parallel.mesh import init_mesh

HEADS, KV_HEADS, HIDDEN = 8, 2, 128  # head dim 16; GQA 4:1 as Llama-3 8B; 4 head groups split over 2 ranks
CHUNKS = [(1, False), (2, False), (2, True), (4, False), (4, True)]  # (head groups, overlap)


def _setup(seq: int):
    mesh = init_mesh((1, 2))
    model = llama(vocab_size=256, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=2 * seq)  # fmt: skip
    return mesh, model, UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 1, mesh=mesh)


def _use(reg, chunks: int, overlap: bool, attn_chunk: int | None = None) -> None:  # read at every call
    reg.attention.head_chunks, reg.attention.head_chunk_overlap, reg.attention.attn_chunk = chunks, overlap, attn_chunk


def layer_memory(seq: int) -> list[list[int]]:  # [peak, kept] of one attention layer per variant
    mesh, model, reg = _setup(seq)
    pos = torch.arange(mesh.sp_rank * seq // 2, (mesh.sp_rank + 1) * seq // 2)[None]
    reg.attention.call = capture_call(model, (), {"position_ids": pos})  # what the model's pre-hook records
    out = []
    for variant in CHUNKS:
        _use(reg, *variant)
        x = torch.randn(1, seq // 2, HIDDEN, requires_grad=True)
        with track_peak_memory("cpu", include=[x]) as mem:
            y, _ = model.model.layers[0].self_attn(x, position_embeddings=model.model.rotary_emb(x, pos),
                                                   attention_mask=None, position_ids=pos)  # fmt: skip
            kept = mem.current_bytes  # what the layer keeps for its backward (+ x and its output)
            y.sum().backward()
        out.append([max_over_ranks(mem.peak_bytes), max_over_ranks(kept)])
    reg.remove()
    return out


def step_times(seq: int, packed: bool, variants: list[tuple], steps: int) -> list[float]:  # interleaved
    mesh, model, reg = _setup(seq)
    s_l, r = seq // 2, mesh.sp_rank
    pos = (packed_positions(seq) if packed else torch.arange(seq)[None])[:, r * s_l : (r + 1) * s_l]
    ids = torch.randint(0, 256, (1, s_l), generator=torch.Generator().manual_seed(r))
    times = [[] for _ in variants]
    for _ in range(steps + 1):
        for variant, got in zip(variants, times):
            _use(reg, *variant)
            got.append(timed(lambda: model(input_ids=ids, position_ids=pos).logits.float().logsumexp(-1).sum().backward()))
    reg.remove()
    return [statistics.median(t[1:]) for t in times]


def worker(args) -> dict:
    packed = {seq: step_times(seq, True, [(1, False, resolve_chunk(None, seq, HIDDEN // HEADS)), (1, False, None)],
                              args.steps) for seq in args.packed_seqs}  # blockwise (before), per document (after)
    return {"memory": layer_memory(args.seq), "causal": step_times(args.seq, False, CHUNKS, args.steps), "packed": packed}


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "head_chunks.md")
    ap.add_argument("--seq", type=int, default=8192, help="S of the head-group rows")
    ap.add_argument("--packed-seqs", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    if serve(lambda: worker(args), args.out):
        return
    run = md.provenance(md.command("bench.head_chunks", argv))
    forward = ["--seq", str(args.seq), "--steps", str(args.steps), "--packed-seqs", *map(str, args.packed_seqs)]
    res, _, _ = run_worker("bench.head_chunks", 2, forward)
    rows = [[n if n > 1 else "1 (unchunked)", "-" if n == 1 else "on" if o else "off", f"{m[0] / 2**20:.1f}",
             f"{m[0] / res['memory'][0][0]:.2f}x", f"{m[1] / 2**20:.1f}", f"{m[1] / res['memory'][0][1]:.2f}x",
             f"{t:.3f}", f"{t / res['causal'][0]:.2f}x"] for (n, o), m, t in zip(CHUNKS, res["memory"], res["causal"])]  # fmt: skip
    packed = [[seq, f"{a:.3f}", f"{b:.3f}", f"{a / b:.1f}x"] for seq, (a, b) in res["packed"].items()]
    md.page(args.out, "Head-chunked attention and the per-document packed path (sp 2, CPU)", run, [
        f"Tiny Llama ({HEADS}/{KV_HEADS} heads, hidden {HIDDEN}, fp32), sp 2, gloo, shared 2-core CPU. One `LlamaAttention`"
        f" at S {args.seq}: peak (forward + backward) and kept (live after its forward), max over ranks; "
        f"step: median of {args.steps}, causal; the variants' steps interleaved (ratios within one run).",
        md.table(["groups", "overlap", "layer peak MiB", "ratio", "kept MiB", "ratio", "step s", "ratio"], rows),
        "Packed documents (S/2, S/4, S/4), same model, step seconds (median):",
        md.table(["S", "blockwise (before)", "per-document sdpa (after)", "speed-up"], packed)])  # fmt: skip


if __name__ == "__main__":
    main()
