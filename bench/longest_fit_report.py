"""Tables of the ``longest_fit`` section (workers: bench/longest_fit.py), for bench.md and longest_fit.md.

Input: ``{"search": [worker JSON + "command", ...], "profile": [...]}``, one worker per (system, data).
``search`` runs stop at the budget; ``profile`` runs (a budget no run reaches) measure every power of
two up to their ``--max-seq``. Ratios are ulysses-sp's longest S over DeepSpeed's, same data, same
criterion. Rendering only: every number comes from the JSON.
"""

from __future__ import annotations

from bench.md import table

MIB = 2**20
SYSTEMS = [("deepspeed", None), ("ours", "ckpt"), ("ours", "all")]
NAMES = {
    ("deepspeed", None): "DeepSpeed",
    ("ours", "ckpt"): "ulysses-sp, same techniques",
    ("ours", "all"): "ulysses-sp, all techniques",
}
TECHNIQUES = {
    ("deepspeed", None): "UlyssesSPAttentionHF (sdpa), TiledMLP, TiledFusedLogitsLoss, HF checkpointing, "
    "checkpoint offload context (on; skips every tensor on CPU)",
    ("ours", "ckpt"): "UlyssesSPAttentionHF (sdpa), tiled MLP, tiled loss, checkpointing",
    ("ours", "all"): "the above + activation (checkpoint) offload + Ulysses-Offload (blockwise core, "
    "K/V on host)",
}


def key(run: dict) -> tuple[str, str | None]:
    a = run["args"]
    return a["impl"], (a["tech"] if a["impl"] == "ours" else None)


def by_system(runs: list[dict], data: str) -> dict:
    return {key(r): r for r in runs if r["args"]["data"] == data}


def ratio(runs: list[dict], data: str, crit: str, system=("ours", "all")) -> float | None:
    """Longest S of ``system`` over DeepSpeed's (``None`` when either found none)."""
    by = by_system(runs, data)
    if system not in by or ("deepspeed", None) not in by:
        return None
    ours, ds = by[system]["fit"][crit]["fit"], by[("deepspeed", None)]["fit"][crit]["fit"]
    return ours / ds if ours and ds else None


def slope(probes: list[dict], crit: str) -> float | None:
    """KiB per token between the two longest powers of two measured at or under the budget run's end."""
    pts = [(p["seq"], p[crit]) for p in probes if p["seq"] & (p["seq"] - 1) == 0]
    if len(pts) < 2:
        return None
    (s1, p1), (s2, p2) = pts[-2:]
    return (p2 - p1) / (s2 - s1) / 1024


def _fit(f: dict) -> str:
    if f["fit"] is None:
        return f"none (over at {f['first_over']})"
    return f"≥ {f['fit']} (largest tried)" if f["capped"] else str(f["fit"])


def _r(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}x"


def search_table(runs: list[dict]) -> str:
    rows = []
    for data in ("causal", "packed"):
        by = by_system(runs, data)
        ds_t = by.get(("deepspeed", None), {}).get("step_seconds")
        for sysk in SYSTEMS:
            if sysk not in by:
                continue
            r = by[sysk]
            first = r["probes"][0]
            t = r["step_seconds"]
            rows.append([data, NAMES[sysk], _fit(r["fit"]["device"]), _fit(r["fit"]["total"]),
                         f"{_r(ratio(runs, data, 'device', sysk))} / {_r(ratio(runs, data, 'total', sysk))}",
                         f"{first['loss']:.5f} (S={first['seq']})", "—" if t is None else f"{t:.3f}",
                         _r(t / ds_t if t and ds_t else None), f"`{r['command']}`"])  # fmt: skip
    return table(["data", "system", "longest S, device bytes", "longest S, all bytes",
                  "vs DeepSpeed (device / all)", "loss", f"step s at S={runs[0]['args']['time_seq']}",
                  "step vs DeepSpeed", "command"], rows)  # fmt: skip


def probe_table(runs: list[dict]) -> str:
    seqs = sorted({p["seq"] for r in runs for p in r["probes"] if p["seq"] & (p["seq"] - 1) == 0})
    rows = []
    for r in runs:
        by = {p["seq"]: p for p in r["probes"]}
        cells = ["—" if s not in by else f"{by[s]['device'] / MIB:.2f}" + (
            f" ({by[s]['total'] / MIB:.2f})" if by[s]["total"] != by[s]["device"] else "") for s in seqs]  # fmt: skip
        sd, st = slope(r["probes"], "device"), slope(r["probes"], "total")
        rows.append([r["args"]["data"], NAMES[key(r)], *cells,
                     "—" if sd is None else f"{sd:.2f}" + ("" if st == sd else f" ({st:.2f})")])  # fmt: skip
    return table(["data", "system", *(f"S={s}" for s in seqs), "KiB/token (last two)"], rows)


def render(d: dict) -> tuple[str, str]:
    runs, prof = d["search"], d.get("profile", [])
    a, m = runs[0]["args"], runs[0]["model"]
    ds = next((r for r in runs if key(r)[0] == "deepspeed"), None)
    head = (f"7. Longest sequence in {a['budget_mib']:g} MiB per rank, side by side with DeepSpeed Ulysses/ALST "
            f"(sp=2, h={m['hidden']}, I={m['intermediate']}, L={m['layers']}, H={m['heads']}, V={m['vocab']})")  # fmt: skip
    parts = [
        "Meter (both sides): `ulysses_sp.memory.meter.track_peak_memory` (live tensor storages, parameters and "
        "gradients included, max over ranks). *Device bytes* leave out what ulysses-sp's offloads stage on "
        "the host (what would leave an accelerator); *all bytes* count every tensor.",
        "",
        *(f"- {NAMES[s]}: {TECHNIQUES[s]}" for s in SYSTEMS),
        "",
        search_table(runs),
        "",
        "Peak per rank at each power of two probed, MiB, device (all bytes where different):",
        "",
        probe_table(runs),
    ]
    if ds is not None:
        p = ds["probes"][-1]
        parts += ["", f"DeepSpeed {p.get('deepspeed_version', '?')} checkpoint offload at S={p['seq']}: "
                  f"{p['ckpt_offload_marked']} inputs marked, {p['ckpt_offload_offloaded']} offloaded, "
                  f"{p['ckpt_offload_skipped']} skipped."]  # fmt: skip
    if prof:
        pm = prof[0]["model"]
        parts += ["", f"Profile at V={pm['vocab']} (3b's model; no budget, every power of two to "
                  f"S={prof[0]['args']['max_seq']}):", "", probe_table(prof), "",
                  "Commands: " + "; ".join(f"`{r['command']}`" for r in prof)]  # fmt: skip
    return head, "\n".join(parts)


def target(d: dict) -> list:
    runs = d["search"]
    got = {(data, c): ratio(runs, data, c) for data in ("causal", "packed") for c in ("device", "total")}
    desc = "; ".join(f"{data}: device {_r(got[data, 'device'])}, all bytes {_r(got[data, 'total'])}"
                     for data in ("causal", "packed"))  # fmt: skip
    ok = all(x is not None and x >= 1.5 for x in got.values())
    return ["7. longest S in the same budget, ulysses-sp (all techniques) / DeepSpeed", ">= 1.5", desc, ok,
            "longest_fit"]  # fmt: skip
