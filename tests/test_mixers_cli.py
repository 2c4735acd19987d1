"""The CLI trains a local hybrid model directory (LFM2: short convolutions beside attention) and a pure
Mamba-1 directory (no attention layers at all) on packed documents at sp 2 exactly as at sp 1: the
same losses and gradient norms, step by step. A pure Mamba-2 directory takes the same no-attention
path with the Mamba-2 handler, whose training at sp 2 equals the run without SP through the engine the
CLI builds (packed, ZeRO 3: ``test_mixers_engine.py::test_hybrid_engine_zero3_equals_no_sp``) and under
the HF Trainer (``test_mixers_trainer.py::test_trainer_sp2_trains_pure_mamba2_as_without_sp``); its own
CLI run here only repeated those (one launch of ~15 s)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hybrid_models import hybrid_config

from ulysses_sp.cli.main import main


def _train(tmp_path, model: str, data: str, sp: int) -> list[dict]:
    out = tmp_path / f"run_sp{sp}"
    args = ["train", "--model", model, "--tokenizer", "byte", "--data", data, "--packing", "best-fit", "--seq-len", "96",
            "--sp", str(sp), "--nproc", str(sp), "--steps", "2", "--micro-batch-size", "1", "--no-progress", "--no-plot",
            "--output-dir", str(out), "--data-cache", str(tmp_path / "cache"), "--timeout", "120"]  # fmt: skip
    if sp == 1:  # one process: the CLI runs it without a launcher, here in this process
        main(args)
    else:
        proc = subprocess.run(
            [sys.executable, "-m", "ulysses_sp.cli.main", *args], capture_output=True, text=True, timeout=400
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("arch", ["lfm2", "mamba"])
def test_cli_trains_hybrid_and_pure_mamba_dirs_at_sp2_as_at_sp1(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    cfg = hybrid_config(arch)
    cfg.vocab_size = 259  # the embedded byte tokenizer's
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / arch)
    data = tmp_path / "docs.jsonl"
    g = torch.Generator().manual_seed(0)
    data.write_text(
        "".join(
            json.dumps({"text": "".join("abcdefgh "[i] for i in torch.randint(0, 9, (31,), generator=g))})
            + "\n"
            for _ in range(40)
        )
    )
    one, two = (_train(tmp_path, str(tmp_path / arch), str(data), sp) for sp in (1, 2))
    assert len(one) == len(two) == 2
    for a, b in zip(one, two):
        assert (
            abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"])
            and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"]
        )
