"""``bench/gpu_check.py`` keeps working where there is no GPU: it imports, refuses the CUDA-only part on
CPU with a message, and its ``--device cpu`` smoke runs the packed-documents table (the per-document sdpa
path exact against the dense block-diagonal reference, varlen reported as not used on CPU) and the
head-chunks table (2 gloo ranks, ``head_chunks`` 4 and the head-by-head exchange equal to 1 packed) end to end."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # bench/ is a top-level folder of the repository, not an installed package
    sys.path.insert(0, str(ROOT))

from bench import gpu_check  # noqa: E402


def test_states_part_needs_cuda():
    with pytest.raises(SystemExit, match=r"needs a CUDA device \(--device cpu: --only packed head-chunks\)"):
        gpu_check.main(["--device", "cpu"])


def _rows(text: str, first_cell: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith(f"| {first_cell} |")]  # fmt: skip


def test_cpu_smoke_runs_packed_and_head_chunk_tables(tmp_path):
    out = tmp_path / "gpu_check.md"
    gpu_check.main(["--device", "cpu", "--only", "packed", "head-chunks", "--out", str(out)])  # 128 and 64 tokens
    text = out.read_text()
    packed = {r[2]: r for r in _rows(text, "128")}
    assert set(packed) == {"dense fp32 (reference)", "dense mask", "segments", "varlen"}
    assert packed["segments"][1] == "19" and float(packed["segments"][5]) < 1e-5  # fp32: exact to rounding
    assert re.fullmatch(r"not used here \(cpu, torch.float32\)", packed["varlen"][6])
    chunked = {(r[1], r[2]): r for r in _rows(text, "64")}
    assert set(chunked) == {("1", "packed"), ("1", "headwise"), ("4", "auto"), ("4", "packed+overlap")}, text
    assert chunked["1", "packed"][5] == "(reference)" and float(chunked["1", "headwise"][5]) == 0.0  # data movement
    # the whole attention block per group sums the groups' gradients in fp32: the same rounding as the run itself
    # (measured at this setting, default-init weights: head_chunks 1 in fp32 is 6.6e-4 from float64, head_chunks 4
    # 8.3e-4; both equal to 1e-15 in float64)
    assert float(chunked["4", "auto"][5]) < 3e-3 and chunked["4", "auto"][3] == "n/a"  # no CUDA allocator on CPU
    assert chunked["4", "packed+overlap"][5] == chunked["4", "auto"][5]  # overlapped: the groups in turn's bits
