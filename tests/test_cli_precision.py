"""``ulysses-sp train`` with ``--dtype bf16 --cpu-offload --save-dtype`` on a local HF model at ZeRO 3
(loaded shard by shard), then ``--resume`` on another layout (sp 2 -> 1, ZeRO 3 -> 2, 2 -> 1
processes; dp stays 1) continuing the same losses within the bf16 tolerance of ``test_precision``.
"""

from __future__ import annotations

import pytest
import torch
from test_cli import cli, metrics

from ulysses_sp import tasks
from ulysses_sp.cli.main import main

BF16_RTOL = 3e-2  # see test_precision: SP vs no-SP rounding in bf16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "tiny"
    model = tasks.build_model("tiny-llama", vocab_size=tasks.VOCAB_SIZE, seed=5)
    model.save_pretrained(path, max_shard_size="100KB")  # sharded, with an index
    return path


def test_bf16_offload_sharded_load_then_resume_on_another_layout(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    common = ("--model", str(model_dir), "--tokenizer", "byte", "--seq-len", "32", "--micro-batch-size", "2", "--no-progress", "--no-plot",
              "--timeout", "60", "--steps", "4", "--output-dir", str(out), "--dtype", "bf16", "--save-dtype", "bf16")  # fmt: skip
    proc = cli(
        "train",
        *common,
        "--sp",
        "2",
        "--nproc",
        "2",
        "--zero-stage",
        "3",
        "--cpu-offload",
        "--save-every",
        "2",
    )
    assert (
        "precision bf16 (fp32 master weights" in proc.stderr
        and "CPU offload of model states on" in proc.stderr
    )
    assert "checkpoints saved in bf16; weights loaded shard by shard" in proc.stderr
    first = metrics(out)
    assert [m["step"] for m in first] == [1, 2, 3, 4] and len({m["loss"] for m in first}) == 4
    model = AutoModelForCausalLM.from_pretrained(out / "checkpoint-4", local_files_only=True)
    assert model.dtype == torch.bfloat16
    # one process: the CLI runs it without a launcher, here in this process
    main(["train", *common, "--sp", "1", "--nproc", "1", "--zero-stage", "2", "--resume", str(out / "checkpoint-2")])
    resumed = metrics(out)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4] and resumed[:2] == first[:2]
    for a, b in zip(first[2:], resumed[2:], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=BF16_RTOL)


def test_precision_flags_are_checked_before_any_process(capsys, tmp_path):
    from test_cli import _fails

    base = ["train", "--output-dir", str(tmp_path / "x"), "--no-progress"]
    assert "--cpu-offload needs --zero-stage 3 (got 2)" in _fails(
        capsys, *base, "--zero-stage", "2", "--cpu-offload"
    )
    assert "invalid choice: 'fp8'" in _fails(capsys, *base, "--dtype", "fp8")
    assert not (tmp_path / "x").exists()
