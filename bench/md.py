"""Markdown tables and the provenance of a run: the leaf every report of bench/ imports (stdlib only).

``provenance(invocation)`` records where and when a run happens (date, commit, host, machine, the command,
wall time once ``finish``-ed); ``label(run)`` is the one line that heads every table it produced; ``page(path,
title, run, body)`` writes a results page headed by that line.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def table(header: list[str], rows: list[list]) -> str:
    cell = lambda c: " ".join(str(c).split()).replace("|", "\\|")  # noqa: E731  (one line, no stray column)
    lines = ["| " + " | ".join(map(cell, header)) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(map(cell, row)) + " |" for row in rows])


def git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def command(module: str, argv: list[str] | None) -> str:
    """``python -m MODULE ARGS`` as the user typed it (``argv``, or the process's own)."""
    return " ".join(["python -m " + module, *(sys.argv[1:] if argv is None else argv)])


def provenance(invocation: str, *, backend: str = "gloo (CPU)") -> dict:
    """Where and when this run happens: the label every table it produces carries."""
    import torch
    import transformers

    now = datetime.datetime.now(datetime.timezone.utc)
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results", ":!README.md",
                ":!docs/readme/performance.md")  # fmt: skip
    commit = (git("rev-parse", "--short", "HEAD") or "unknown") + ("+uncommitted changes" if dirty else "")
    machine = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
               "cpus": os.cpu_count(), "python": sys.version.split()[0], "torch": torch.__version__,
               "transformers": transformers.__version__, "backend": backend}  # fmt: skip
    return {"id": f"{now:%Y-%m-%dT%H:%MZ}@{commit.split('+')[0]}", "date": f"{now:%Y-%m-%d %H:%M UTC}",
            "commit": commit, "host": platform.node(), "machine": machine, "invocation": invocation,
            "wall_s": None, "started": time.time(), "launches": []}  # fmt: skip


def finish(run: dict) -> dict:
    run["wall_s"] = time.time() - run["started"]
    return run


def label(run: dict) -> str:
    m = run["machine"]
    wall = "not recorded" if run.get("wall_s") is None else f"{run['wall_s']:.0f} s"
    return (f"run `{run['id']}`: `{run['invocation']}` on {run['date']}, commit {run['commit']}, host "
            f"{run['host']} ({m['processor']}, {m['cpus']} CPU cores, {m['platform']}; Python {m['python']}, "
            f"torch {m['torch']}, transformers {m['transformers']}, {m['backend']}), wall time {wall}")  # fmt: skip


def data(result: dict, section: str, default=None):
    """A section's data in a results JSON (``{"runs": {id: run}, "sections": {name: {"run": id, "data": ...}}}``)."""
    s = result["sections"].get(section)
    return default if s is None else s["data"]


def produced_by(result: dict, section: str) -> str:
    return f"*Produced by {label(result['runs'][result['sections'][section]['run']])}.*"


def page(path: str | Path, title: str, run: dict, body: list[str]) -> str:
    """Write ``# title``, the run's label and ``body`` (paragraphs and tables) to ``path``; return the text."""
    text = "\n\n".join([f"# {title}", f"*Produced by {label(finish(run))}.*", *body]) + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    Path(path).write_text(text, encoding="utf-8")
    print(text)  # noqa: T201 - a script's report
    return text
