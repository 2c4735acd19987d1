"""``ulysses-sp eval`` of a run, as a new user types it: with no flags it evaluates what the run
trained on (data, chat template, loss mode, eval split, sequence length, micro-batch, sp — from the checkpoint's
manifest), with the processes ``--sp`` needs; flags still override. One tiny chat run (2 processes,
sp 2, 12 steps), three evals."""

from __future__ import annotations

import json
import random

import pytest
from chatdata import CHATML, conversation, write_jsonl
from test_cli import cli

from ulysses_sp.cli.main import main


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-run")
    rng = random.Random(0)
    data = write_jsonl(root / "chats.jsonl", [{"messages": conversation(rng)} for _ in range(200)])
    (root / "chatml.jinja").write_text(CHATML)
    cli("train", "--model", "tiny-llama", "--data", data, "--chat-template", str(root / "chatml.jinja"),
        "--loss-on", "assistant", "--eval-split", "0.2", "--seq-len", "64", "--micro-batch-size", "2",
        "--steps", "12", "--lr", "3e-3", "--sp", "2", "--nproc", "2", "--no-progress", "--no-plot", "--timeout", "60",
        "--output-dir", str(root / "run"), "--data-cache", str(root / "cache"), "--data-workers", "1")  # fmt: skip
    return root


def _eval(root, name: str, *flags: str) -> dict:
    out = root / f"{name}.json"
    cli("eval", "--model", str(root / "run"), "--output-json", str(out), "--plot", "none", "--timeout", "60",
        "--data-cache", str(root / "cache"), *flags)  # fmt: skip
    return json.loads(out.read_text())["results"][0]


def test_eval_of_a_run_defaults_to_its_own_data_settings_and_layout(chat_run, capsys):
    root = chat_run
    bare = _eval(
        root, "bare"
    )  # no flags: the run's chats, template, --loss-on, split, seq_len, sp 2 (2 processes)
    explicit = _eval(root, "explicit", "--data", str(root / "chats.jsonl"), "--chat-template",
                     str(root / "chatml.jinja"), "--loss-on", "assistant", "--eval-split", "0.2", "--seq-len", "64",
                     "--sp", "2")  # fmt: skip  # no --nproc: --sp 2 launches 2 processes
    assert bare["data"] == str(root / "chats.jsonl") and bare["sp"] == 2 and bare["seq_len"] == 64
    assert bare["tokens"] == explicit["tokens"] > 0
    assert bare["loss"] == pytest.approx(explicit["loss"], rel=1e-9)
    assert bare["loss"] < 5.0  # the learned chat task, not the recall task's ~ln 259 of an untrained task
    # explicit flags still override the run's (here in this process: one rank, no SP, shorter blocks)
    main(["eval", "--model", str(root / "run"), "--sp", "1", "--nproc", "1", "--seq-len", "32", "--plot", "none",
          "--output-json", str(root / "override.json"), "--data-cache", str(root / "cache")])  # fmt: skip
    override = json.loads((root / "override.json").read_text())["results"][0]
    assert override["sp"] == 1 and override["seq_len"] == 32 and override["data"] == bare["data"]


def test_eval_of_a_run_takes_its_micro_batch(chat_run):
    """The run's micro-batch (2) unless given: what ``train`` ran, not ``eval``'s default of 8."""
    from ulysses_sp.cli.args import build_parser
    from ulysses_sp.cli.evaluate import EvalConfig, eval_options

    def options(*flags: str) -> EvalConfig:
        return eval_options(build_parser().parse_args(["eval", "--model", str(chat_run / "run"), *flags]))[0]

    assert options().micro_batch_size == 2 != EvalConfig.micro_batch_size
    assert options("--micro-batch-size", "5").micro_batch_size == 5
    assert eval_options(build_parser().parse_args(["eval", "--model", "tiny-llama"]))[0].micro_batch_size == 8


def test_eval_of_a_run_takes_its_attention(chat_run, tmp_path):
    """A run trained with --attn eager (gpt-oss needs it) is evaluated with eager unless --attn says otherwise."""
    import json
    import shutil

    from ulysses_sp.cli.args import build_parser
    from ulysses_sp.cli.evaluate import eval_options
    from ulysses_sp.state import checkpoint as ckpt

    saved = ckpt.list_checkpoints(str(chat_run / "run"))[-1][1]
    copy = tmp_path / "ckpt"
    shutil.copytree(saved, copy)
    manifest = json.loads((copy / ckpt.MANIFEST).read_text())
    manifest["run"]["attn"] = "eager"
    (copy / ckpt.MANIFEST).write_text(json.dumps(manifest))

    def attn(*flags: str) -> str:
        return eval_options(build_parser().parse_args(["eval", "--model", str(copy), *flags]))[0].attn

    assert attn() == "eager" and attn("--attn", "sdpa") == "sdpa"
    assert eval_options(build_parser().parse_args(["eval", "--model", "tiny-llama"]))[0].attn == "sdpa"
