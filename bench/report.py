"""Report: tables only, rendered from a results JSON (``python -m bench`` writes it; ``--render`` re-reads it).

Layout of a result: ``runs`` maps a run id to where and when it ran (date, commit, host, machine, invocation,
wall time, launches); ``sections`` maps a section name to ``{"run": id, "data": ...}``. A full run carries the
sections it did not run from the previous results file, each still naming the run that produced it, and every
table here is printed under that run's label. The prose that explains the tables is written by hand in
docs/readme/performance.md. Every number comes from the JSON.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from bench import longest_fit
from bench.md import data, label, produced_by, table

MIB = 2**20
BUDGET_MIB = 64
"""Per-rank budget for the 'max S' column of section 3 (fitted; tiny model, fp32)."""


# ---------------------------------------------------------------------------------------------- derived
def memory_fits(records: list[dict]) -> list[dict]:
    """Per (world, sp, tiled): slope of activation bytes vs S over the three longest S, and ratios."""
    groups = defaultdict(list)
    for r in records:
        groups[(r["world"], r["sp"], r["tiled"])].append(r)
    fits = {}
    for (w, sp, tiled), rs in groups.items():
        rs = sorted(rs, key=lambda r: r["seq"])[-3:]
        a, c = statistics.linear_regression([r["seq"] for r in rs], [r["peak_bytes"] - r["baseline_bytes"] for r in rs])
        budget = BUDGET_MIB * MIB - rs[-1]["baseline_bytes"] - c
        fits[(w, sp, tiled)] = {"world": w, "sp": sp, "tiled": tiled, "seqs": [r["seq"] for r in rs],
            "peak_mib": [round(r["peak_bytes"] / MIB, 2) for r in rs], "slope_bytes_per_token": a,
            "max_seq_in_budget": int(budget / a) if a > 0 else None, "command": rs[-1]["command"]}  # fmt: skip
    for (w, _, tiled), f in fits.items():
        ref = fits.get((w, 1, tiled))
        f["slope_ratio_to_sp1"] = f["slope_bytes_per_token"] / ref["slope_bytes_per_token"] if ref else None
    return sorted(fits.values(), key=lambda f: (f["world"], f["tiled"], f["sp"]))


def ds_rows(pairs: list[dict]) -> list[dict]:
    rows = []
    for p in (p for p in pairs if "error" not in p):
        o, d = p["ours"], p["deepspeed"]
        rows.append({**p["point"], "steps": p["steps"], "seq": p["seq"], "o": o, "d": d, "ref": p["reference"],
            "loss1_diff": abs(o["losses"][0] - d["losses"][0]), "lossN_diff": abs(o["losses"][-1] - d["losses"][-1]),
            "tps_ratio": o["tokens_per_s_per_rank"] / d["tokens_per_s_per_rank"], "peak_ratio": o["peak_bytes"] / d["peak_bytes"],
            "commands": f"`{p['ours_command']}`<br>`{p['deepspeed_command']}`"})  # fmt: skip
    return rows


def targets(result: dict) -> list[list]:
    """``[measure, target, measured, status, section]`` per headline number."""
    out = []
    if comm := data(result, "comm"):
        ratios = [x for r in comm for x in (r["fwd_ratio"], r["bwd_ratio"])]
        gqa = sum(r["kv_heads"] < r["sp"] for r in comm)
        out.append(["1. all-to-all bytes / analytic minimum (fwd and bwd, MHA + GQA incl. Hkv < P)", "1.00",
                    f"{min(ratios):.4f} .. {max(ratios):.4f} ({len(comm)} configs, {gqa} with Hkv < P)",
                    max(abs(x - 1) for x in ratios) < 1e-9, "comm"])  # fmt: skip
    if fl := data(result, "flops"):
        worst = max(r["ratio_to_total_over_p"] for r in fl)
        out.append(["2. FLOPs per rank / (total / P), sp in {1,2,4}", "<= 1.02", f"max {worst:.4f}",
                    worst <= 1.02, "flops"])  # fmt: skip
    if fits := [f for f in memory_fits(data(result, "memory", [])) if f["sp"] > 1 and f["slope_ratio_to_sp1"]]:
        top = max(f["world"] for f in fits)
        desc = ", ".join(f"sp={f['sp']}{' tiled' if f['tiled'] else ''}: {f['slope_ratio_to_sp1']:.3f}"
                         for f in fits if f["world"] == top)  # fmt: skip
        out.append(["3. activation slope ratio sp=P / sp=1 (fitted, long S)", "1/P (0.500, 0.250)", desc,
                    all(abs(f["slope_ratio_to_sp1"] * f["sp"] - 1) <= 0.15 for f in fits), "memory"])  # fmt: skip
    if rows := ds_rows(data(result, "deepspeed", [])):
        each = lambda f: "; ".join(f"{_pt(r)}: {f(r)}" for r in rows)  # noqa: E731
        out += [
            ["5a. loss difference ours vs DeepSpeed at step 1 / after N steps", "equal to tolerance (1e-3)",
             each(lambda r: f"{r['loss1_diff']:.1e} / {r['lossN_diff']:.1e}"),
             all(r["loss1_diff"] < 1e-4 and r["lossN_diff"] < 1e-3 for r in rows), "deepspeed"],
            ["5b. tokens/s ours / DeepSpeed", ">= 1.0", each(lambda r: f"{r['tps_ratio']:.2f}"),
             all(r["tps_ratio"] >= 1.0 for r in rows), "deepspeed"],
            ["5c. peak tensor memory ours / DeepSpeed", "<= 1.0", each(lambda r: f"{r['peak_ratio']:.2f}"),
             all(r["peak_ratio"] <= 1.0 for r in rows), "deepspeed"],
        ]  # fmt: skip
    out += [[*row, "longest_fit"] for row in longest_fit.targets(data(result, "longest_fit", []))]
    return out


# ---------------------------------------------------------------------------------------------- markdown
def _status(ok) -> str:
    return "n/a" if ok is None else ("met" if ok else "**not met**")


def _pt(r: dict) -> str:
    return f"dp{r['dp']}xsp{r['sp']} z{r['zero']}"


def targets_md(result: dict) -> str:
    rows = targets(result)
    runs = sorted({result["sections"][t[4]]["run"] for t in rows})
    body = [[*t[:3], _status(t[3]), f"`{result['sections'][t[4]]['run']}`"] for t in rows]
    labels = "\n".join(f"- {label(result['runs'][r])}" for r in runs)
    return table(["measure", "target", "measured", "status", "run"], body) + "\n\nRuns:\n\n" + labels


def _sec_comm(comm: list[dict]) -> tuple[str, str]:
    return "1. Communication volume per attention layer (bytes sent per rank, fp32)", table(
        ["P", "H", "Hkv", "B", "S", "fwd bytes", "bwd bytes", "minimum", "fwd ratio", "bwd ratio", "kv→H bytes",
         "other fwd B/step", "command"],
        [[r["sp"], r["heads"], r["kv_heads"], r["batch"], r["seq"], int(r["fwd_bytes_per_layer"]),
          int(r["bwd_bytes_per_layer"]), r["min_bytes_per_layer"], f"{r['fwd_ratio']:.4f}", f"{r['bwd_ratio']:.4f}",
          r["naive_kv_bytes_per_layer"], r["other_fwd_bytes_per_step"], f"`{r['command']}`"] for r in comm])  # fmt: skip


def _sec_flops(fl: list[dict]) -> tuple[str, str]:
    return "2. FLOPs per rank (forward + backward, `torch.utils.flop_counter`, eager core attention)", table(
        ["world", "dp", "sp", "S", "FLOPs/rank", "total/P", "ratio", "command"],
        [[r["world"], r["dp"], r["sp"], r["seq"], r["flops_per_rank"], int(r["total_flops"] / r["sp"]),
          f"{r['ratio_to_total_over_p']:.4f}", f"`{r['command']}`"] for r in fl])  # fmt: skip


def _sec_memory(mem: list[dict]) -> tuple[str, str]:
    return "3. Peak tensor memory per rank vs sequence length (fp32, `ulysses_sp.memory.meter`)", table(
        ["world", "sp", "tiled", "S", "peak MiB", "slope B/token", "ratio to sp=1", "target",
         f"max S in {BUDGET_MIB} MiB", "command"],
        [[f["world"], f["sp"], "yes" if f["tiled"] else "no", "/".join(map(str, f["seqs"])),
          "/".join(map(str, f["peak_mib"])), f"{f['slope_bytes_per_token']:.0f}",
          "" if f["slope_ratio_to_sp1"] is None else f"{f['slope_ratio_to_sp1']:.3f}", f"{1 / f['sp']:.3f}",
          f["max_seq_in_budget"], f"`{f['command']}`"] for f in memory_fits(mem)])  # fmt: skip


def _sec_deepspeed(pairs: list[dict]) -> tuple[str, str]:
    rows, phases = ds_rows(pairs), ("forward", "backward", "step")
    f5 = lambda x: f"{x:.5f}"  # noqa: E731
    ms = lambda p: "/".join(f"{1000 * p[k]:.0f}" for k in phases if k in p)  # noqa: E731
    a2a = lambda c: sum(v for k, v in c.items() if k.endswith("/all_to_all_single"))  # noqa: E731
    main = table(
        ["point", "S", "steps", "loss1 ours / DS / ref", "lossN ours / DS / ref", "tok/s ours / DS", "tok/s ratio",
         "phases ms ours / DS", "peak MiB ours / DS", "peak ratio", "grad ours / DS",
         "all-to-all bytes/step ours / DS", "commands"],
        [[_pt(r), r["seq"], r["steps"], " / ".join(f5(x["losses"][0]) for x in (r["o"], r["d"], r["ref"])),
          " / ".join(f5(x["losses"][-1]) for x in (r["o"], r["d"], r["ref"])),
          f"{r['o']['tokens_per_s_per_rank']:.0f} / {r['d']['tokens_per_s_per_rank']:.0f}", f"{r['tps_ratio']:.2f}",
          f"{ms(r['o'].get('phase_s', {}))} / {ms(r['d'].get('phase_s', {}))}",
          f"{r['o']['peak_bytes'] / MIB:.2f} / {r['d']['peak_bytes'] / MIB:.2f}", f"{r['peak_ratio']:.2f}",
          " / ".join(f"{x['grad_norm_step1'] / r['ref']['grad_norm_step1']:.3f}" for x in (r["o"], r["d"])),
          f"{a2a(r['o']['comm_bytes'])} / {a2a(r['d']['comm_bytes'])}", r["commands"]] for r in rows])  # fmt: skip
    delta = table(["point", "tok/s ratio", "peak ratio", *(f"{k} ours − DS ms" for k in phases)],
                  [[_pt(r), f"{r['tps_ratio']:.2f}", f"{r['peak_ratio']:.2f}",
                    *(f"{1000 * (r['o']['phase_s'][k] - r['d']['phase_s'][k]):+.1f}" for k in phases)]
                   for r in rows])  # fmt: skip
    failed = [f"- **{_pt(p['point'])} failed**: `{p['error'].splitlines()[0]}`" for p in pairs if "error" in p]
    return "5. Side by side with DeepSpeed Ulysses/ALST (same model, data, (dp, sp), ZeRO stage)", \
        "\n\n".join([main, "Per phase (fastest step of each side):", delta, *failed])  # fmt: skip


SECTIONS_MD = {"comm": _sec_comm, "flops": _sec_flops, "memory": _sec_memory, "deepspeed": _sec_deepspeed,
               "longest_fit": longest_fit.section}  # fmt: skip


def render(result: dict) -> str:
    parts = ["# ulysses-sp benchmark results", "", "What the tables mean: docs/readme/performance.md (the README's "
             "Performance section). Each table names the run that produced it.", "", "## Targets", "",
             targets_md(result)]  # fmt: skip
    for name, fn in SECTIONS_MD.items():
        if data(result, name):
            head, body = fn(data(result, name))
            parts += ["", f"## {head}", "", produced_by(result, name), "", body]
    if launched := [r for r in result["runs"].values() if r.get("launches")]:
        parts += ["", "## Launches", "", table(["run", "command", "wall s"], [
            [f"`{r['id']}`", f"`{x['command']}`", f"{x['wall_s']:.0f}"] for r in launched for x in r["launches"]])]  # fmt: skip
    return "\n".join(parts) + "\n"


def write(result: dict, out_dir: str, *, name: str) -> str:
    """``{name}.json``, ``{name}.md`` and, with section 7, ``longest_fit.md``; returns the targets as text."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
    (Path(out_dir) / f"{name}.md").write_text(render(result))
    if lf := data(result, "longest_fit"):  # also on its own page
        head, body = longest_fit.section(lf)
        (Path(out_dir) / "longest_fit.md").write_text(f"# {head}\n\n{produced_by(result, 'longest_fit')}\n\n{body}\n")
    return "\n".join(f"{t[0]}: target {t[1]}; measured {t[2]} [{_status(t[3])}]" for t in targets(result))


BEGIN, END = "<!-- bench:targets (python -m bench writes this block) -->", "<!-- /bench:targets -->"


def write_readme(result: dict, path: str) -> None:
    """Replace the targets block of docs/readme/performance.md (hand-written around it)."""
    head, rest = Path(path).read_text().split(BEGIN, 1)
    Path(path).write_text(f"{head}{BEGIN}\n{targets_md(result)}\n{END}{rest.split(END, 1)[1]}")
