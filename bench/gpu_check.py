"""GPU check for issues 11 and 26 — NOT YET RUN (written in sessions without a GPU; run it where one is).

``states`` (issue 11): a ~1.2B Llama (Llama-3.2-1B shape, random weights), bf16 + sdpa, sp 1, 32K-128K tokens, ZeRO 3
with and without CPU offload (pinned), tiled MLP + loss, activation checkpointing: tokens/s (median of 3 steps
after a warm-up), ``torch.cuda.max_memory_allocated``, the loss or the exception (OOM included). ``packed`` (issue
26): 19 packed documents through the per-document sdpa and the varlen path (``attention/varlen.py``), bf16, vs a
dense block-diagonal fp32 reference (output and q/k/v gradients), time, peak. ``head-chunks`` (issue 26): 2 ranks
(NCCL on 2 GPUs, else one GPU over gloo), a 2-layer Llama, 4 packed documents, ``head_chunks`` 1 vs 4: the
difference and each one's peak, the exchanges packed and head by head, 4 groups overlapped (issue 37). Writes ``bench/results/gpu_check.md``.

Run on a CUDA machine (~10 minutes): ``python -m bench.gpu_check [--only packed head-chunks]``; ``--device cpu``
runs ``packed`` and ``head-chunks`` small in fp32 (a smoke; varlen is CUDA-only). Benchmark code may name CUDA.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

if __package__ in (None, ""):  # `python bench/gpu_check.py` as well as `python -m bench.gpu_check`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig

from bench import md
from bench.launch import WorkerFailed, finish_worker, parser, run_worker, under_torchrun
from ulysses_sp.attention.segments import segment_attention
from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
from ulysses_sp.attention.varlen import use_varlen, varlen_segment_attention
from ulysses_sp.engine import initialize
from ulysses_sp.memory.offload import enable_activation_checkpointing
from ulysses_sp.memory.tiling import TiledCausalLMLoss, apply_tiled_mlp
from ulysses_sp.parallel.mesh import init_mesh

MODEL = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
             max_position_embeddings=131072, rope_theta=500000.0)  # fmt: skip
SMALL = dict(vocab_size=1000, hidden_size=256, intermediate_size=512)  # --device cpu: 32 heads of 8, 8 kv heads
PARTS = ("states", "packed", "head-chunks")


def run_case(seq: int, offload: bool) -> dict:
    """One case: a fresh model, 1 warm-up and 3 timed steps; tokens/s, peak allocated, the last loss."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**MODEL), attn_implementation="sdpa")
    n_params = sum(p.numel() for p in model.parameters())
    apply_tiled_mlp(model, None)
    enable_activation_checkpointing(model)
    zero = {"stage": 3, **({"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}} if offload else {})}
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}}  # fmt: skip
    engine, *_ = initialize(model, config, mesh_param=(1, 1), loss_fn=TiledCausalLMLoss(num_shards=None))
    device = engine.device
    ids = torch.randint(0, MODEL["vocab_size"], (1, seq), device=device)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    torch.cuda.reset_peak_memory_stats(device)
    times, loss = [], None
    for i in range(4):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        engine.backward(engine(input_ids=ids, shift_labels=labels).loss)  # as the CLI loop: output freed first
        loss = engine.step()
        torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - t0)
    del engine, model
    dist.barrier()
    return {"params": n_params, "tok_s": seq / statistics.median(times), "max_alloc": torch.cuda.max_memory_allocated(device),
            "loss": loss}  # fmt: skip


def _timed(device: str, fn) -> tuple:
    """``fn()`` once: ``(its result, seconds, "peak MiB allocated above the start" ("n/a" on CPU))``."""
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    sync()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base, t0, out = torch.cuda.memory_allocated() if device == "cuda" else 0, time.perf_counter(), fn()
    sync()
    peak = f"{(torch.cuda.max_memory_allocated() - base) / 2**20:,.0f} MiB" if device == "cuda" else "n/a"
    return out, time.perf_counter() - t0, peak


def _rel(got: list, ref: list) -> float:
    return max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(got, ref))


def packed_rows(seq: int, device: str, dtype: torch.dtype) -> list[list]:
    """19 packed documents, ``H_l`` 16, ``Hkv_l`` 4, D 128: each path's fwd+bwd (the second of two) vs dense fp32."""
    docs = [seq // 2, seq // 4, seq // 8] + [seq // 128] * 16
    g = torch.Generator(device).manual_seed(0)
    q, k, v, dout = (torch.randn(1, h, seq, 128, generator=g, device=device) for h in (16, 4, 4, 16))
    doc = torch.repeat_interleave(torch.arange(len(docs), device=device), torch.tensor(docs, device=device))
    mask = torch.ones(seq, seq, dtype=torch.bool, device=device).tril() & (doc[:, None] == doc[None])  # [S, S]
    dense = lambda q, k, v: F.scaled_dot_product_attention(q, *(t.repeat_interleave(4, 1) for t in (k, v)), attn_mask=mask)  # noqa: E731
    paths = {"dense fp32 (reference)": dense, "dense mask": dense, "segments": lambda q, k, v: segment_attention(q, k, v, [docs]),
             "varlen": lambda q, k, v: varlen_segment_attention(q, k, v, [docs]).transpose(1, 2)}  # fmt: skip
    rows, ref = [], None
    for name, attend in paths.items():
        leaves = [t.to(torch.float32 if "fp32" in name else dtype).requires_grad_() for t in (q, k, v)]
        if name == "varlen" and not use_varlen(*leaves[:2]):
            rows.append([seq, len(docs), name, "", "", "", f"not used here ({device}, {dtype})"])
            continue
        for _ in range(2):
            for t in leaves:
                t.grad = None
            out, sec, peak = _timed(device, lambda: [o := attend(*leaves), o.backward(dout.to(o.dtype))][0])  # noqa: B023
        ref = ref or [out.detach(), *(t.grad for t in leaves)]
        rows.append([seq, len(docs), name, f"{sec * 1e3:.1f}", peak, f"{_rel([out, *(t.grad for t in leaves)], ref):.1e}", ""])
    return rows


def head_chunk_rows(seq: int, device: str) -> list:
    """A rank of 2: fwd+bwd, ``head_chunks`` 1 (packed, head-by-head exchange) and 4 (the block per group, overlapped); rank 0's peak/time."""
    cuda = device == "cuda"
    if cuda:  # NCCL with a GPU per rank; else both ranks on GPU 0 over gloo (it stages CUDA tensors on the host)
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    dist.init_process_group("nccl" if cuda and torch.cuda.device_count() > 1 else "gloo")
    mesh, config = init_mesh((1, 2), device_type=device), LlamaConfig(**{**MODEL, "num_hidden_layers": 2, **({} if cuda else SMALL)})
    ids = torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0)).to(device)
    pos, cols = (torch.arange(seq, device=device) % (seq // 4))[None], slice(mesh.sp_rank * seq // 2, (mesh.sp_rank + 1) * seq // 2)
    runs = []
    for chunks, exchange in (cases := ((1, "packed"), (1, "headwise"), (4, "auto"), (4, "packed+overlap"))):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device, torch.bfloat16 if cuda else torch.float32)
        model.gradient_checkpointing_enable()
        model.lm_head = torch.nn.Identity()  # "logits" = the last hidden states: the peak is the layers'
        (reg := UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 1, mesh=mesh, head_chunks=chunks, exchange=exchange.split("+")[0])).attention.head_chunk_overlap = "overlap" in exchange  # fmt: skip

        def step(m=model):
            (x := m(input_ids=ids[:, cols], position_ids=pos[:, cols]).logits).float().square().mean().backward()
            return [x.detach(), *(p.grad for p in m.parameters())]

        runs.append(_timed(device, step))
        reg.remove()
    diffs = torch.tensor([_rel(r[0], runs[0][0]) for r in runs], device=device)
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    return [[seq, c, x, peak, f"{sec:.2f} s", f"{d:.1e}" if i else "(reference)"]
            for i, ((c, x), (_, sec, peak), d) in enumerate(zip(cases, runs, diffs.tolist()))]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "gpu_check.md")
    ap.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536, 131072], help="for states")
    args = ap.parse_args(argv)
    small = args.device == "cpu"  # packed at 128 tokens, head chunks at 64, fp32
    if under_torchrun():  # a head-chunks rank
        return finish_worker(head_chunk_rows(64 if small else 65536, args.device), args.out)
    if not small and not torch.cuda.is_available() or small and "states" in args.only:
        raise SystemExit("bench/gpu_check.py needs a CUDA device (--device cpu: --only packed head-chunks)")
    name = "CPU" if small else torch.cuda.get_device_name(0)
    run, body = md.provenance(md.command("bench.gpu_check", argv), backend=f"nccl/gloo, {name}"), []
    if "states" in args.only:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
        rows = []
        for seq in args.lengths:
            for offload in (False, True):
                try:
                    r = run_case(seq, offload)
                    rows.append([seq, "on" if offload else "off", f"{r['params'] / 1e9:.2f}B", f"{r['tok_s']:,.0f}",
                                 f"{r['max_alloc'] / 2**30:.1f} GiB", f"{r['loss']:.3f}", ""])  # fmt: skip
                except Exception as e:  # noqa: BLE001 - a failing case (OOM) is a result to report
                    rows.append([seq, "on" if offload else "off", "", "", "", "", f"{type(e).__name__}: {str(e)[:120]}"])
                    traceback.print_exc()
                torch.cuda.empty_cache()
        dist.destroy_process_group()
        body += ["Llama-3.2-1B shape (random weights), sp = 1, bf16, sdpa, tiled MLP + tiled loss + activation "
                 "checkpointing.", md.table(["tokens", "CPU offload", "params", "tokens/s", "max_memory_allocated",
                 "loss", "failure"], rows)]  # fmt: skip
    if "packed" in args.only:
        rows = [r for seq in ([128] if small else [8192, 16384]) for r in packed_rows(seq, args.device, torch.float32 if small else torch.bfloat16)]
        body += ["Packed documents, H_l 16 / Hkv_l 4 / D 128: error relative to the dense fp32 reference (max over the output "
                 "and the q/k/v gradients).", md.table(["tokens", "documents", "path", "fwd+bwd ms", "peak above inputs",
                 "rel. error", "note"], rows)]  # fmt: skip
    if "head-chunks" in args.only:
        try:
            rows = run_worker("bench.gpu_check", 2, ["--device", args.device])[0]
        except WorkerFailed as e:
            rows = [["", "", "", "", "", f"failed: {str(e)[-300:]}"]]
        body += ["Head chunks: 2 ranks, sp 2, 2-layer Llama, 4 packed documents, activation checkpointing; rank 0's peak "
                 "and time, the difference from head_chunks 1 (hidden states, gradients) the max over ranks.",
                 md.table(["tokens", "head_chunks", "exchange", "peak above the start", "fwd+bwd", "rel. diff"], rows)]  # fmt: skip
    md.page(args.out, "gpu_check: states, packed documents, head chunks on a GPU", run, body)


if __name__ == "__main__":
    main()
