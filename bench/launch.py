"""The one launcher of the suite: a module under ``torchrun`` (gloo, CPU), its JSON and exact command.

Both sides of the protocol live here. The parent calls ``run_worker(module, nproc, args)``; each rank runs the
module under ``torchrun`` (``under_torchrun()`` is then true, so one module can be both the script and its
worker), calls ``init_worker()``, does its task and ``finish_worker(result, out)``: rank 0 writes the result
to ``--out``; ``parser`` and ``serve`` are that boilerplate of every script. The command recorded is the one a
reader can paste from the repository root to reproduce the row. Torch only: the DeepSpeed venv imports it too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DS_PYTHON = ROOT / "bench" / ".venv-deepspeed" / "bin" / "python"


class WorkerFailed(RuntimeError):
    """A worker exited non-zero (the message holds the command and the tail of its stderr)."""


def _shown(python: str) -> str:
    p = Path(python)
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else "python" if p == Path(sys.executable) else str(p)


def run_worker(module: str, nproc: int, args: list[str], *, python: Path | str | None = None, timeout: float = 600,
               launches: list | None = None) -> tuple[dict | list, str, float]:  # fmt: skip
    """``python -m torch.distributed.run --nproc-per-node N -m MODULE ARGS --out TMP``.

    Returns ``(result, command, wall_seconds)``, logs the last two (appended to ``launches`` too, when given);
    raises ``WorkerFailed`` when the worker fails.
    """
    python = str(python or sys.executable)
    out = os.path.join(tempfile.mkdtemp(prefix="bench-"), "result.json")  # the worker's rank 0 writes it
    base = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m", module]
    shown = " ".join([_shown(python), *base, *map(shlex.quote, args)])
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)  # keep the caller's
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([python, *base, *args, "--out", out], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout)  # fmt: skip
        if proc.returncode != 0 or not Path(out).exists():
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            raise WorkerFailed(f"{shown} failed (exit {proc.returncode}):\n{tail}")
        wall = time.perf_counter() - t0
        print(f"  {shown}: {wall:.0f} s", file=sys.stderr, flush=True)
        if launches is not None:
            launches.append({"command": shown, "wall_s": wall})
        return json.loads(Path(out).read_text()), shown, wall
    finally:
        shutil.rmtree(os.path.dirname(out), ignore_errors=True)


def deepspeed_available() -> bool:
    return DS_PYTHON.exists() and (ROOT / "bench" / ".venv-deepspeed" / ".installed").exists()


def under_torchrun() -> bool:
    """True in a rank that ``torchrun`` started (its agent sets ``TORCHELASTIC_RUN_ID``)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def parser(doc: str, out: str) -> argparse.ArgumentParser:
    """A script's parser, described by its docstring's first line, with ``--out`` (default bench/results/OUT)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / out))
    return ap


def serve(work, out: str, timeout_s: float = 600) -> bool:
    """In a torchrun rank: ``init_worker``, ``finish_worker(work(), out)`` and True; False in the parent."""
    if under_torchrun():
        init_worker(timeout_s)
        finish_worker(work(), out)
    return under_torchrun()


def init_worker(timeout_s: float = 600, *, deepspeed: bool = False) -> None:
    """This rank's gloo group (through DeepSpeed's ``init_distributed`` in its venv), one thread."""
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if deepspeed:
        import deepspeed as ds

        ds.init_distributed(dist_backend="gloo", timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    torch.set_num_threads(1)


def max_over_ranks(x, group=None):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return type(x)(t.item())  # ints stay ints (byte and FLOP counts)


def finish_worker(result, out: str | None) -> None:
    """Rank 0 writes ``result`` to ``out``; every rank tears its groups down (gloo threads joined now)."""
    import torch.distributed as dist

    if dist.get_rank() == 0 and out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    dist.barrier()
    try:
        from ulysses_sp.parallel.mesh import shutdown  # also empties DTensor's caches
    except ImportError:  # the DeepSpeed venv without this checkout's src/ on its path
        shutdown = dist.destroy_process_group
    shutdown()
