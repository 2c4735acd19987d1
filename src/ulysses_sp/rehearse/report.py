"""The text a ``--rehearse`` run prints: per rank the rehearsed figures beside the planner's.

Bytes are shown in GiB; the planner's prediction stands beside the rehearsed device peak, and the
verdict compares the peak plus the planner's reserve with the GPU memory, and the node's host bytes
with its host memory.
"""

from __future__ import annotations

from ulysses_sp.rehearse.run import Rehearsal

GIB = float(1 << 30)


def _g(n: float) -> str:
    """Bytes in GiB, or MiB below 1 GiB (test-size runs)."""
    return f"{n / GIB:,.2f} GiB" if abs(n) >= GIB else f"{n / (1 << 20):,.2f} MiB"


def format_rehearsal(r: Rehearsal) -> str:
    """The human-readable report of ``r``."""
    pred = r.predicted
    lines = [
        f"rehearsal: {r.gpus} rank(s), {r.seq_len:,} tokens per sequence, device {r.device}",
        f"  planner: peak {_g(pred['peak_bytes'])} per rank (reserve included), host {_g(pred['host_bytes'])} per rank",
    ]
    for res in r.ranks:
        lines.append(f"rank {res.rank}: device peak {_g(res.device_peak)} (in {res.peak_phase}), "
                     f"host peak {_g(res.host_peak)}, {res.flops / 1e12:,.1f} TFLOP, {res.seconds:.1f} s")  # fmt: skip
        lines.append("  at the peak: " + ", ".join(f"{k} {_g(v)}" for k, v in res.breakdown.items()))
        lines.append("  high point per phase: " + ", ".join(f"{k} {_g(v)}" for k, v in res.phase_peaks.items()))
        lines.append("  largest tensors alive at the peak:")
        for t in res.top:
            where = f" in {t['module']}" if t["module"] else ""
            lines.append(f"    {_g(t['bytes']):>12}  {t['shape']} {t['dtype']}  {t['op']}{where} ({t['phase']})")
        coll = ", ".join(f"{k} x{v['count']} ({_g(v['bytes'])})" for k, v in sorted(res.collectives.items()))
        lines.append(f"  collectives sent: {coll or 'none'}")
        if res.host_traffic:
            lines.append("  host copies: " + ", ".join(f"{k} {_g(v)}" for k, v in sorted(res.host_traffic.items())))
    if r.time:
        t = r.time
        lines.append(
            f"time, projected (not measured) on one {t['device']} at {t['mfu']:.0%} of peak FLOP/s: step {t['step_s']:,.1f} s "
            f"= compute {t['compute_s']:,.1f} s + all-to-all {t['all_to_all_s']:,.2f} s (exposed) + FSDP "
            f"{t['fsdp_s']:,.2f} s and host copies {t['host_copy_s']:,.2f} s ({t['hidden_fraction']:.0%} hidden behind "
            f"compute) + host optimizer {t['host_optimizer_s']:,.1f} s; {t['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU "
            f"(planner: {pred['tokens_per_s'] / r.gpus:,.0f})"
        )  # fmt: skip
        if t.get("all_to_all_hidden_s"):
            lines.append(f"  head-group overlap, projected: {t['all_to_all_hidden_s'] * 1e3:,.1f} ms of the all-to-all "
                         f"({t['all_to_all_hidden_fraction']:.0%}) behind the attention core")  # fmt: skip
    host_line = f"host per node {_g(r.host_per_node)} of {_g(r.host_memory)}"
    verdict = "fits" if r.fits else "DOES NOT FIT"
    lines.append(f"verdict: {verdict}: device {_g(r.device_peak)} + reserve {_g(r.reserve)} of {_g(r.gpu_memory)}; "
                 f"{host_line}")  # fmt: skip
    lines.extend(f"note: {n}" for n in r.notes)
    return "\n".join(lines)
