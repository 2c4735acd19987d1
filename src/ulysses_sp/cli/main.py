"""``ulysses-sp``: the command line (``train``, ``eval``, ``plan``), a thin layer over the library.

Launch: ``--nproc N`` starts N local processes through PyTorch's elastic launcher (the machinery
behind ``torchrun``); under ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set) the command
runs as one of the launched ranks instead, multi-node included::

    ulysses-sp train                                    # default: recall task, 2 processes, sp=2
    ulysses-sp train --model ./my-llama --data ./texts --sp 4 --nproc 4 --seq-len 8192
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m ulysses_sp.cli.main train --sp 8 ...

Only this module reads argv and the launcher's environment variables. Bad input is reported
before any process is started (exit code 2); a failed worker makes the command exit 1.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import signal
import sys
import uuid
from datetime import timedelta
from typing import Any

from ulysses_sp.checks import positive_int
from ulysses_sp.cli.args import DEFAULT_TIMEOUT_S, build_parser, train_options

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def default_nproc(sp: object) -> int:
    """``--nproc`` unset: one SP group (``dp = 1``), the layout ``--sp`` asks for; 1 when ``--sp`` is
    itself bad (its own check then names it)."""
    return sp if isinstance(sp, int) and not isinstance(sp, bool) and sp > 0 else 1


def under_launcher() -> bool:
    """Whether this process is a rank started by torchrun / the elastic launcher."""
    return all(v in os.environ for v in LAUNCHER_VARS)


# ---------------------------------------------------------------- argument parsing
# ---------------------------------------------------------------- processes
def _configure_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(message)s" if rank == 0 else f"[rank {rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    for noisy in ("torch.distributed", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _init_process_group(timeout_s: float, *, single: bool) -> None:
    import torch
    import torch.distributed as dist

    from ulysses_sp.parallel.mesh import default_backend, default_device_type

    if (kind := default_device_type()) != "cpu":  # one accelerator per local rank
        torch.get_device_module(kind).set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:  # one core per local rank: CPU ranks sharing a machine must not oversubscribe it (OMP_NUM_THREADS wins)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // local)))
    timeout = timedelta(seconds=timeout_s)
    if single:
        dist.init_process_group(
            default_backend(), store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    else:
        dist.init_process_group(default_backend(), timeout=timeout)


def _run_rank(
    command: str, options: Any, timeout_s: float, single: bool = False, launched: str | None = None,
    resolved: Any = None,
) -> Any:  # fmt: skip
    """Body of one rank: process group, the command, teardown; ends reported by ``stops``.

    ``launched``: started by ``_launch`` (its ``FailureWatch`` directory), whose process reports a
    stop; otherwise (one process, torchrun) rank 0 prints the stop line itself. ``resolved``: the
    ``train`` run as the launching process checked and resolved it (``None``: the rank resolves it).
    """
    from ulysses_sp.run.stops import run_reporting, signal_handlers, stop_line

    rank = int(os.environ.get("RANK", "0"))
    _configure_logging(rank)
    output_dir = getattr(options, "output_dir", None)
    report = None if launched or rank != 0 else (lambda signum: stop_line(command, signum, output_dir))
    with signal_handlers(getattr(options, "save_on_signal", 0.0), ignore_after_stop=True) as stop:
        body = functools.partial(_run_command, command, options, timeout_s, single, stop, resolved)
        result = run_reporting(rank, body, report, failed_dir=launched)
    if report is not None and isinstance(result, dict) and result.get("stopped"):
        print(report(signal.SIGTERM), file=sys.stderr)
        sys.exit(128 + signal.SIGTERM)
    return result


def _run_command(command: str, options: Any, timeout_s: float, single: bool, stop: Any, resolved: Any) -> Any:
    _init_process_group(timeout_s, single=single)
    try:
        if command == "train":
            from ulysses_sp.run.loop import run

            return run(options, stop=stop, resolved=resolved)
        from ulysses_sp.cli.evaluate import run_eval

        return run_eval(options)
    finally:
        from ulysses_sp.parallel.mesh import shutdown

        shutdown()


def _launch(command: str, options: Any, nproc: int, timeout_s: float, resolved: Any) -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from ulysses_sp.cli.warm_start import worker_start_method
    from ulysses_sp.run.stops import (
        SHUTDOWN_GRACE_S,
        SIGNALS_WITHOUT_SIGTERM,
        FailureWatch,
        blame,
        exit_code_of,
        forward_sigterm,
        quiet_launcher_logs,
        stop_line,
    )

    quiet_launcher_logs()
    save_on_signal = getattr(options, "save_on_signal", 0.0)
    signals = {"signals_to_handle": SIGNALS_WITHOUT_SIGTERM} if save_on_signal > 0 else {}
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"ulysses-sp-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
        start_method=worker_start_method(), shutdown_timeout=SHUTDOWN_GRACE_S, **signals,
    )  # fmt: skip
    output_dir = getattr(options, "output_dir", None)
    # --save-on-signal: SIGTERM goes to the workers and the launch ends once they have saved
    forwarding = forward_sigterm(save_on_signal) if save_on_signal > 0 else contextlib.nullcontext()
    stopped_by = None
    with FailureWatch() as watch, forwarding:
        try:
            results = elastic_launch(config, _run_rank)(
                command, options, timeout_s, False, watch.path, resolved
            )
        except SignalException as e:
            print(stop_line(command, e.sigval, output_dir), file=sys.stderr)
            stopped_by = e.sigval
        except ChildFailedError as e:
            failures = watch.exit_codes({r: exit_code_of(f) for r, f in e.failures.items()})
            print(f"ulysses-sp {command}: failed: {blame(failures, nproc, timeout_s)}", file=sys.stderr)
            if watch.killed:  # a stopped or hung rank never exits on the launcher's SIGTERM
                print(f"ulysses-sp {command}: ended {len(watch.killed)} rank process(es) still running "
                      f"{SHUTDOWN_GRACE_S:g} s after the failure", file=sys.stderr)  # fmt: skip
            sys.exit(1)
    if stopped_by is not None:
        _exit_now(128 + stopped_by)
    summary = (results or {}).get(0)
    if isinstance(summary, dict) and summary.get("stopped"):  # --save-on-signal: saved, then stopped
        print(stop_line(command, signal.SIGTERM, output_dir), file=sys.stderr)
        sys.exit(128 + signal.SIGTERM)


def _exit_now(code: int) -> None:
    """End the launcher with ``code`` once its output is flushed, without interpreter finalization: a
    signal interrupts torch's elastic agent with its rendezvous store's C++ thread still running, and
    destroying that thread at exit can abort the process ("terminate called without an active
    exception", exit -6) after the one-line stop message was already printed."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> None:
    """Console entry point ``ulysses-sp``."""
    args = build_parser().parse_args(argv)
    if args.command == "env":
        from ulysses_sp.cli.env import env_report

        print(env_report(args.json))
        return
    if args.command == "plan":
        from ulysses_sp.cli.plan import run_plan

        try:
            print(run_plan(args))
        except ValueError as e:
            print(f"ulysses-sp plan: error: {e}", file=sys.stderr)
            sys.exit(2)
        return
    try:
        if args.command == "train":
            options, launch = train_options(args)
        else:
            from ulysses_sp.cli.evaluate import eval_options

            options, launch = eval_options(args)
        if launch.get("rehearse"):
            code = _rehearse(options, launch)
            sys.exit(code)
        timeout_s = launch.get("timeout", DEFAULT_TIMEOUT_S)
        if (
            isinstance(timeout_s, bool)
            or not isinstance(timeout_s, (int, float))
            or not 0 < timeout_s < math.inf
        ):
            raise ValueError(f"--timeout must be a positive number of seconds, got {timeout_s!r}")
        timeout_s = float(timeout_s)
        if under_launcher():
            _run_rank(args.command, options, timeout_s)
            return
        nproc = positive_int("--nproc", launch.get("nproc", default_nproc(options.sp)))
        resolved = _check_before_launch(args.command, options, nproc)
    except ValueError as e:
        print(f"ulysses-sp {args.command}: error: {e}", file=sys.stderr)
        sys.exit(2)
    if nproc == 1:
        _run_rank(args.command, options, timeout_s, single=True, resolved=resolved)
    else:
        _launch(args.command, options, nproc, timeout_s, resolved)


def _rehearse(options: Any, launch: dict[str, Any]) -> int:
    """``train --rehearse``: one step of the run on fake tensors; 0 when it fits, 1 when it does not."""
    import json

    from ulysses_sp.rehearse.report import format_rehearsal
    from ulysses_sp.rehearse.run import rehearse_run

    gpus = launch.get("gpus", launch.get("nproc", default_nproc(options.sp)))
    print(f"rehearsing one step on {gpus} fake rank(s) ...", file=sys.stderr)
    result = rehearse_run(options, gpus=gpus, device=launch.get("device", "cuda"),
                          gpu_memory=launch.get("gpu_memory"), host_memory=launch.get("host_memory"),
                          images=launch.get("images"), image_size=launch.get("image_size"),
                          progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True))  # fmt: skip
    print(json.dumps(result.as_dict(), indent=1, default=str) if launch.get("json") else format_rehearsal(result))
    return 0 if result.fits else 1


def _check_before_launch(command: str, options: Any, nproc: int) -> Any:
    """Every check, once, before any worker starts; for ``train`` the resolved run the ranks get."""
    if command == "train":
        from ulysses_sp.run.lock import check_unlocked
        from ulysses_sp.run.preflight import check_before_launch, vision_patches
        from ulysses_sp.run.resolve import resolve_run

        resolved = resolve_run(options, nproc)
        check_unlocked(options.output_dir)
        check_before_launch(options, nproc, resolved.model_config,
                            vision_patches=vision_patches(options, resolved.model_config, resolved.dataset))
        return resolved
    from ulysses_sp.cli.evaluate import validate_eval

    validate_eval(options, nproc)
    return None


if __name__ == "__main__":
    main()
