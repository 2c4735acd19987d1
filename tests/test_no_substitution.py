"""Nothing stands in silently for what the user named (issue 32, item 4), each refused before launch in
one line naming the fix: a model directory without a tokenizer (unless ``--tokenizer DIR`` or
``--tokenizer byte`` names one), a config whose ``vocab_size`` does not cover its special token ids,
and a checkpoint missing a saving rank's ``training_state/rank<r>.pt`` (never rank 0's in its place;
a resume on more ranks than saved still reshards). In process: the checks run before any worker."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ulysses_sp import tasks
from ulysses_sp.cli.main import main
from ulysses_sp.run.config import RunConfig
from ulysses_sp.run.resolve import resolve_run
from ulysses_sp.state import checkpoint as ckpt


def _fails(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.fixture(scope="module")
def bare_dir(tmp_path_factory):
    """A Llama directory as ``save_pretrained`` of the model alone writes it: config and weights, no tokenizer."""
    path = tmp_path_factory.mktemp("bare") / "llama"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def test_a_model_dir_without_a_tokenizer_is_refused_unless_one_is_named(bare_dir, tmp_path, capsys):
    out = ["--output-dir", str(tmp_path / "run"), "--seq-len", "32", "--sp", "1", "--nproc", "1"]
    err = _fails(capsys, "train", "--model", str(bare_dir), *out)
    assert f"--model '{bare_dir}' has no tokenizer (tokenizer_config.json or tokenizer.json)" in err
    assert "pass --tokenizer DIR" in err and "or --tokenizer byte" in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()
    err = _fails(capsys, "eval", "--model", str(bare_dir), "--seq-len", "32", "--sp", "1", "--nproc", "1",
                 "--output-json", str(tmp_path / "e.json"), "--plot", "none")  # fmt: skip
    assert "has no tokenizer" in err and "--tokenizer byte" in err
    # the fixes work: the byte-level tokenizer asked for by name, or a tokenizer directory
    cfg = RunConfig(model=str(bare_dir), seq_len=32, sp=1, steps=1, output_dir=str(tmp_path / "a"))
    assert len(resolve_run(replace(cfg, tokenizer="byte"), 1).tokenizer) == tasks.VOCAB_SIZE
    tasks.byte_tokenizer().save_pretrained(tmp_path / "tok")
    assert len(resolve_run(replace(cfg, tokenizer=str(tmp_path / "tok")), 1).tokenizer) == 259
    assert "--tokenizer 'nope': no such directory (or 'byte'" in _fails(
        capsys, "train", "--model", str(bare_dir), "--tokenizer", "nope", *out
    )
    # a preset keeps its embedded byte-level tokenizer; a directory with its own tokenizer uses it
    assert len(tasks.run_tokenizer(None, "tiny-llama")) == tasks.VOCAB_SIZE
    with_tok = tmp_path / "with-tok"
    shutil.copytree(bare_dir, with_tok)
    tasks.byte_tokenizer().save_pretrained(with_tok)
    assert tasks.run_tokenizer(None, str(with_tok)).pad_token == "<pad>"


def test_a_config_whose_vocab_does_not_cover_its_special_ids_is_refused_in_one_line(bare_dir, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(bare_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "pad_token_id": 300, "vocab_size": 259}))
    err = _fails(capsys, "train", "--model", str(bad), "--tokenizer", "byte", "--seq-len", "32", "--sp", "1",
                 "--nproc", "1", "--output-dir", str(tmp_path / "run"))  # fmt: skip
    assert (
        f"config.json has pad_token_id 300 but vocab_size 259 (ids 0..258): the embedding has no row for it; set "
        f"vocab_size to at least 301 or pad_token_id to an id below 259 in {bad}/config.json" in err
    )
    assert "Padding_idx" not in err
    (bad / "config.json").write_text(json.dumps({**config, "eos_token_id": [2, 600]}))  # a list: each id
    assert "eos_token_id 600 but vocab_size 512" in _fails(capsys, "plan", "--model", str(bad))


def _one_step_run(tmp_path) -> tuple[str, RunConfig]:
    data = tmp_path / "corpus.txt"
    data.write_text(" ".join(f"word{i % 37}" for i in range(2000)))
    out = tmp_path / "run"
    main(["train", "--data", str(data), "--seq-len", "64", "--micro-batch-size", "2", "--steps", "1", "--sp", "1",
          "--nproc", "1", "--no-progress", "--output-dir", str(out), "--data-cache", str(tmp_path / "cache")])  # fmt: skip
    resume = RunConfig(data=str(data), seq_len=64, micro_batch_size=2, steps=2, sp=1, output_dir=str(out),
                       resume="latest", data_cache=str(tmp_path / "cache"))  # fmt: skip
    return os.path.join(out, "checkpoint-1"), resume


def test_a_checkpoint_missing_a_ranks_state_is_refused_as_damaged_naming_the_file(tmp_path):
    path, resume = _one_step_run(tmp_path)
    manifest_file = os.path.join(path, ckpt.MANIFEST)
    saved = json.loads(open(manifest_file).read())
    # as if saved by 2 ranks at sp 2 (dp 1, as this resume): a reshardable layout, but rank 1's file is gone
    saved["world"].update(world_size=2, sp=2)
    with open(manifest_file, "w") as f:
        json.dump(saved, f)
    rank1 = os.path.join(path, ckpt.STATE_DIR, "rank1.pt")
    with pytest.raises(ValueError, match=rf"--resume '{path}': {rank1} is damaged \(missing: the manifest says 2 "
                                         r"ranks saved this checkpoint, each writing its own rank<r>.pt\); no "
                                         r"earlier checkpoint"):  # fmt: skip
        resolve_run(resume, 1)
    with pytest.raises(ValueError, match=rf"is damaged: {rank1} is missing \(its manifest says 2 ranks"):
        ckpt.rank_state_file(path, 0, saved)  # what each rank would meet, were it launched anyway
    shutil.copy(os.path.join(path, ckpt.STATE_DIR, "rank0.pt"), rank1)
    resolve_run(resume, 1)  # whole: saved on 2 ranks, resumed on 1 (resharded)
    assert ckpt.rank_state_file(path, 1, saved) == rank1
    # saved on 2 ranks, resumed on 4: ranks 2 and 3 take rank 0's scheduler and RNG state
    assert ckpt.rank_state_file(path, 3, saved) == os.path.join(path, ckpt.STATE_DIR, "rank0.pt")


def test_attention_options_on_a_model_without_attention_are_refused_not_ignored(tmp_path, capsys):
    from hybrid_models import hybrid_config
    from transformers import AutoModelForCausalLM

    cfg = hybrid_config("mamba2")
    cfg.vocab_size = tasks.VOCAB_SIZE
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "mamba2")
    base = ["train", "--model", str(tmp_path / "mamba2"), "--tokenizer", "byte", "--seq-len", "32", "--sp", "1",
            "--nproc", "1", "--output-dir", str(tmp_path / "run")]  # fmt: skip
    for flag in (["--attn-chunk", "16"], ["--offload-attention"], ["--head-chunks", "2"]):
        err = _fails(capsys, *base, *flag)
        assert f"{flag[0]}: --model '{tmp_path / 'mamba2'}' has no attention layers" in err, err
    assert "ring_size 2: the model has no attention layers" in _fails(capsys, *base, "--sp", "2", "--nproc", "2",
                                                                       "--ring-size", "2")  # fmt: skip
