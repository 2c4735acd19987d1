"""Nothing silent, end to end (README, Reliability): ``ulysses-sp train`` as a user runs it.

Each run costs process start-up, so each test batches what one run can show: a diverging run
(skipped steps in the metrics, a loud non-zero exit naming the last good checkpoint, finite
checkpoints only, ``eval`` refusing NaN weights); a live run that a second run into the same
directory cannot disturb, then stopped by SIGTERM with ``--save-on-signal`` and by Ctrl-C; a rank
stopped with SIGSTOP, blamed by name, the run over within the collective timeout plus seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from test_cli import TINY, _fails, _last_spawned_worker, metrics, train

from ulysses_sp.cli.main import main


def _popen(out, *args: str, **kw) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ulysses_sp.cli.main", "train", *TINY, "--output-dir", str(out), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _wait_for(condition, proc: subprocess.Popen, what: str, limit: float = 180) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"no {what} after {limit} s"
        time.sleep(0.05)


def _last_step(out) -> int:
    """The last complete metrics line's step (0 if none yet); the file may be mid-rewrite."""
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    complete = [json.loads(line) for line in lines if line.endswith("}")]
    return complete[-1]["step"] if complete else 0


def _finite_weights(path) -> bool:
    from safetensors.torch import load_file

    return all(
        bool(torch.isfinite(t).all()) for t in load_file(os.path.join(path, "model.safetensors")).values()
    )


def test_diverging_run_skips_steps_stops_loud_and_never_saves_nan(tmp_path, capsys):
    out = tmp_path / "diverge"
    proc = train(out, "--steps", "12", "--lr", "1e6", "--grad-clip", "0", "--save-every", "2", check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    err = proc.stderr
    assert "training diverged: the loss or gradient norm was not finite in 3 steps in a row" in err
    assert "Last good checkpoint: " in err and "Try a lower --lr" in err
    assert "Traceback" not in err  # one line per rank, not a wall of stack frames
    records = metrics(out)
    skipped = [m for m in records if m.get("skipped")]
    assert skipped and all(m["skipped_steps"] >= 1 for m in skipped) and records[-1]["step"] < 12
    saved = sorted(p for p in os.listdir(out) if p.startswith("checkpoint-"))
    assert saved and all(_finite_weights(out / p) for p in saved)
    # eval of non-finite weights fails (a checkpoint whose weights a diverged run left as NaN)
    from safetensors.torch import load_file, save_file

    bad = out / "nan-ckpt"
    os.rename(out / saved[-1], bad)
    state = load_file(bad / "model.safetensors")
    state[next(iter(state))][0] = float("nan")
    save_file(state, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(SystemExit) as exc:
        main(["eval", "--model", str(bad), "--sp", "1", "--seq-len", "32", "--num-samples", "2", "--micro-batch-size", "2",
              "--output-json", str(tmp_path / "e.json"), "--plot", ""])  # fmt: skip
    assert exc.value.code == 1
    assert "the weights hold NaN or inf" in capsys.readouterr().err


def test_concurrent_run_refused_then_sigterm_saves_and_ctrl_c_stops_in_one_line(tmp_path, capsys):
    out = tmp_path / "live"
    first = _popen(out, "--steps", "400", "--save-on-signal", "600", start_new_session=True)
    try:
        _wait_for(lambda: _last_step(out) >= 2, first, "two steps")
        lock = json.loads((out / ".ulysses-sp.lock").read_text())
        for extra in ((), ("--overwrite",)):  # refused before any process starts: checked in this one
            err = _fails(capsys, "train", *TINY, "--output-dir", str(out), "--steps", "4", *extra)
            assert f"is in use by another ulysses-sp run: PID {lock['pid']} on host {lock['host']}" in err
        # SIGTERM (preemption) to the launcher: the ranks finish the step, save it, and stop — the
        # run ends once saved, not when the 600 s the save was given are over
        first.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        _, err = first.communicate(timeout=300)
        took = time.monotonic() - signalled
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert took < 240, took
    last = metrics(out)[-1]["step"]
    assert (
        f"stopped by SIGTERM; latest checkpoint: {out / f'checkpoint-{last}'} (continue with --resume)" in err
    )
    assert "Traceback" not in err and (out / f"checkpoint-{last}" / "model.safetensors").exists()

    # Ctrl-C: SIGINT to the whole process group, as a terminal sends it
    again = _popen(out, "--steps", "400", "--resume", start_new_session=True)
    try:
        _wait_for(lambda: _last_step(out) > last, again, "a resumed step")
        os.killpg(again.pid, signal.SIGINT)
        _, err = again.communicate(timeout=60)
    finally:
        if again.poll() is None:
            os.killpg(again.pid, signal.SIGKILL)
    assert again.returncode == 128 + signal.SIGINT, err[-3000:]
    assert f"stopped by SIGINT; latest checkpoint: {out / f'checkpoint-{last}'}" in err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err


def test_a_stopped_rank_is_named_and_the_run_ends_within_the_timeout(tmp_path):
    out = tmp_path / "hung"
    args = [a if a != "60" else "10" for a in TINY]  # --timeout 10
    cmd = [
        sys.executable,
        "-m",
        "ulysses_sp.cli.main",
        "train",
        *args,
        "--output-dir",
        str(out),
        "--steps",
        "400",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: _last_step(out) >= 1, proc, "a step")
        os.kill(_last_spawned_worker(proc.pid), signal.SIGSTOP)  # local rank 1 stops answering
        stopped_at = time.monotonic()
        _, err = proc.communicate(timeout=120)
        took = time.monotonic() - stopped_at
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]
    assert "failed: rank(s) 1 stopped answering: rank(s) 0 waited 10 s (--timeout)" in err, err[-3000:]
    # the stopped rank was ended by the launcher's watch after its 3 s grace, not by the elastic agent's
    # 30 s stop (the old behaviour: 40 s or more); the bound only catches a hang (a loaded machine's
    # teardown alone can take 40 s)
    assert "ended 1 rank process(es) still running 3 s after the failure" in err, err[-3000:]
    assert took < 300, took
