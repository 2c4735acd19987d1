"""Run the benchmark suite: launch the tasks, collect their JSON, render the tables.

    python -m bench                 # the default sections (~7 min on a 2-core CPU machine)
    python -m bench --smoke         # tiny sizes, ulysses-sp only (< 1 min; CI) -> smoke.{json,md}
    python -m bench --sections deepspeed
    python -m bench --sections longest_fit                 # section 7 (~15 min, not in the default set)
    python -m bench --render bench/results/bench.json      # re-render the tables only

Sections: comm, flops, memory (bench/workers.py, one launch per world size) and deepspeed (bench/steploop.py:
one step loop, both sides) and longest_fit (bench/longest_fit.py, both sides); the last two need ``bash
bench/setup_deepspeed.sh``. Every worker is launched by bench/launch.py.

A run into bench/results carries every section it did not run from the previous bench.json, still labelled
with the run that produced it, and refreshes the targets block of docs/readme/performance.md (then README.md
via scripts/build_readme.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench import longest_fit, md, report
from bench import spec as S
from bench.launch import DS_PYTHON, ROOT, WorkerFailed, deepspeed_available, run_worker

LIBRARY = ("comm", "flops", "memory")
SECTIONS = (*LIBRARY, "deepspeed", "longest_fit")
DS_POINTS = [{"dp": 1, "sp": 2, "zero": 1}, {"dp": 1, "sp": 2, "zero": 2}, {"dp": 2, "sp": 2, "zero": 1}]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_pair(point: dict, *, steps: int, seq: int, repeats: int, run: dict, lr: float = 1e-3) -> dict:
    """ulysses-sp and DeepSpeed on one (dp, sp, zero) point, alternating launches (so a burst of load from
    elsewhere hits neither side alone), each side's best timing; plus the single-process oracle."""
    args = [*(f"--{k}={v}" for k, v in point.items()), f"--steps={steps}", f"--seq-len={seq}", "--micro-batch=1", f"--lr={lr}"]
    sides: dict[str, list] = {"ours": [], "deepspeed": []}
    try:
        for _ in range(repeats):
            for side, py in (("ours", None), ("deepspeed", DS_PYTHON)):
                res, cmd, _ = run_worker("bench.steploop", point["dp"] * point["sp"], ["--impl", side, *args], python=py,
                                         launches=run["launches"])  # fmt: skip
                sides[side].append({**res, "command": cmd})
    except WorkerFailed as e:
        log(f"  {point}: FAILED {str(e).splitlines()[0]}")
        return {"point": point, "error": str(e)[-2000:]}
    ref = S.reference_run(S.ModelSpec(), steps=steps, dp_size=point["dp"], sp_size=point["sp"], mb=1, seq_len=seq, lr=lr)
    best = {side: {**runs[0], "tokens_per_s_per_rank": max(r["tokens_per_s_per_rank"] for r in runs), "repeats":
                   len(runs), "phase_s": {k: min(r["phase_s"][k] for r in runs) for k in runs[0]["phase_s"]}}
            for side, runs in sides.items()}  # deterministic fields from the first launch, the best timings of all
    return {"point": point, "steps": steps, "seq": seq, "micro_batch": 1, "lr": lr, **best, "reference": ref,
            "ours_command": best["ours"]["command"], "deepspeed_command": best["deepspeed"]["command"]}  # fmt: skip


def run_sections(sections: list[str], smoke: bool, run: dict) -> dict:
    """``{section: data}`` for the sections of this run."""
    out: dict = {t: [] for t in LIBRARY if t in sections}
    for world in ([2] if smoke else [2, 4]) if out else []:
        recs, cmd, _ = run_worker("bench.workers", world, ["--tasks", ",".join(out), *["--smoke"] * smoke], launches=run["launches"])
        for r in recs:
            out[r["task"]].append({**r, "command": cmd})
    if "deepspeed" in sections:
        steps, seq, repeats = (3, 32, 1) if smoke else (20, 256, 2)
        out["deepspeed"] = [run_pair(p, steps=steps, seq=seq, repeats=repeats, run=run)
                            for p in DS_POINTS[: 1 if smoke else 3]]  # fmt: skip
    if "longest_fit" in sections:
        out["longest_fit"] = longest_fit.run_section(run["launches"])
    return out


def carry_previous(result: dict, path: str) -> None:
    """Add the sections of the previous results file that this run did not produce, with their runs."""
    prev = json.loads(Path(path).read_text()) if os.path.exists(path) else {}
    for name, sec in prev.get("sections", {}).items():
        if name in SECTIONS and name not in result["sections"]:
            result["sections"][name] = sec
            result["runs"].setdefault(sec["run"], prev["runs"][sec["run"]])
            log(f"bench: section {name} carried from run {sec['run']} ({os.path.relpath(path, ROOT)})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, ulysses-sp sections only (CI)")
    ap.add_argument("--sections", default=None, help=f"comma list of {','.join(SECTIONS)}, or all")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--render", metavar="JSON", help="only re-render the tables from a results file")
    args = ap.parse_args(argv)
    readme = os.path.abspath(args.out_dir) == str(ROOT / "bench" / "results")
    if args.render:
        result = json.loads(Path(args.render).read_text())
        result["sections"] = {k: v for k, v in result["sections"].items() if k in SECTIONS}  # retired ones dropped
        result["runs"] = {k: v for k, v in result["runs"].items() if k in {s["run"] for s in result["sections"].values()}}
    else:
        sections = list(SECTIONS if args.sections == "all" else args.sections.split(",") if args.sections
                        else LIBRARY if args.smoke else SECTIONS[:-1])  # fmt: skip
        if unknown := set(sections) - set(SECTIONS):
            ap.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
        if (needs := {"deepspeed", "longest_fit"} & set(sections)) and not deepspeed_available():
            log(f"bench: sections {sorted(needs)} need DeepSpeed: run `bash bench/setup_deepspeed.sh` first; skipping")
            sections = [s for s in sections if s not in needs]
        run = md.provenance(md.command("bench", argv))
        found = run_sections(sections, args.smoke, run)
        md.finish(run)
        result = {"smoke": args.smoke, "runs": {run["id"]: run},
                  "sections": {k: {"run": run["id"], "data": v} for k, v in found.items()}}  # fmt: skip
        if not args.smoke:
            carry_previous(result, os.path.join(args.out_dir, "bench.json"))
    summary = report.write(result, args.out_dir, name="smoke" if result["smoke"] else "bench")
    if readme and not result["smoke"]:
        report.write_readme(result, str(ROOT / "docs" / "readme" / "performance.md"))
        subprocess.run([sys.executable, str(ROOT / "scripts" / "build_readme.py")], cwd=ROOT, check=True)
    log(f"{summary}\nbench: done -> {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
