"""The run-level check (``run.resolve``): checked once, resolved once, and what it refuses.

- a ``train`` run tokenizes its corpus once and loads its tokenizer and model config once: the
  launching process resolves the run and the ranks build from it (counted in this process through
  ``ulysses-sp train --nproc 1``, whose one rank gets the resolved run as ``--nproc N``'s do: by
  argument); a resolved run pickles (as the ranks receive it) without its token cache being copied;
- data that trains nothing is refused, a sample whose scored tokens truncation removes is counted
  in a warning; a malformed JSONL line, a chat template that fails to render, a damaged token cache
  and a damaged checkpoint are each named by file (and line, sample, previous checkpoint);
- ``datasets`` formats (``.parquet``, a ``save_to_disk`` directory) train through the CLI;
- a worker stopped by SIGTERM is named with the signal; "see the errors above" only when there are some.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import shutil
import signal

import numpy as np
import pytest
from chatdata import CHATML, chat_tokenizer, conversation, write_jsonl

from ulysses_sp import tasks
from ulysses_sp.cli.main import main
from ulysses_sp.data import cache as data_cache
from ulysses_sp.run import checks as run_checks
from ulysses_sp.run.config import RunConfig
from ulysses_sp.run.resolve import resolve_run
from ulysses_sp.run.stops import EXIT_PEER_LOST, FailureWatch, Stopped, blame, run_reporting
from ulysses_sp.tasks import DataSettings, build_local_dataset
from ulysses_sp.tasks import text as tasks_text


def _chats(path, n: int = 40, seed: int = 0, **kw) -> str:
    rng = random.Random(seed)
    return write_jsonl(path, [{"messages": conversation(rng, **kw)} for _ in range(n)])


@pytest.fixture
def counted(monkeypatch):
    """Counts of the expensive steps a run takes, in this process."""
    counts = {"tokenize_text": 0, "tokenize_cache": 0, "tokenizer": 0, "model_config": 0}

    def counting(module, name, key):
        fn = getattr(module, name)

        def wrapper(*a, **k):
            counts[key] += 1
            return fn(*a, **k)

        monkeypatch.setattr(module, name, wrapper)

    counting(tasks_text, "tokenize_to_blocks", "tokenize_text")
    counting(data_cache, "_tokenize_all", "tokenize_cache")
    counting(tasks, "run_tokenizer", "tokenizer")
    counting(run_checks, "model_config", "model_config")
    return counts


def _train_in_process(tmp_path, data: str, *extra: str) -> str:
    out = tmp_path / "run"
    main(["train", "--model", "tiny-llama", "--data", data, "--seq-len", "64", "--micro-batch-size", "2",
          "--steps", "2", "--save-every", "1", "--sp", "1", "--nproc", "1", "--no-progress", "--output-dir",
          str(out), "--data-cache", str(tmp_path / "cache"), *extra])  # fmt: skip
    return str(out)


def test_a_run_tokenizes_its_text_once_and_loads_config_and_tokenizer_once(tmp_path, counted):
    data = tmp_path / "corpus.txt"
    data.write_text(" ".join(f"word{i % 37}" for i in range(3000)))
    _train_in_process(tmp_path, str(data))
    # before the run-level check: the launcher and every rank's validate and loop each tokenized
    assert counted == {"tokenize_text": 1, "tokenize_cache": 0, "tokenizer": 1, "model_config": 1}


def test_a_chat_run_builds_its_token_cache_once_and_ranks_get_it_by_path(tmp_path, counted):
    data = _chats(tmp_path / "chat.jsonl")
    (tmp_path / "t.jinja").write_text(CHATML)
    out = _train_in_process(tmp_path, data, "--chat-template", str(tmp_path / "t.jinja"))
    assert counted == {"tokenize_text": 0, "tokenize_cache": 1, "tokenizer": 1, "model_config": 1}
    assert [json.loads(line)["step"] for line in open(os.path.join(out, "metrics.jsonl"))] == [1, 2]
    # what a rank receives: the corpus travels as its cache path and is memory-mapped on arrival
    cfg = RunConfig(data=data, seq_len=64, chat_template=str(tmp_path / "t.jinja"), output_dir=str(tmp_path / "o"),
                      data_cache=str(tmp_path / "cache"))  # fmt: skip
    resolved = resolve_run(cfg, 2)
    blob = pickle.dumps(resolved)
    corpus = resolved.dataset.corpus
    assert len(blob) < corpus.ids.nbytes  # not copied into the message
    arrived = pickle.loads(blob).dataset
    assert isinstance(arrived.corpus.ids, np.memmap) and arrived.corpus.path == corpus.path
    assert all((arrived[i]["labels"] == resolved.dataset[i]["labels"]).all() for i in range(len(arrived)))
    assert counted["tokenize_cache"] == 1  # resolving again read the cache


def test_tokens_per_s_counts_the_real_tokens_not_the_padding(tmp_path):
    from ulysses_sp.data import sp_dataloader

    data = _chats(tmp_path / "chat.jsonl", n=12)
    (tmp_path / "t.jinja").write_text(CHATML)
    # --packing none: each chat its own row of --seq-len 512, right-padded
    out = _train_in_process(tmp_path, data, "--chat-template", str(tmp_path / "t.jinja"), "--packing", "none",
                            "--seq-len", "512")  # fmt: skip
    cfg = RunConfig(data=data, seq_len=512, chat_template=str(tmp_path / "t.jinja"), output_dir=str(tmp_path / "o"),
                    data_cache=str(tmp_path / "cache"), packing="none", sp=1)  # fmt: skip
    rows = resolve_run(cfg, 1).dataset
    order = sp_dataloader(range(len(rows)), batch_size=2, dp_size=1, sp_size=1, dp_rank=0, sp_rank=0, seed=0)
    real = [sum(int(rows[int(i)]["attention_mask"].sum()) for i in batch) for batch in order][:2]
    metrics = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [m["tokens"] for m in metrics] == [real[0], real[0] + real[1]]  # exactly the real tokens
    assert metrics[-1]["tokens"] < 2 * 2 * 512  # fewer than rows x seq_len: the padding is not counted
    assert all(m["tokens_per_s"] > 0 for m in metrics)


def _cfg(tmp_path, data: str, **kw) -> RunConfig:
    return RunConfig(data=data, seq_len=kw.pop("seq_len", 64), output_dir=str(tmp_path / "out"),
                       data_cache=str(tmp_path / "cache"), data_workers=1, **kw)  # fmt: skip


def test_data_that_trains_nothing_is_refused_and_truncated_samples_are_counted(tmp_path, caplog):
    (tmp_path / "t.jinja").write_text(CHATML)
    tpl = str(tmp_path / "t.jinja")
    users_only = write_jsonl(tmp_path / "u.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}] * 8)
    with pytest.raises(ValueError, match=r"no token is scored.*8 of 8 samples have no scored token"):
        resolve_run(_cfg(tmp_path, users_only, chat_template=tpl, loss_on="assistant"), 2)
    # the assistant's turn starts past --seq-len 32: truncation cuts every scored token away
    long_user = [{"role": "user", "content": "x" * 40}, {"role": "assistant", "content": "ok"}]
    cut = write_jsonl(tmp_path / "cut.jsonl", [{"messages": long_user}] * 8)
    with pytest.raises(ValueError, match=r"no token is scored.*8 of 8 samples have their scored tokens only past "
                                         r"--seq-len 32 \(truncated away\)"):  # fmt: skip
        resolve_run(_cfg(tmp_path, cut, chat_template=tpl, seq_len=32), 2)
    # some samples keep theirs: trains, with a warning counting the others
    short = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "ok"}]
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"messages": long_user}] * 3 + [{"messages": short}] * 5)
    with caplog.at_level(logging.WARNING):
        resolve_run(_cfg(tmp_path, mixed, chat_template=tpl, seq_len=32), 2)
    assert "3 of 8 samples have their scored tokens only past --seq-len 32 (truncated away)" in caplog.text


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    lines = [
        json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
    ] * 5
    lines[3] = '{"messages": [ oops'
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"{path}:4 is not valid JSON \(Expecting value at column 16\)"):
        build_local_dataset(str(path), tokenizer=chat_tokenizer(), seq_len=64, seed=0,
                            settings=DataSettings(data_cache=str(tmp_path / "c"), data_workers=1))  # fmt: skip


@pytest.mark.parametrize(
    "template, match",
    [
        ("{% for m in messages %}{{ m['content'] }{% endfor %}", r"has a Jinja syntax error at line 1: unexpected '}'"),
        ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}"
         "{{ m['content'] }}{% endfor %}", r"refused the sample \(raise_exception\): no system turns"),
    ],
)  # fmt: skip
def test_a_chat_template_that_fails_names_the_file_and_the_sample(tmp_path, template, match):
    rng = random.Random(0)
    rows = [{"messages": conversation(rng, system=False)} for _ in range(3)] + [
        {"messages": conversation(rng)}
    ]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    tpl = tmp_path / "bad.jinja"
    tpl.write_text(template)
    sample = (
        0 if "syntax" in match else 3
    )  # a syntax error fails the first render; raise_exception its sample
    with pytest.raises(ValueError, match=rf"chat.jsonl', sample {sample}: the chat template {tpl} {match}"):
        build_local_dataset(data, tokenizer=chat_tokenizer(), seq_len=64, seed=0,
                            settings=DataSettings(data_cache=str(tmp_path / "c"), data_workers=1, chat_template=str(tpl)))  # fmt: skip


def test_a_truncated_token_cache_is_named_with_how_to_fix_it(tmp_path):
    data = _chats(tmp_path / "chat.jsonl", n=8)
    settings = DataSettings(data_cache=str(tmp_path / "c"), data_workers=1)
    ds = build_local_dataset(data, tokenizer=chat_tokenizer(), seq_len=128, seed=0, settings=settings)
    ids = os.path.join(ds.corpus.path, "ids.npy")
    with open(ids, "r+b") as f:
        f.truncate(os.path.getsize(ids) // 2)
    with pytest.raises(
        ValueError, match=rf"tokenization cache entry {ds.corpus.path} is damaged .*delete that directory"
    ):
        build_local_dataset(data, tokenizer=chat_tokenizer(), seq_len=128, seed=0, settings=settings)


def test_a_damaged_checkpoint_is_named_with_the_previous_one(tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_text(" ".join(f"word{i % 37}" for i in range(3000)))
    out = _train_in_process(tmp_path, str(data))
    resume = RunConfig(data=str(data), seq_len=64, micro_batch_size=2, steps=3, sp=1, output_dir=out,
                         resume="latest", data_cache=str(tmp_path / "cache"))  # fmt: skip
    resolve_run(resume, 1)  # whole: fine
    first = os.path.join(out, "checkpoint-1")
    for rel in (
        "manifest.json",
        "model.safetensors",
        "training_state/rank0.pt",
        "training_state/dcp/__0_0.distcp",
    ):
        shutil.rmtree(os.path.join(out, "checkpoint-2"))
        shutil.copytree(first, os.path.join(out, "checkpoint-2"))
        victim = os.path.join(out, "checkpoint-2", rel)
        with open(victim, "r+b") as f:
            f.truncate(os.path.getsize(victim) // 2)
        with pytest.raises(ValueError, match=rf"{victim} is damaged .*; resume from the previous checkpoint "
                                             rf"instead: --resume {first}$"):  # fmt: skip
            resolve_run(resume, 1)


def test_datasets_formats_train_through_the_cli(tmp_path):
    from datasets import Dataset

    rows = [json.loads(line) for line in open(_chats(tmp_path / "chat.jsonl", n=40))]
    Dataset.from_list(rows).to_parquet(str(tmp_path / "chat.parquet"))
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "t.jinja").write_text(CHATML)
    for data in ("chat.parquet", "saved"):  # refused before: "expected a .txt or .jsonl file"
        out = tmp_path / f"run-{data}"
        main(["train", "--model", "tiny-llama", "--seq-len", "128", "--micro-batch-size", "2", "--steps", "1",
              "--sp", "1", "--nproc", "1", "--no-progress", "--data", str(tmp_path / data), "--chat-template",
              str(tmp_path / "t.jinja"), "--data-cache", str(tmp_path / "cache"), "--output-dir", str(out)])  # fmt: skip
        manifest = json.loads((out / "checkpoint-1" / "manifest.json").read_text())
        names = [f[0] for f in manifest["data_fingerprint"]["files"]]
        assert names == (["chat.parquet"] if data == "chat.parquet" else sorted(os.listdir(tmp_path / data)))


def test_a_worker_stopped_by_sigterm_is_named_and_errors_are_pointed_at_only_when_reported(tmp_path):
    watch = FailureWatch()
    try:

        def stopped():
            raise Stopped(signal.SIGTERM)

        with pytest.raises(SystemExit) as e:  # rank 1 alone got SIGTERM: the first to end
            run_reporting(1, stopped, None, failed_dir=watch.path)
        assert e.value.code == 143
        with pytest.raises(SystemExit):  # then rank 0 lost its peer
            run_reporting(0, lambda: (_ for _ in ()).throw(ValueError("x")), None, failed_dir=watch.path)
        failures = watch.exit_codes({0: EXIT_PEER_LOST})  # the launcher saw only rank 0 fail
        assert blame(failures, 2, 60) == "rank 1 was stopped by SIGTERM (exit 143)"
    finally:
        shutil.rmtree(watch.path, ignore_errors=True)
    later = FailureWatch()
    try:  # a rank stopped after another failed (the launcher's own SIGTERM) is not blamed
        with pytest.raises(SystemExit):
            run_reporting(0, lambda: (_ for _ in ()).throw(ValueError("bad")), None, failed_dir=later.path)
        with pytest.raises(SystemExit):
            run_reporting(1, stopped, None, failed_dir=later.path)
        assert blame(later.exit_codes({0: 1}), 2, 60) == "rank 0 (exit 1); see the errors above"
    finally:
        shutil.rmtree(later.path, ignore_errors=True)
    assert blame({1: 7}, 2, 60) == "rank 1 (exit 7); it exited without reporting an error"
