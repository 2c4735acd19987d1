"""The README's library example runs as documented (torchrun, 2 processes, sp=2)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_library_example_trains_with_sp2():
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        os.path.join(ROOT, "examples", "train_sp.py"),
        "--sp",
        "2",
        "--steps",
        "6",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step \d+ loss ([0-9.]+)", r.stdout)]
    assert len(losses) == 6, r.stdout
    # Six steps of a copy task from random init: the loss stays near chance (ln 64 = 4.16); what
    # this protects is that the documented API sequence runs and reports sane numbers.
    assert all(3.5 < x < 5.0 for x in losses), losses
    norms = [float(x) for x in re.findall(r"grad_norm ([0-9.]+)", r.stdout)]
    assert len(norms) == 6 and all(n > 0 for n in norms), r.stdout
