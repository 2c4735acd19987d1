"""Run the benchmark suite and write bench/results/{bench,smoke}.{json,md}.

    python -m bench                 # full suite (< 15 min on a 2-core CPU machine)
    python -m bench --smoke         # tiny sizes, ulysses-sp only (< 1 min; CI)
    python -m bench --sections comm,deepspeed

Sections (each row of the markdown carries the exact command that produced it):
  comm        bytes per rank per attention layer vs the analytic Ulysses minimum (MHA, GQA, Hkv < P)
  flops       FLOPs per rank vs total / P
  memory      peak tensor memory vs sequence length, +-tiling; fitted activation slope ratio vs 1/P
  alst_memory re-run bench/bench_memory.py (ALST techniques one by one, ~8 min; not in the default set:
              a full run includes its last results from bench/results/bench_memory.json instead)
  throughput  tokens/s per rank at equal tokens per rank, ratio to sp=1 in the same run
  deepspeed   side by side with DeepSpeed's own Ulysses/ALST (needs bash bench/setup_deepspeed.sh)
  findings    checks of DeepSpeed's known problems -> bench/results/deepspeed_findings.md
  projection  Llama-8B on 8 x 80 GB from the measured counts, vs the published ALST figures
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch

from bench import projection as proj
from bench import report
from bench import spec as S
from bench.launch import DS_PYTHON, ROOT, WorkerFailed, deepspeed_available, run_worker

SECTIONS = ("comm", "flops", "memory", "alst_memory", "throughput", "deepspeed", "findings", "projection")
DEFAULT_SECTIONS = tuple(x for x in SECTIONS if x != "alst_memory")
SMOKE_SECTIONS = ("comm", "flops", "memory", "throughput", "projection")


def machine() -> dict:
    import transformers

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "backend": "gloo (CPU)",
    }


def run_library_sections(sections: list[str], smoke: bool, log) -> tuple[list[dict], list[dict]]:
    """Launch bench.workers once per world size; return (records, launches)."""
    tasks = [s for s in sections if s in ("comm", "flops", "memory", "throughput")]
    if not tasks:
        return [], []
    worlds = [2] if smoke else [2, 4]
    records, launches = [], []
    for w in worlds:
        args = ["--tasks", ",".join(tasks)] + (["--smoke"] if smoke else [])
        recs, cmd, wall = run_worker("bench.workers", w, args)
        log(f"  workers world={w}: {wall:.0f} s")
        for r in recs:
            r["command"] = cmd
        records += recs
        launches.append({"command": cmd, "wall_s": wall})
    return records, launches


DS_POINTS = [
    {"dp": 1, "sp": 2, "zero": 1},
    {"dp": 1, "sp": 2, "zero": 2},
    {"dp": 2, "sp": 2, "zero": 1},
]


def _merge(runs: list[dict]) -> dict:
    """Repeated launches of one side: deterministic fields from the first, the best timings of all."""
    out = dict(runs[0])
    out["tokens_per_s_per_rank"] = max(r["tokens_per_s_per_rank"] for r in runs)
    out["phase_s"] = {k: min(r["phase_s"][k] for r in runs) for k in runs[0]["phase_s"]}
    out["repeats"] = len(runs)
    return out


def run_pair(
    point: dict,
    *,
    steps: int,
    seq: int,
    mb: int = 1,
    lr: float = 1e-3,
    clip: float = 0.0,
    repeats: int = 1,
    log,
) -> dict:
    """ulysses-sp and DeepSpeed on one (dp, sp, zero) point, plus the single-process oracle.

    With ``repeats > 1`` the two sides alternate (ours, DS, ours, DS, ...) and each keeps its best timing,
    so a burst of load from elsewhere on the machine hits neither side alone.
    """
    args = [
        "--dp", str(point["dp"]), "--sp", str(point["sp"]), "--zero", str(point["zero"]),
        "--steps", str(steps), "--seq-len", str(seq), "--micro-batch", str(mb), "--lr", str(lr),
        "--clip", str(clip),
    ]  # fmt: skip
    n = point["dp"] * point["sp"]
    ours_runs, ds_runs = [], []
    try:
        for _ in range(repeats):
            ours, ours_cmd, ours_wall = run_worker("bench.ours_worker", n, args)
            log(f"  ours {point}: {ours_wall:.0f} s")
            ds, ds_cmd, ds_wall = run_worker("bench.ds_worker", n, args, python=DS_PYTHON)
            log(f"  deepspeed {point}: {ds_wall:.0f} s")
            ours_runs.append(ours)
            ds_runs.append(ds)
    except WorkerFailed as e:
        log(f"  {point}: FAILED {str(e).splitlines()[0]}")
        return {"point": point, "error": str(e)[-2000:], "errors": e.errors}
    ref = S.reference_run(
        S.ModelSpec(),
        steps=steps,
        dp_size=point["dp"],
        sp_size=point["sp"],
        mb=mb,
        seq_len=seq,
        lr=lr,
        clip=clip,
    )
    return {
        "point": point, "steps": steps, "seq": seq, "micro_batch": mb, "lr": lr, "clip": clip,
        "ours": _merge(ours_runs), "deepspeed": _merge(ds_runs), "reference": ref,
        "ours_command": ours_cmd, "deepspeed_command": ds_cmd,
    }  # fmt: skip


def run_deepspeed(smoke: bool, log) -> list[dict]:
    points = DS_POINTS[:1] if smoke else DS_POINTS
    steps, seq = (3, 32) if smoke else (20, 256)
    return [run_pair(p, steps=steps, seq=seq, repeats=1 if smoke else 2, log=log) for p in points]


def run_findings(pairs: list[dict], log) -> dict:
    """DeepSpeed runs that check the brief's claims; each result or error is recorded with its command."""
    out: dict = {"runs": []}

    def ds(name: str, n: int, args: list[str], ref: dict | None) -> None:
        try:
            res, cmd, wall = run_worker("bench.ds_worker", n, args, python=DS_PYTHON, timeout=300)
            entry = {"name": name, "command": cmd, "result": res, "reference": ref, "error": None}
        except WorkerFailed as e:
            cmd = str(e).splitlines()[0].rsplit(" failed", 1)[0]
            entry = {
                "name": name,
                "command": cmd,
                "result": None,
                "reference": ref,
                "error": e.errors or [str(e)],
            }
            wall = 0.0
        log(f"  findings {name}: {wall:.0f} s")
        out["runs"].append(entry)

    base = ["--steps", "3", "--seq-len", "64", "--sp", "2", "--dp", "1"]
    ref1 = S.reference_run(S.ModelSpec(), steps=3, dp_size=1, sp_size=2, mb=1, seq_len=64, lr=1e-2)
    ds("zero0", 2, [*base, "--zero", "0"], ref1)
    ds("mesh_param", 2, [*base, "--zero", "1", "--mesh-param"], ref1)
    ref2 = S.reference_run(S.ModelSpec(), steps=3, dp_size=1, sp_size=2, mb=2, seq_len=64, lr=1e-2)
    ds("micro_batch_2", 2, [*base, "--zero", "1", "--micro-batch", "2"], ref2)
    ds("unequal_lengths", 2, [*base, "--zero", "1", "--seq-lens", "64,32"], None)
    ds(
        "dp2_all_gather_recipe",
        4,
        [
            "--steps",
            "3",
            "--seq-len",
            "64",
            "--sp",
            "2",
            "--dp",
            "2",
            "--zero",
            "1",
            "--loss-combine",
            "all_gather",
        ],
        None,
    )
    # the P x gradient under Adam at a large lr: DeepSpeed vs the oracle with gradients x1 and x2
    kw = dict(steps=20, dp_size=1, sp_size=2, mb=1, seq_len=256, lr=1e-2)
    refa = S.reference_run(S.ModelSpec(), **kw)
    refa["losses_grad_x2"] = S.reference_run(S.ModelSpec(), grad_scale=2.0, **kw)["losses"]
    ds(
        "adam_lr1e-2",
        2,
        ["--steps", "20", "--seq-len", "256", "--sp", "2", "--dp", "1", "--zero", "1", "--lr", "0.01"],
        refa,
    )
    refs = S.reference_run(
        S.ModelSpec(), steps=3, dp_size=1, sp_size=2, mb=1, seq_len=64, lr=0.1, optim="sgd"
    )
    ds("sgd", 2, [*base, "--zero", "1", "--optim", "sgd", "--lr", "0.1"], refs)
    out["pairs"] = pairs
    return out


def run_alst_memory(out_dir: str, log) -> dict | None:
    """``python bench/bench_memory.py --out-dir OUT``: its JSON and markdown, included in our report."""
    script = ROOT / "bench" / "bench_memory.py"
    if not script.exists():
        log("  alst_memory: bench/bench_memory.py not present; skipped")
        return None
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(script), "--out-dir", out_dir], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    wall = time.perf_counter() - t0
    log(f"  alst_memory: {wall:.0f} s")
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:], "command": "python bench/bench_memory.py", "wall_s": wall}
    with open(os.path.join(out_dir, "bench_memory.json")) as f:
        data = json.load(f)
    with open(os.path.join(out_dir, "bench_memory.md")) as f:
        data["markdown"] = f.read()
    data["wall_s"] = wall
    return data


def previous_alst_memory(out_dir: str) -> dict | None:
    """The last ``python bench/bench_memory.py`` results in ``out_dir``, if any (marked as such)."""
    path = os.path.join(out_dir, "bench_memory.json")
    if not os.path.exists(path) or not os.path.exists(path[:-5] + ".md"):
        return None
    with open(path) as f:
        data = json.load(f)
    with open(path[:-5] + ".md") as f:
        data["markdown"] = f.read()
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(os.path.getmtime(path)))
    data["included_from"] = f"{os.path.relpath(path, ROOT)} (written {stamp})"
    return data


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, ulysses-sp sections only (CI)")
    ap.add_argument("--sections", default=None, help=f"comma list of {','.join(SECTIONS)}")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument(
        "--render", metavar="JSON", help="only re-render the markdown (and README section) from a result"
    )
    args = ap.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            result = json.load(f)
        result.pop("derived", None)
        name = "smoke" if result.get("smoke") else "bench"
        print(report.write(result, args.out_dir, name=name))
        if not result.get("smoke"):
            report.write_readme(result, str(ROOT / "docs" / "readme" / "performance.md"))
        return 0
    sections = (
        args.sections.split(",")
        if args.sections
        else list(SMOKE_SECTIONS if args.smoke else DEFAULT_SECTIONS)
    )
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    needs_ds = {"deepspeed", "findings"} & set(sections)
    if needs_ds and not deepspeed_available():
        print(
            f"bench: sections {sorted(needs_ds)} need DeepSpeed: run `bash bench/setup_deepspeed.sh` first; skipping",
            file=sys.stderr,
        )
        sections = [s for s in sections if s not in needs_ds]

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    invocation = (
        "python -m bench"
        + (" --smoke" if args.smoke else "")
        + (f" --sections {args.sections}" if args.sections else "")
    )
    result: dict = {"invocation": invocation, "machine": machine(), "smoke": args.smoke, "sections": sections}
    records, launches = run_library_sections(sections, args.smoke, log)
    result["records"], result["launches"] = records, launches
    if "alst_memory" in sections:
        result["alst_memory"] = run_alst_memory(args.out_dir, log)
    elif "memory" in sections and not args.smoke:
        result["alst_memory"] = previous_alst_memory(args.out_dir)
    if "deepspeed" in sections or "findings" in sections:
        pairs = run_deepspeed(args.smoke, log)
        result["deepspeed"] = pairs if "deepspeed" in sections else []
        if "findings" in sections:
            result["findings"] = run_findings(pairs, log)
    if "projection" in sections:
        result["projection"] = report.projection_inputs(records)
        result["projection"]["rows"] = proj.projections(
            act_units=result["projection"]["act_units"], comm_ratio=result["projection"]["comm_ratio"]
        )
    result["wall_s"] = time.perf_counter() - t0
    summary = report.write(result, args.out_dir, name="smoke" if args.smoke else "bench")
    if not args.smoke and not args.sections:
        report.write_readme(result, str(ROOT / "docs" / "readme" / "performance.md"))
    log(summary)
    log(f"bench: done in {result['wall_s']:.0f} s -> {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
