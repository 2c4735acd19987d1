"""``ulysses-sp train`` / ``eval`` run as subprocesses (2-4 CPU processes, tiny sizes, few steps).

Few, well-chosen runs (each costs process start-up): the sp=2 vs sp=1 equivalence at dp=1 and dp=2
(the dp=2 one with every ALST technique and the offloaded, chunked attention core on), the checkpoint
read by plain transformers, exact resume after a clean stop (ZeRO 0) and after ``kill -9`` of one rank
(ZeRO 3), the metrics schema, the recall task being learned (at sp 1, and its steep part at sp 2),
and every bad input (rejected before any process starts).
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

from ulysses_sp import tasks
from ulysses_sp.cli.main import main

TINY = [
    "--model",
    "tiny-llama",
    "--seq-len",
    "32",
    "--micro-batch-size",
    "2",
    "--no-progress",
    "--no-plot",  # loss.png costs a matplotlib import per run: drawn only where a test reads it
    "--timeout",
    "60",
]
METRIC_KEYS = {"step", "loss", "grad_norm", "lr", "tokens", "tokens_per_s", "peak_mem_bytes"}


def cli(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "ulysses_sp.cli.main", *args], capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"ulysses-sp {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    return proc


def metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def losses(run_dir) -> list[float]:
    return [m["loss"] for m in metrics(run_dir)]


def train(out, *args: str, **kw) -> subprocess.CompletedProcess:
    return cli("train", *TINY, "--output-dir", str(out), *args, **kw)


def train_here(out, *args: str) -> None:
    """``train`` with ``--nproc 1`` in this process, as the CLI runs it (no launcher): the sp 1 oracles
    save an interpreter start."""
    main(["train", *TINY, "--output-dir", str(out), "--nproc", "1", *args])


STEPS8 = ("--steps", "8", "--zero-stage", "3")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The sp=1 reference (reporting to TensorBoard, with loss.png) and the sp=2 run: dp=1, ZeRO 3 (the
    partition auto: all ranks), 8 steps, the sp=2 one saving every 2, its attention block in 2 head groups
    (each rank's 2 heads one at a time: ``attention/head_blocks.py`` under FSDP2), the next group's exchange
    overlapped with each group's core (``--head-chunk-overlap``; the kill-9 test's run, without it, matches it bitwise)."""
    root = tmp_path_factory.mktemp("cli")
    train_here(root / "sp1", "--sp", "1", *STEPS8, "--report-to", "tensorboard", "--plot")
    proc = train(root / "sp2", "--sp", "2", "--nproc", "2", *STEPS8, "--save-every", "2", "--head-chunks", "2",
                 "--head-chunk-overlap", "--memory-every", "2")  # fmt: skip
    (root / "sp2.log").write_text(proc.stderr + proc.stdout)
    return root


def test_sp2_matches_sp1_at_dp1_and_metrics_schema(runs):
    ref, sp2 = metrics(runs / "sp1"), metrics(runs / "sp2")
    assert ("head groups 2: the whole attention block per group in 2 attention modules; the next group's exchange "
            "behind each group's core\n") in (runs / "sp2.log").read_text()  # fmt: skip
    assert [m["step"] for m in sp2] == list(range(1, 9))
    for m in sp2:  # --memory-every 2: the peak measured on steps 1-3, every 2nd and the last
        measured = m["step"] in (1, 2, 3, 4, 6, 8)
        assert set(m) == (METRIC_KEYS if measured else METRIC_KEYS - {"peak_mem_bytes"})
        assert all(isinstance(m[k], int) for k in ("step", "tokens"))
        assert all(isinstance(m[k], float) for k in ("loss", "grad_norm", "lr", "tokens_per_s"))
        assert m["tokens"] == m["step"] * 2 * 32 and m["tokens_per_s"] > 0
        assert not measured or (isinstance(m["peak_mem_bytes"], int) and m["peak_mem_bytes"] > 0)
    # the CPU default (every 25th): steps 1-3 and the last of 8
    assert [m["step"] for m in metrics(runs / "sp1") if "peak_mem_bytes" in m] == [1, 2, 3, 8]
    assert len({m["loss"] for m in sp2}) == 8  # it trains (a loss that never moves would match trivially)
    for a, b in zip(ref, sp2, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["lr"] == a["lr"]


def test_report_to_tensorboard_writes_the_hf_trainer_names_and_loss_png(runs):
    """``--report-to tensorboard``: event files in ``<output_dir>/runs`` that TensorBoard's own reader
    reads back as the metrics file's numbers under the HF Trainer's names; ``loss.png`` beside
    ``metrics.jsonl``. A run without the flags writes neither (the sp=2 run: ``--no-plot``)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(runs / "sp1" / "runs"))
    acc.Reload()
    ref = metrics(runs / "sp1")
    names = {"loss": "train/loss", "grad_norm": "train/grad_norm", "lr": "train/learning_rate",
             "tokens": "train/num_input_tokens_seen", "tokens_per_s": "train/tokens_per_second",
             "peak_mem_bytes": "train/peak_mem_bytes"}  # fmt: skip
    assert set(acc.Tags()["scalars"]) == set(names.values())
    for key, tag in names.items():
        events, logged = acc.Scalars(tag), [m for m in ref if key in m]  # the peak: not on every step
        assert [e.step for e in events] == [m["step"] for m in logged]
        assert logged == ref or key == "peak_mem_bytes"
        assert [e.value for e in events] == pytest.approx([m[key] for m in logged], rel=1e-6), tag
    assert (runs / "sp1" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (runs / "sp2" / "runs").exists() and not (runs / "sp2" / "loss.png").exists()


def test_checkpoint_is_plain_transformers_and_matches_training(runs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = runs / "sp2" / "checkpoint-2"
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    assert len(AutoTokenizer.from_pretrained(path, local_files_only=True)) <= model.config.vocab_size
    # step 3 trained on recall samples 4, 5 (micro 2, dp 1, no shuffle) with the weights of step 2,
    # gathered from FSDP2 shards: plain transformers on those samples must report the logged loss
    ids, labels = (torch.stack(t) for t in zip(*(tasks.recall_sample(0, i, 32) for i in (4, 5))))
    with torch.no_grad():
        loss = model(input_ids=ids, labels=labels).loss.item()
    assert loss == pytest.approx(metrics(runs / "sp2")[2]["loss"], rel=1e-5)


def test_sp2_matches_sp1_at_dp2_with_alst_techniques_zero0_under_torchrun_and_profile_comm(tmp_path):
    """dp 2 x sp 2 with every ALST technique and the offloaded, chunked attention core (K/V to host,
    blocks of 5 tokens) equals dp 2 x sp 1 (plain sdpa, launched by torchrun) step by step."""
    common = ("--steps", "3", "--zero-stage", "0")
    # the reference runs under torchrun (the same command, launched from outside)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd = [*torchrun, "-m", "ulysses_sp.cli.main", "train", *TINY, "--output-dir", str(tmp_path / "sp1")]
    proc = subprocess.run([*cmd, "--sp", "1", *common], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "dp 2 x sp 1" in proc.stderr
    alst = ("--tiled-mlp", "2", "--tiled-loss", "--activation-checkpointing", "--offload-activations",
            "--recompute-norms", "--offload-attention", "--attn-chunk", "5")  # fmt: skip
    # --profile-comm rides along (timing only: the numbers still equal the reference's); at ZeRO 0 the
    # dp gradient reduction goes through the library's timed hook, so dp_comm_s is measured too
    proc = train(tmp_path / "sp2", "--sp", "2", "--nproc", "4", *common, *alst, "--profile-comm")
    assert "dp 2 x sp 2" in proc.stderr and "tiled MLP on (2 tiles), tiled loss on" in proc.stderr
    assert "norm recompute on" in proc.stderr and "predicted peak per rank" in proc.stderr
    assert "blockwise core with K/V offloaded to host for every sequence (chunk 5)" in proc.stderr
    for a, b in zip(metrics(tmp_path / "sp1"), metrics(tmp_path / "sp2"), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        # both DP replicas' tokens (full recall rows: micro-batch 2 x 32 each), each once, whatever sp
        assert a["tokens"] == b["tokens"] == a["step"] * 2 * 2 * 32
        assert b["comm_s"] > 0 and b["dp_comm_s"] > 0 and b["compute_s"] > 0  # every line has comm times
        assert b["comm_share"] == pytest.approx((b["comm_s"] + b["dp_comm_s"]) / (
            b["comm_s"] + b["dp_comm_s"] + b["compute_s"]), rel=1e-6)  # fmt: skip


def _last_spawned_worker(parent: int) -> int:
    """The pid of the launcher's most recently started worker process: forked by the launcher's
    forkserver (``cli/warm_start.py``), a child of the launcher itself."""
    procs = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        procs[int(pid)] = (int(fields[1]), int(fields[19]), cmdline)  # (parent, start time, command line)
    (server,) = [pid for pid, (pp, _, cmd) in procs.items() if pp == parent and b"forkserver" in cmd]
    found = [(start, pid) for pid, (pp, start, _) in procs.items() if pp == server]
    assert len(found) == 2, found
    return max(found)[1]


def test_kill_9_one_rank_then_resume_is_exact_zero3(runs, tmp_path):
    # checkpoints every 3 steps: step 3 ends mid-way through a round of the SP data adapter (3 % sp),
    # so resuming also exercises the skip inside a round; saving does not change the losses
    # a collective timeout of 600 s (the last --timeout wins over TINY's 60): the launcher must end the run
    # on the rank's exit, not when the survivor's collective times out
    args = ("--sp", "2", "--nproc", "2", *STEPS8, "--save-every", "3", "--timeout", "600", "--head-chunks", "2")
    run = tmp_path / "killed"
    cmd = [sys.executable, "-m", "ulysses_sp.cli.main", "train", *TINY, "--output-dir", str(run), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not (run / "checkpoint-3").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "run ended before its first checkpoint"
        time.sleep(0.005)
    os.kill(_last_spawned_worker(proc.pid), signal.SIGKILL)
    killed_at = time.monotonic()
    _, err = proc.communicate(timeout=400)
    # far below the 600 s collective timeout, with room for a loaded machine
    assert proc.returncode == 1 and time.monotonic() - killed_at < 300
    assert "(exit -9)" in err
    done = [m["step"] for m in metrics(run)]
    assert done and done[-1] < 8, "the kill came too late to test anything"
    train(run, *args, "--resume")  # from the newest complete checkpoint
    assert losses(run) == losses(runs / "sp2")  # the uninterrupted run (its exchange overlapped), to the bit


def test_resume_on_another_nproc_sp_and_zero_stage_continues_the_run(runs, tmp_path):
    """docs/how-to/resume-reshard.md: a checkpoint of the sp 2 run (2 processes, ZeRO 3) resumed into
    another output directory on 1 process at sp 1 and ZeRO 1 (dp 1 as saved): the training state is
    resharded, and the resumed steps are the uninterrupted run's steps."""
    out = tmp_path / "resharded"
    train_here(out, "--sp", "1", "--steps", "8", "--zero-stage", "1", "--resume", str(runs / "sp2" / "checkpoint-4"))
    assert [m["step"] for m in metrics(out)] == [5, 6, 7, 8]
    assert losses(out) == pytest.approx(losses(runs / "sp2")[4:], rel=1e-5)
    assert (out / "checkpoint-8" / "manifest.json").is_file()


def test_default_task_learns_and_eval_shows_late_positions(tmp_path):
    """A short recall run must push the recall half's loss far below chance.

    Chance is ``ln 221 = 5.40`` nats: the recalled tokens are uniform and independent of everything
    but the span ~S/2 positions back, on the other SP rank. No model that fails to attend across the
    shard boundary can go below it; 1.0 nat (a geometric-mean probability of 37% on the right token,
    vs 0.45% at chance) is reached only by copying from the span. The untrained model sits at chance.
    At 32 tokens the copy is learned in fewer steps than at 64 (measured, training loss of the last
    step: 0.10 after 100 steps at 32 tokens; 0.63 after 150 at 64, the old setting, 2.46 after 100).
    The 100 steps run at sp 1, in this process (the whole test took 126 s when they ran at sp 2 in two
    processes). The steep part of the curve is learned at sp 2 too, by ``train --sp 2`` launched as a
    user runs it: resumed from the sp-1 run's step 25, steps 26-45 take the loss from 4.66 to 1.93
    (measured; only the copy across the shard boundary gets below 5.40), equal to sp 1's steps (measured
    to rel 2e-7). The eval below reads the sp-1 run's last checkpoint at sp 2.
    """
    out = tmp_path / "learn"
    seq = 32
    main(["train", "--seq-len", str(seq), "--micro-batch-size", "32", "--steps", "100", "--output-dir", str(out),
          "--save-every", "25", "--sp", "1", "--nproc", "1", "--no-progress", "--no-plot"])  # fmt: skip
    sp2 = tmp_path / "learn-sp2"
    cli("train", "--seq-len", str(seq), "--micro-batch-size", "32", "--steps", "45", "--output-dir", str(sp2),
        "--resume", str(out / "checkpoint-25"), "--sp", "2", "--nproc", "2", "--no-progress", "--no-plot")  # fmt: skip
    ref, two = losses(out)[25:45], losses(sp2)
    assert [m["step"] for m in metrics(sp2)] == list(range(26, 46))
    assert two[0] > 4.0 and two[-1] < 2.5  # learned at sp 2: far below chance (5.40)
    assert two == pytest.approx(ref, rel=1e-5)  # the same steps as at sp 1
    ckpt = str(out / "checkpoint-100")
    js, png = tmp_path / "eval.json", tmp_path / "eval.png"
    cli("eval", "--model", "tiny-llama", ckpt, "--seq-len", str(seq), "--sp", "2", "--nproc", "2",
        "--num-samples", "32", "--output-json", str(js), "--plot", str(png))  # fmt: skip
    before, after = json.loads(js.read_text())["results"]
    assert before["late_loss"] > tasks.CHANCE_LOSS - 0.3
    assert after["late_loss"] < 1.0 and after["accuracy"] > 0.7
    assert after["early_loss"] is None  # the span carries no labels
    bins = [b for b in after["per_position"] if b["tokens"]]
    assert bins and all(b["start"] >= seq // 2 - 2 for b in bins)
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the same checkpoint evaluated without sequence parallelism (one process, plain attention)
    js1 = tmp_path / "eval_sp1.json"
    main(
        [
            "eval",
            "--model",
            ckpt,
            "--sp",
            "1",
            "--seq-len",
            str(seq),
            "--num-samples",
            "32",
            "--output-json",
            str(js1),
            "--plot",
            "",
        ]
    )
    (plain,) = json.loads(js1.read_text())["results"]
    assert plain["loss"] == pytest.approx(after["loss"], rel=1e-5) and plain["tokens"] == after["tokens"]


def test_config_file_with_flags_overriding(tmp_path):
    from ulysses_sp.cli.args import build_parser, train_options

    (tmp_path / "c.json").write_text(
        json.dumps({"steps": 5, "sp": 1, "seq-len": 64, "nproc": 3, "tiled_mlp": 4})
    )
    ns = build_parser().parse_args(
        ["train", "--config", str(tmp_path / "c.json"), "--steps", "7", "--tiled-loss"]
    )
    cfg, launch = train_options(ns)
    assert (cfg.steps, cfg.sp, cfg.seq_len, launch) == (7, 1, 64, {"nproc": 3})
    assert (cfg.tiled_mlp, cfg.tiled_mlp_shards, cfg.tiled_loss, cfg.tiled_loss_shards) == (
        True,
        4,
        True,
        None,
    )
    assert cfg.model == "tiny-llama" and cfg.data == "recall"  # defaults where neither says


# ---------------------------------------------------------------- bad input, rejected before launch
def _fails(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_bad_inputs(capsys, runs, tmp_path):
    out = ["--output-dir", str(tmp_path / "new")]
    assert "(3) is not divisible by --sp (2)" in _fails(capsys, "train", "--nproc", "3", "--sp", "2", *out)
    assert "no such directory" in _fails(capsys, "train", "--model", str(tmp_path / "nope"), *out)
    assert "has no config.json" in _fails(capsys, "train", "--model", str(tmp_path), *out)
    for name, content, message in [
        ("empty.txt", b"", "is empty"),
        ("bad.txt", b"\xff\xfe", "cannot read"),
        ("short.txt", b"tiny", "5 tokens, shorter than one sequence (--seq-len 256)"),
    ]:
        (tmp_path / name).write_bytes(content)
        assert message in _fails(capsys, "train", "--data", str(tmp_path / name), *out)
    assert "no such file or directory" in _fails(capsys, "train", "--data", str(tmp_path / "x.txt"), *out)
    assert "--resume: no checkpoint in" in _fails(capsys, "train", "--resume", *out)
    assert "needs --activation-checkpointing" in _fails(capsys, "train", "--offload-activations", *out)
    (tmp_path / "cfg.json").write_text(json.dumps({"steps": 2, "seq_lenn": 8}))
    assert "unknown training option(s) ['seq_lenn']" in _fails(
        capsys, "train", "--config", str(tmp_path / "cfg.json")
    )
    assert not (tmp_path / "new").exists()


def test_refuses_other_runs_checkpoints_and_mismatched_resume(capsys, runs):
    run = str(runs / "sp2")
    before = sorted(os.listdir(run)), (runs / "sp2" / "metrics.jsonl").read_bytes()
    base = ["train", *TINY, "--output-dir", run, "--steps", "8"]
    err = _fails(capsys, *base, "--sp", "2", "--nproc", "2", "--zero-stage", "3")
    assert "already holds checkpoints" in err and "--resume" in err and "--overwrite" in err
    err = _fails(capsys, *base, "--sp", "1", "--nproc", "2", "--resume")
    assert "world.zero_stage: checkpoint has 3, this run has 0" in err
    assert (
        "world.dp: checkpoint has 1, this run has 2" in err
        and "world.sp: checkpoint has 2, this run has 1" in err
    )
    err = _fails(
        capsys, *base, "--sp", "2", "--nproc", "2", "--resume", "--model", "tiny-qwen2", "--seq-len", "64"
    )
    assert "run.model: checkpoint has 'tiny-llama', this run has 'tiny-qwen2'" in err
    assert "run.seq_len: checkpoint has 32, this run has 64" in err and "model_config." in err
    assert (sorted(os.listdir(run)), (runs / "sp2" / "metrics.jsonl").read_bytes()) == before  # nothing lost


def test_attention_chunk_options_parse_and_bad_ones_are_rejected(capsys, tmp_path):
    from ulysses_sp.cli.args import build_parser, train_options

    (tmp_path / "c.json").write_text(json.dumps({"attn_chunk": "auto", "offload_attention": True}))
    cfg, _ = train_options(build_parser().parse_args(["train", "--config", str(tmp_path / "c.json")]))
    assert (cfg.attn_chunk, cfg.offload_attention) == (None, True)
    cfg, _ = train_options(build_parser().parse_args(["train", "--attn-chunk", "512"]))
    assert (cfg.attn_chunk, cfg.offload_attention) == (512, False)
    out = ["--output-dir", str(tmp_path / "new")]
    assert "expected a positive number of tokens or 'auto', got '0'" in _fails(
        capsys, "train", "--attn-chunk", "0", *out
    )
    assert "configure the blockwise core" in _fails(
        capsys, "train", "--offload-attention", "--attn", "eager", *out
    )


@pytest.mark.parametrize("value, want", [("none", None), ("", None), ("curves.png", "curves.png")])
def test_eval_plot_none_or_empty_means_no_plot(value, want):
    from ulysses_sp.cli.args import build_parser
    from ulysses_sp.cli.evaluate import eval_options

    ns = build_parser().parse_args(["eval", "--model", "tiny-llama", "--plot", value])
    assert eval_options(ns)[0].plot == want


def test_env_prints_what_a_bug_report_needs(capsys):
    import torch

    main(["env"])
    text = capsys.readouterr().out
    assert text.startswith("Copy-and-paste the text below into your issue:")
    for line in (f"- torch: {torch.__version__}", "- transformers: ", "- trl: ", "- distributed backends: gloo",
                 "- host memory: "):  # fmt: skip
        assert line in text, line
    main(["env", "--json"])
    info = json.loads(capsys.readouterr().out)
    assert info["torch"] == torch.__version__ and info["CPU cores"] >= 1 and info["devices"]
