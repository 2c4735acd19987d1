"""Bytes of the hybrid Ulysses x Ring layout through a real model: all-to-all + ring vs the analytic volume.

One forward + backward of a tiny Llama (GQA: 4 query heads, 2 kv heads, 2 layers) on one packed
sequence, per layout ``(ulysses U, ring R)`` over ``sp = U x R`` ranks. Counted on every rank: the
bytes ``all_to_all_single`` sends to *other* ranks (the Ulysses exchange: ``bench.counters``; the
position-id gather is an all-gather and is not counted) and the bytes ring attention sends
(``attention.ring_stats``). The analytic volume, per layer, forward + backward:

- Ulysses (``U > 1``): q, k, v in and the output back, forward, and the same inverse exchange of
  their gradients in backward: ``2 (U-1)/U * B * S_l * D * (2 H + 2 Hkv_U) * bytes``, ``S_l = S/sp``,
  ``Hkv_U = max(Hkv, U)`` (kv heads replicated before the exchange when fewer than ``U``);
- ring (``R > 1``): ``2 (R-1)`` K/V hops in the input dtype and ``R`` fp32 dK/dV hops of
  ``KV = 2 B (Hkv_U / U) (S/R) D`` elements.

Run: ``python -m bench.hybrid_bytes`` (4 gloo ranks, seconds); results in ``bench/results/hybrid_bytes.md``.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from bench import md
from bench.launch import finish_worker, init_worker, run_worker, under_torchrun

LAYOUTS = ((2, 2), (1, 4), (4, 1), (1, 2), (2, 1))
"""``(ulysses, ring)``: the hybrid, ring alone and Ulysses alone over 4 and 2 ranks."""
SHAPE = {"b": 1, "s": 64, "h": 4, "hkv": 2, "d": 8, "layers": 2}


def analytic(ulysses: int, ring: int, shape: dict = SHAPE, itemsize: int = 4) -> dict[str, int]:
    """Bytes one rank sends in one forward + backward: ``{"all_to_all": ..., "ring": ...}``."""
    b, s, h, hkv, d, layers = (shape[k] for k in ("b", "s", "h", "hkv", "d", "layers"))
    sp = ulysses * ring
    hkv_u = max(hkv, ulysses)
    a2a = 0
    if ulysses > 1:
        a2a = 2 * (ulysses - 1) * b * (s // sp) * d * (2 * h + 2 * hkv_u) * itemsize // ulysses
    ring_bytes = 0
    if ring > 1:
        kv = 2 * b * (hkv_u // ulysses) * (s // ring) * d
        ring_bytes = 2 * (ring - 1) * kv * itemsize + ring * kv * 4
    return {"all_to_all": layers * a2a, "ring": layers * ring_bytes}


def measure(ulysses: int, ring: int, shape: dict = SHAPE) -> dict[str, int]:
    """Run the model once on this rank (a process group of ``ulysses * ring`` ranks must exist);
    return the bytes this rank sent: ``{"all_to_all": ..., "ring": ...}``."""
    from bench.counters import CollectiveCounter
    from bench.spec import llama, packed_positions
    from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
    from ulysses_sp.data import prepare_batch, shard_batch
    from ulysses_sp.parallel.loss import sp_causal_lm_loss
    from ulysses_sp.parallel.mesh import init_mesh

    sp = ulysses * ring
    mesh = init_mesh((1, sp), ring_size=ring)
    model = llama(vocab_size=64, hidden_size=shape["h"] * shape["d"], intermediate_size=64,
                  num_hidden_layers=shape["layers"], num_attention_heads=shape["h"],
                  num_key_value_heads=shape["hkv"], max_position_embeddings=4 * shape["s"])  # fmt: skip
    reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, shape["b"], mesh=mesh)
    pos = packed_positions(shape["s"]).repeat(shape["b"], 1)
    batch = {"input_ids": torch.randint(0, 64, (shape["b"], shape["s"])), "position_ids": pos}
    local = shard_batch(prepare_batch(batch, sp, strict=True, ring_size=ring), mesh.sp_rank, sp, ring)
    counter = CollectiveCounter()
    with counter:
        out = model(input_ids=local["input_ids"], position_ids=local["position_ids"])
        sp_causal_lm_loss(out.logits, local["shift_labels"], mesh.sp_group).backward()
    sent = {"all_to_all": sum(n for (_, op), n in counter.sent.items() if op.startswith("all_to_all")),
            "ring": reg.attention.ring_stats.bytes_sent}  # fmt: skip
    reg.remove()
    return sent


def worker() -> list[dict]:
    rows = []
    for ulysses, ring in LAYOUTS:
        if ulysses * ring == dist.get_world_size():
            got = [None] * dist.get_world_size()
            dist.all_gather_object(got, measure(ulysses, ring))
            rows.append({"ulysses": ulysses, "ring": ring, "sent": got, "analytic": analytic(ulysses, ring)})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(md.ROOT / "bench" / "results" / "hybrid_bytes.md"))
    args = ap.parse_args(argv)
    if under_torchrun():
        init_worker()
        return finish_worker(worker(), args.out)
    run, rows = md.provenance("python -m bench.hybrid_bytes"), []
    for world in (4, 2):
        res, cmd, wall = run_worker("bench.hybrid_bytes", world, [])
        print(f"{cmd}: {wall:.0f} s", file=sys.stderr)
        rows += res
    out = []
    for r in rows:
        want, sent = r["analytic"], r["sent"]
        ratio = sum(s["all_to_all"] + s["ring"] for s in sent) / len(sent) / (want["all_to_all"] + want["ring"])
        out.append([r["ulysses"] * r["ring"], f"{r['ulysses']} x {r['ring']}",
                    ", ".join(map(str, sorted({s["all_to_all"] for s in sent}))), want["all_to_all"],
                    ", ".join(map(str, sorted({s["ring"] for s in sent}))), want["ring"], f"{ratio:.2f}x"])  # fmt: skip
    md.page(args.out, "Hybrid Ulysses x Ring: bytes per rank vs the analytic volume", run, [
        f"One forward + backward of a tiny Llama (shape {SHAPE}, fp32, packed documents), counted on every "
        "rank. Formulas: `bench/hybrid_bytes.py`.",
        md.table(["sp", "ulysses x ring", "all-to-all bytes (every rank)", "analytic", "ring bytes (every rank)",
                  "analytic", "ratio"], out)])  # fmt: skip


if __name__ == "__main__":
    main()
