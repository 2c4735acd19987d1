"""The one launcher of the suite: a worker module under ``torchrun`` (gloo, CPU), its JSON and exact command.

Every task (bench/workers.py, bench/alst_worker.py, bench/ours_worker.py, bench/ds_worker.py) is a
module run by ``run_worker``; it writes its result to ``--out`` from rank 0. The command recorded is
the one a reader can paste from the repository root to reproduce the row.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DS_PYTHON = ROOT / "bench" / ".venv-deepspeed" / "bin" / "python"


class WorkerFailed(RuntimeError):
    """A worker exited non-zero; ``.errors`` holds what each rank recorded (if anything)."""

    def __init__(self, message: str, errors: list[str]) -> None:
        super().__init__(message)
        self.errors = errors


def display_python(python: Path | str) -> str:
    p = Path(python)
    try:
        return str(p.relative_to(ROOT))
    except ValueError:
        return "python" if p == Path(sys.executable) else str(p)


def run_worker(
    module: str, nproc: int, args: list[str], *, python: Path | str | None = None, timeout: float = 600
) -> tuple[dict | list, str, float]:
    """``python -m torch.distributed.run --nproc-per-node N -m MODULE ARGS --out TMP``.

    Returns ``(result, command, wall_seconds)``; raises ``WorkerFailed`` with the ranks' error notes.
    """
    python = str(python or sys.executable)
    fd, out = tempfile.mkstemp(prefix="tmp-", suffix=".json", dir=ROOT / "bench" / "results")
    os.close(fd)
    os.unlink(out)
    base = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m", module]
    cmd = [python, *base, *args, "--out", out]
    shown = " ".join([display_python(python), *base, *map(shlex.quote, args)])
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)  # keep the caller's
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        wall = time.perf_counter() - t0
        errors = []
        for r in range(nproc):
            err = Path(f"{out}.rank{r}.err")
            if err.exists():
                errors.append(f"rank {r}: {err.read_text()}")
                err.unlink()
        if proc.returncode != 0 or not Path(out).exists():
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            raise WorkerFailed(f"{shown} failed (exit {proc.returncode}):\n{tail}", errors)
        with open(out) as f:
            return json.load(f), shown, wall
    finally:
        if os.path.exists(out):
            os.unlink(out)


def deepspeed_available() -> bool:
    return DS_PYTHON.exists() and (ROOT / "bench" / ".venv-deepspeed" / ".installed").exists()
