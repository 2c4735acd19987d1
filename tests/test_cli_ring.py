"""``ulysses-sp train`` beyond the head count: a 2-head model at ``--sp 4`` (auto: ring 2 x ulysses 2,
with tiled MLP, tiled loss and activation checkpointing) equals its plain ``--sp 1`` run step by step; a ring size that cannot work is refused before any process starts."""

from __future__ import annotations

import pytest
from test_cli import _fails, metrics, train, train_here
from transformers import LlamaConfig, LlamaForCausalLM

from ulysses_sp import tasks


@pytest.fixture(scope="module")
def two_heads(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "two-heads"
    cfg = LlamaConfig(vocab_size=tasks.VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def test_two_head_model_at_sp4_equals_sp1_step_by_step(two_heads, tmp_path):
    common = ("--model", str(two_heads), "--tokenizer", "byte", "--steps", "4", "--zero-stage", "3")
    train_here(tmp_path / "sp1", *common, "--sp", "1")
    alst = ("--tiled-mlp", "--tiled-loss", "--activation-checkpointing")  # exact: the sp 1 run has none
    proc = train(tmp_path / "sp4", *common, "--sp", "4", "--nproc", "4", *alst)
    assert "sp 4 (ring 2 x ulysses 2: ring attention)" in proc.stderr
    ref, ring = metrics(tmp_path / "sp1"), metrics(tmp_path / "sp4")
    assert len({m["loss"] for m in ring}) == 4  # it trains
    for a, b in zip(ref, ring, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


def test_ring_size_that_cannot_split_the_heads_is_refused_before_start(two_heads, tmp_path, capsys):
    # in this process: the checks run before the launcher would start any worker
    err = _fails(capsys, "train", "--model", str(two_heads), "--tokenizer", "byte", "--seq-len", "32", "--sp", "4", "--nproc", "4",
                 "--ring-size", "1", "--output-dir", str(tmp_path / "x"))  # fmt: skip
    assert "valid ring sizes for sequence_parallel_size 4: [2, 4]" in err
    err = _fails(capsys, "train", "--model", str(two_heads), "--tokenizer", "byte", "--seq-len", "36", "--sp", "4", "--nproc", "4",
                 "--output-dir", str(tmp_path / "y"))  # fmt: skip
    assert "--seq-len 36 is not divisible by 8 (sp 4 x 2 zigzag chunks per ring rank, ring size 2)" in err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
