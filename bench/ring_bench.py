"""Ring attention and the hybrid Ulysses x Ring layout: bytes on the wire and the causal load balance.

``python -m bench.ring_bench [--smoke]`` (seconds) launches itself (gloo, CPU, one thread per rank) at 4 and 2 ranks:

(a) **bytes** one rank sends in one forward + backward of a tiny Llama (GQA, ``SHAPE``, packed documents) per
    layout ``(ulysses U, ring R)`` over ``sp = U x R`` ranks, fp32 and bf16: the bytes ``all_to_all_single``
    sends to *other* ranks (the Ulysses exchange, ``bench.counters``; the position-id gather is an all-gather
    and is not counted) and the bytes ring attention sends (``attention.ring_stats``), against the analytic
    volume per layer, forward + backward: Ulysses (``U > 1``) ``2 (U-1)/U B S_l D (2 H + 2 Hkv_U) b`` with
    ``S_l = S/sp``, ``Hkv_U = max(Hkv, U)`` (kv heads replicated before the exchange when fewer than ``U``);
    ring (``R > 1``) ``2 (R-1)`` K/V hops in the input dtype and ``R`` fp32 dK/dV hops of ``KV = 2 B (Hkv_U /
    U) (S/R) D`` elements;
(b) **FLOPs** per rank of ring attention alone under the causal mask (``BlockCounts``: computed blocks,
    forward and backward), zigzag vs contiguous layout, max/min over ranks, at R = 2 and 4.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from bench import md
from bench.counters import CollectiveCounter
from bench.launch import parser, run_worker, serve
from bench.spec import llama, packed_positions
from ulysses_sp.attention.blockwise import BlockCounts
from ulysses_sp.attention.ring import ring_attention
from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
from ulysses_sp.data import prepare_batch, shard_batch
from ulysses_sp.parallel.loss import sp_causal_lm_loss
from ulysses_sp.parallel.mesh import init_mesh

LAYOUTS = ((2, 2), (1, 4), (4, 1), (1, 2), (2, 1))
"""``(ulysses, ring)``: the hybrid, ring alone and Ulysses alone over 4 and 2 ranks."""
SHAPE = {"b": 1, "s": 64, "h": 4, "hkv": 2, "d": 8, "layers": 2}
BALANCE_SHAPE = {"b": 1, "h": 8, "hkv": 2, "s": 2048, "d": 64}
SMOKE_BALANCE_SHAPE = {"b": 1, "h": 4, "hkv": 2, "s": 128, "d": 16}


def analytic(ulysses: int, ring: int, shape: dict = SHAPE, itemsize: int = 4) -> dict[str, int]:
    """Bytes one rank sends in one forward + backward: ``{"all_to_all": ..., "ring": ...}``."""
    b, s, h, hkv, d, layers = (shape[k] for k in ("b", "s", "h", "hkv", "d", "layers"))
    hkv_u, a2a, ring_bytes = max(hkv, ulysses), 0, 0
    if ulysses > 1:
        a2a = 2 * (ulysses - 1) * b * (s // (ulysses * ring)) * d * (2 * h + 2 * hkv_u) * itemsize // ulysses
    if ring > 1:
        kv = 2 * b * (hkv_u // ulysses) * (s // ring) * d  # [2, B, Hkv_U/U, S/R, D]
        ring_bytes = 2 * (ring - 1) * kv * itemsize + ring * kv * 4
    return {"all_to_all": layers * a2a, "ring": layers * ring_bytes}


def measure(ulysses: int, ring: int, shape: dict = SHAPE, dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """Bytes this rank sends in one step of the model, ``{"all_to_all": ..., "ring": ...}`` (on ulysses * ring ranks)."""
    sp = ulysses * ring
    mesh = init_mesh((1, sp), ring_size=ring)
    model = llama(vocab_size=64, hidden_size=shape["h"] * shape["d"], intermediate_size=64,
                  num_hidden_layers=shape["layers"], num_attention_heads=shape["h"],
                  num_key_value_heads=shape["hkv"], max_position_embeddings=4 * shape["s"]).to(dtype)  # fmt: skip
    reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, shape["b"], mesh=mesh)
    pos = packed_positions(shape["s"]).repeat(shape["b"], 1)
    batch = {"input_ids": torch.randint(0, 64, (shape["b"], shape["s"])), "position_ids": pos}
    local = shard_batch(prepare_batch(batch, sp, strict=True, ring_size=ring), mesh.sp_rank, sp, ring)
    with CollectiveCounter() as counter:
        out = model(input_ids=local["input_ids"], position_ids=local["position_ids"])
        sp_causal_lm_loss(out.logits, local["shift_labels"], mesh.sp_group).backward()
    sent = {"all_to_all": sum(n for (_, op), n in counter.sent.items() if op.startswith("all_to_all")),
            "ring": reg.attention.ring_stats.bytes_sent}  # fmt: skip
    reg.remove()
    return sent


def balance(shape: dict) -> dict[str, list]:
    """This rank's ``(flops, computed, skipped)`` blocks of one ring-attention call (fwd + bwd) per layout."""
    group, rank, out = dist.new_group(list(range(dist.get_world_size()))), dist.get_rank(), {}
    for zigzag in (True, False):
        g, counts = torch.Generator().manual_seed(rank), BlockCounts()
        q, k, v = (torch.randn(shape["b"], n, shape["s"] // dist.get_world_size(), shape["d"], generator=g,
                               requires_grad=True) for n in (shape["h"], shape["hkv"], shape["hkv"]))  # fmt: skip
        ring_attention(q, k, v, group=group, zigzag=zigzag, counts=counts).sum().backward()
        out["zigzag" if zigzag else "contiguous"] = [counts.flops, counts.computed, counts.skipped]
    return out


def worker(smoke: bool) -> dict:
    world, rows = dist.get_world_size(), []
    for dtype in (torch.float32, torch.bfloat16):
        for ulysses, ring in (lay for lay in LAYOUTS if lay[0] * lay[1] == world):
            got = [None] * world
            dist.all_gather_object(got, measure(ulysses, ring, dtype=dtype))
            rows.append({"ulysses": ulysses, "ring": ring, "dtype": str(dtype).removeprefix("torch."), "sent": got,
                         "analytic": analytic(ulysses, ring, itemsize=dtype.itemsize)})  # fmt: skip
    per_rank = [None] * world
    dist.all_gather_object(per_rank, balance(SMOKE_BALANCE_SHAPE if smoke else BALANCE_SHAPE))
    return {"bytes": rows, "balance": per_rank}


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "ring.md")
    ap.add_argument("--smoke", action="store_true", help="a tiny shape for (b)")
    args = ap.parse_args(argv)
    if serve(lambda: worker(args.smoke), args.out):
        return
    run, byte_rows, flop_rows = md.provenance(md.command("bench.ring_bench", argv)), [], []
    for world in (4, 2):
        res = run_worker("bench.ring_bench", world, ["--smoke"] * args.smoke)[0]
        for r in res["bytes"]:
            want, sent = r["analytic"], r["sent"]
            ratio = sum(s["all_to_all"] + s["ring"] for s in sent) / len(sent) / (want["all_to_all"] + want["ring"])
            byte_rows.append([world, r["dtype"], f"{r['ulysses']} x {r['ring']}",
                              ", ".join(map(str, sorted({s["all_to_all"] for s in sent}))), want["all_to_all"],
                              ", ".join(map(str, sorted({s["ring"] for s in sent}))), want["ring"], f"{ratio:.2f}x"])  # fmt: skip
        for layout in ("zigzag", "contiguous"):
            f = [rank[layout] for rank in res["balance"]]
            flop_rows.append([world, layout, ", ".join(f"{x[0] / 1e9:.2f}" for x in f),
                              f"{max(x[0] for x in f) / min(x[0] for x in f):.3f}",
                              ", ".join(f"{x[1]}/{x[2]}" for x in f)])  # fmt: skip
    shape = SMOKE_BALANCE_SHAPE if args.smoke else BALANCE_SHAPE
    md.page(args.out, "Ring attention and Ulysses x Ring: bytes and causal load balance", run, [
        "## (a) Bytes each rank sends in one forward + backward, against the analytic volume",
        f"A tiny Llama (shape {SHAPE}, packed documents), counted on every rank; formulas: `bench/ring_bench.py`. "
        "Ring hops: `2 (R-1)` K/V hops in the input dtype + `R` fp32 dK/dV hops.",
        md.table(["sp", "dtype", "ulysses x ring", "all-to-all bytes (every rank)", "analytic",
                  "ring bytes (every rank)", "analytic", "ratio"], byte_rows),
        "## (b) FLOPs per rank of ring attention under the causal mask (forward + backward)",
        "`BlockCounts.flops` of the blocks each rank computes (fully masked blocks are skipped; a block on the "
        "diagonal counts whole). Auto block size. Contiguous pieces would ideally show `2R - 1` (3 at R = 2, 7 at "
        f"R = 4); whole diagonal blocks make the measured ratio a little smaller. Shape: {shape}, fp32.",
        md.table(["R", "layout", "FLOPs per rank (GFLOP)", "max/min", "blocks computed / skipped per rank"],
                 flop_rows)])  # fmt: skip


if __name__ == "__main__":
    main()
