"""Every ``--help`` read as a new user reads it: each default stated once and true (``train``'s are
``RunConfig``'s), nothing stale; and the data flags have one definition (``DataSettings``)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from ulysses_sp import tasks
from ulysses_sp.cli.args import build_parser
from ulysses_sp.cli.evaluate import EvalConfig, eval_options
from ulysses_sp.cli.flags import DATA_FLAGS
from ulysses_sp.cli.main import main
from ulysses_sp.run.config import RunConfig
from ulysses_sp.tasks import DataSettings


def _help(capsys, monkeypatch, *argv: str) -> dict[str, str]:
    """``flag -> its help text`` (one line per flag: a wide terminal)."""
    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    flags, last = {}, None
    for line in capsys.readouterr().out.splitlines():
        m = re.match(r"\s{2}(--[\w-]+)(?: \S+)*?(?:\s{2,}(.*))?$", line)
        if m:
            last = m.group(1)
            flags[last] = m.group(2) or ""
        elif last and line.startswith(" " * 10):
            flags[last] += " " + line.strip()
    return flags


@pytest.mark.parametrize("command", ["train", "eval", "plan"])
def test_each_default_is_stated_once(capsys, monkeypatch, command):
    flags = _help(capsys, monkeypatch, command)
    assert len(flags) > 10
    for flag, text in flags.items():
        assert text.count("default") <= 1, (flag, text)
        assert "(default: None)" not in text and "(default: False)" not in text, (flag, text)


def test_train_help_states_train_config_defaults_and_the_data_formats(capsys, monkeypatch):
    flags = _help(capsys, monkeypatch, "train")
    cfg = RunConfig()
    for flag, field in (("--seq-len", "seq_len"), ("--sp", "sp"), ("--steps", "steps"), ("--dtype", "dtype"),
                        ("--model", "model"), ("--zero-partition", "zero_partition"), ("--report-to", "report_to"),
                        ("--max-nonfinite-steps", "max_nonfinite_steps")):  # fmt: skip
        value = getattr(cfg, field)
        assert (
            f"(default {value:g})" in flags[flag]
            if isinstance(value, float)
            else f"(default {value})" in flags[flag]
        )
    # the model's defaults: a random-init preset's recipe, or fine-tuning a model directory
    assert "default 0.01 for a preset (random init), 1e-05 for a model directory" in flags["--lr"]
    assert "default 8 for a preset, 1 for a model directory" in flags["--micro-batch-size"]
    for fmt in (".txt", ".jsonl", ".json", ".parquet", ".arrow", "save_to_disk"):
        assert fmt in flags["--data"]
    assert "default: --sp" in flags["--nproc"]
    assert "exit once saved" in flags["--save-on-signal"]


def test_plan_and_eval_help_are_current(capsys, monkeypatch):
    plan = _help(capsys, monkeypatch, "plan")
    assert "train runs today" not in plan["--dtype"] and "bf16/fp16" in plan["--dtype"]
    assert "(0, 1]" in plan["--mfu"] and "nothing fits" in plan["--offload-states"]
    evals = _help(capsys, monkeypatch, "eval")
    assert "default: --sp" in evals["--nproc"]
    for flag in ("--data", "--seq-len", "--sp", "--loss-on", "--chat-template", "--eval-split"):
        assert "the training run's" in evals[flag], flag


def test_data_flags_have_one_definition():
    fields = {f.name for f in dataclasses.fields(DataSettings)}
    assert {flag[2:].replace("-", "_") for flag, *_ in DATA_FLAGS} == fields  # flag for field, same names
    assert issubclass(RunConfig, DataSettings) and issubclass(EvalConfig, DataSettings)
    assert not hasattr(tasks, "DataFlags")
    cfg = RunConfig(data_cache="/c", data_workers=3, loss_on="all")
    assert cfg.data_settings() == DataSettings(data_cache="/c", data_workers=3, loss_on="all")
    ecfg, _ = eval_options(
        build_parser().parse_args(["eval", "--model", "tiny-llama", "--data-workers", "2"])
    )
    assert ecfg.data_settings() == DataSettings(data_workers=2) and ecfg.sp == 1
