"""Refusals that name a fix: applying the fix the message names makes the run start (issue 32 item 5).

Each case runs ``ulysses-sp train`` with a bad combination in-process (the launcher replaced by a
recorder: nothing trains), checks the one-line refusal (exit 2), takes the fix **from the message**
(the value it suggests, where it names one) and runs again with it applied: the run must then reach
the launcher. Model-dependent refusals and their fixes are in ``test_prelaunch_model.py``; the tokenizer,
the special ids and damaged checkpoints in ``test_no_substitution.py``; the Trainer's in
``test_hf_trainer_other.py``; the mixers' sp sizes in ``test_mixers.py``.
"""

from __future__ import annotations

import re

import pytest

from ulysses_sp.cli import main as cli


def _drop(argv: list[str], flag: str, values: int = 1) -> list[str]:
    i = argv.index(flag)
    return argv[:i] + argv[i + 1 + values :]


def _set(argv: list[str], flag: str, value: str) -> list[str]:
    i = argv.index(flag)
    return argv[: i + 1] + [value] + argv[i + 2 :]


# (bad flags, the refusal (a regex; its groups are what the fix uses), the fixed flags from the match)
CASES = [
    (["--nproc", "3", "--sp", "2", "--seq-len", "66"], r"use --sp in \[1, (\d+)\]",
     lambda a, m: _set(a, "--sp", m[1])),
    (["--nproc", "3", "--sp", "2"], r"use --sp in \[1\] .* or --nproc a multiple of (\d+)",
     lambda a, m: _set(a, "--nproc", m[1])),
    (["--seq-len", "1001", "--sp", "2", "--nproc", "2"], r"use a multiple of 2, e\.g\. (\d+)",
     lambda a, m: _set(a, "--seq-len", m[1])),
    (["--warmup-steps", "5", "--warmup-ratio", "0.1"], r"both set the warmup; pass one of them",
     lambda a, m: _drop(a, "--warmup-ratio")),
    (["--offload-activations"], r"--offload-activations needs (--activation-checkpointing)",
     lambda a, m: [*a, m[1]]),
    (["--cpu-offload", "--zero-stage", "2"], r"pass --zero-stage (\d)", lambda a, m: _set(a, "--zero-stage", m[1])),
    (["--attn", "flash_attention_2"], r"use --attn (\w+) instead", lambda a, m: _set(a, "--attn", m[1])),
    (["--ring-size", "3", "--sp", "4", "--nproc", "4"], r"valid ring sizes for sequence_parallel_size 4: \[1, (\d+)",
     lambda a, m: _set(a, "--ring-size", m[1])),
]  # fmt: skip


@pytest.mark.parametrize("bad, refusal, fix", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_applying_the_fix_a_refusal_names_lets_the_run_start(bad, refusal, fix, tmp_path, capsys, monkeypatch):
    reached: list[int] = []
    monkeypatch.setattr(cli, "_launch", lambda *a, **k: reached.append(a[2]))
    monkeypatch.setattr(cli, "_run_rank", lambda *a, **k: reached.append(1))
    base = ["train", "--steps", "1", "--no-progress", "--output-dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_:
        cli.main([*base, *bad])
    assert exit_.value.code == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("ulysses-sp train: error: ")]
    assert len(lines) == 1, lines
    match = re.search(refusal, lines[0])
    assert match, lines[0]
    cli.main([*base, *fix(bad, match)])  # the fix the message named: no refusal
    assert len(reached) == 1, capsys.readouterr().err
