"""How a CLI run ends when it does not simply finish: signals, errors, a rank that stops answering.

Every rank reports its own end in one line (no traceback for the ends we understand) and exits with
a code that tells the launching process what happened:

- ``0`` done (or stopped after ``--save-on-signal`` saved);
- ``1`` an error, reported by the rank ("[rank r] error: ...", a traceback only for the unexpected);
- ``3`` a collective timed out: this rank waited ``--timeout`` seconds for a peer that stopped
  answering (the peer is the one to blame, not this rank);
- ``4`` a peer's connection broke (it died);
- ``128 + signal`` stopped by SIGINT / SIGTERM.

The launching process (``blame``) turns the failures into one line naming the rank at fault:
a rank killed by a signal, else — when the failed ranks only timed out waiting — the ranks that
did not fail (they stopped answering), else the ranks with errors. ``stop_line`` is the one line a
signal ends with, naming the latest checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger("ulysses_sp.cli")

EXIT_ERROR, EXIT_TIMEOUT, EXIT_PEER_LOST = 1, 3, 4
SHUTDOWN_GRACE_S = 3
"""Seconds the launcher waits for workers to exit after SIGTERM before SIGKILL (no --save-on-signal)."""


class Stopped(BaseException):
    """Raised in a rank by SIGINT / SIGTERM (a ``BaseException``: no ``except Exception`` eats it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def signal_handlers(save_on_signal: float, *, ignore_after_stop: bool = False) -> Iterator[threading.Event]:
    """While inside: SIGINT / SIGTERM raise ``Stopped`` in this rank, except that with
    ``save_on_signal`` the first SIGTERM only sets the yielded event (the loop then saves and
    returns) and starts the save's deadline: further SIGTERMs before it are the same stop again (a
    process group's signal, then the launcher's forward of it) and are ignored; at the deadline the
    rank stops anyway. Once a signal has raised ``Stopped``, later SIGINT / SIGTERMs are the same
    stop again (Ctrl-C reaches the whole process group, then the launcher forwards it) and are
    ignored, so the rank's one-line report is not cut by a second ``Stopped``. The previous handlers
    come back on exit, unless ``ignore_after_stop`` (a rank's process, which is ending) and a signal
    stopped it: the signals then stay ignored, so a late forward is no ``KeyboardInterrupt``
    traceback. Main thread only."""
    event, expired = threading.Event(), threading.Event()
    deadline: list[threading.Timer] = []
    stopping = {"raised": False, "redeliver": False}

    def expire() -> None:
        expired.set()
        os.kill(os.getpid(), signal.SIGTERM)

    def handler(signum: int, _frame: Any) -> None:
        if signum == signal.SIGTERM and save_on_signal > 0 and not expired.is_set():
            if not event.is_set():
                event.set()
                deadline.append(threading.Timer(save_on_signal, expire))
                deadline[0].daemon = True
                deadline[0].start()
            return
        if stopping["raised"] and not stopping["redeliver"]:
            return
        stopping["raised"], stopping["redeliver"] = True, False
        raise Stopped(signum)

    def unraisable(info: Any) -> None:
        # A signal that lands while Python runs a weakref callback or finalizer (the attention's
        # step-state release, the memory tracker's storage finalizers) raises Stopped *inside* that
        # callback, where Python prints it as "Exception ignored" with a traceback and drops it.
        # Deliver the signal again, from another thread a moment later (raised here, the handler
        # would run inside this hook and be dropped again): it then lands outside the callback.
        if isinstance(info.exc_value, Stopped):
            stopping["redeliver"] = True
            threading.Timer(0.01, os.kill, (os.getpid(), info.exc_value.signum)).start()
            return
        previous_hook(info)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    previous_hook, sys.unraisablehook = sys.unraisablehook, unraisable
    try:
        yield event
    finally:
        for timer in deadline:
            timer.cancel()
        sys.unraisablehook = previous_hook
        for sig, old in previous.items():
            signal.signal(sig, signal.SIG_IGN if stopping["raised"] and ignore_after_stop else old)


SIGNALS_WITHOUT_SIGTERM = "SIGINT,SIGHUP,SIGQUIT"
"""The elastic agent's ``signals_to_handle`` under ``forward_sigterm`` (its default adds SIGTERM)."""


@contextlib.contextmanager
def forward_sigterm(save_on_signal: float) -> Iterator[None]:
    """In the launching process of a ``--save-on-signal`` run: the first SIGTERM is forwarded to the
    workers, and the launcher goes on waiting for them — they finish the step, save it and return,
    and the launch ends as soon as they have (the elastic agent's own SIGTERM handling would stop
    collecting their results and wait out the whole grace period instead). A second SIGTERM, or the
    save's deadline (``save_on_signal`` + ``SHUTDOWN_GRACE_S``) passing, raises the agent's
    ``SignalException``: it then stops the workers as on any signal. Main thread only.

    The agent installs its own handlers for the signals its ``LaunchConfig.signals_to_handle``
    names when it starts the workers: leave SIGTERM out of them (``SIGNALS_WITHOUT_SIGTERM``).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def expire() -> None:
        expired.set()
        os.kill(os.getpid(), signal.SIGTERM)

    def handler(signum: int, _frame: Any) -> None:
        workers = _spawned_children()
        if expired.is_set() or timers or not workers:
            raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))
        for pid in workers:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
        timers.append(threading.Timer(save_on_signal + SHUTDOWN_GRACE_S, expire))
        timers[0].daemon = True
        timers[0].start()

    expired, timers = threading.Event(), []
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        for timer in timers:
            timer.cancel()


def _classify(e: BaseException) -> tuple[int, str]:
    import torch.distributed as dist

    text = str(e)
    if isinstance(e, dist.DistBackendError) or "gloo" in text.lower() or "nccl" in text.lower():
        if "timed out" in text.lower() or "timeout" in text.lower():
            return (
                EXIT_TIMEOUT,
                "a collective timed out: another rank stopped answering (waited --timeout seconds)",
            )
        return (
            EXIT_PEER_LOST,
            f"lost the connection to another rank (it stopped or died): {text.splitlines()[0]}",
        )
    from ulysses_sp.engine.divergence import DivergenceError
    from ulysses_sp.run.rundir import NoSpaceError

    if isinstance(e, (ValueError, TypeError, DivergenceError, NoSpaceError)):
        return EXIT_ERROR, f"error: {e}"
    return EXIT_ERROR, "error:\n" + "".join(traceback.format_exception(e))


def run_reporting(
    rank: int,
    body: Callable[[], Any],
    report_stop: Callable[[int], str] | None = None,
    failed_dir: str | None = None,
) -> Any:
    """Run ``body`` in a rank; on anything but success, report one line and ``sys.exit`` its code.

    A signal ends silently unless ``report_stop`` is given (then its line is printed): the process
    that launched the ranks reports it once. On a failure, or a signal that stops this rank before
    any other rank ended, a file ``rank<r>`` is left in ``failed_dir`` (when given) for the
    launching process's ``FailureWatch``.
    """
    try:
        try:
            return body()
        except Stopped:
            raise
        except Exception as e:
            # A signal can land while this is handled: Ctrl-C reaches every rank, the first to stop closes
            # its connections, and a rank inside a collective sees "connection closed" before its own
            # signal handler runs (at the next bytecode, in here). The signal wins (the outer except).
            code, message = _classify(e)
            print(f"[rank {rank}] {message}", file=sys.stderr, flush=True)
            if failed_dir is not None:
                _report(failed_dir, rank, code)
            sys.exit(code)
    except Stopped as s:
        if report_stop is not None:
            print(report_stop(s.signum), file=sys.stderr, flush=True)
        # the first rank to end, stopped by a signal sent to it alone: the launcher names the signal
        # (a rank stopped after another's failure, by the launcher's own SIGTERM, does not report)
        if failed_dir is not None and not os.listdir(failed_dir):
            _report(failed_dir, rank, 128 + s.signum)
        sys.exit(128 + s.signum)


def _report(failed_dir: str, rank: int, code: int) -> None:
    with open(os.path.join(failed_dir, f"rank{rank}"), "w") as f:
        f.write(f"{code} {os.getpid()}")


def _signal_of(code: int) -> signal.Signals | None:
    """The signal that ended a worker with exit code ``code``: ``-N`` (killed by it) or ``128 + N``
    (it ran its handler, e.g. ``Stopped``, and exited with the shell's code for it); else ``None``."""
    n = -code if code < 0 else code - 128 if code > 128 else 0
    try:
        return signal.Signals(n) if n else None
    except ValueError:
        return None


def blame(failures: dict[int, int], nproc: int, timeout_s: float) -> str:
    """The launching process's line for failed workers: ``failures`` maps rank -> exit code
    (negative: killed by that signal; ``128 + N``: stopped by signal ``N``). It points at "the errors
    above" only for ranks that reported one (exit codes 1, 3, 4: ``run_reporting``'s)."""

    def ranks(rs: Any) -> str:
        return ", ".join(str(r) for r in sorted(rs))

    signalled = {r: (c, sig) for r, c in failures.items() if (sig := _signal_of(c)) is not None}
    if signalled:
        return "; ".join(
            f"rank {r} was {'killed' if c < 0 else 'stopped'} by {sig.name} (exit {c})"
            for r, (c, sig) in sorted(signalled.items())
        )
    if failures and all(c == EXIT_TIMEOUT for c in failures.values()):
        silent = set(range(nproc)) - set(failures)
        return (
            f"rank(s) {ranks(silent)} stopped answering: rank(s) {ranks(failures)} waited {timeout_s:g} s "
            "(--timeout) for them in a collective"
        )
    line = ", ".join(f"rank {r} (exit {c})" for r, c in sorted(failures.items()))
    reported = any(c in (EXIT_ERROR, EXIT_TIMEOUT, EXIT_PEER_LOST) for c in failures.values())
    return line + ("; see the errors above" if reported else "; it exited without reporting an error")


def stop_line(command: str, signum: int, output_dir: str | None) -> str:
    """``ulysses-sp train: stopped by SIGTERM; latest checkpoint: <dir> (continue with --resume)``."""
    line = f"ulysses-sp {command}: stopped by {signal.Signals(signum).name}"
    if output_dir is None:
        return line
    from ulysses_sp.state.checkpoint import list_checkpoints

    found = list_checkpoints(output_dir)
    if not found:
        return f"{line}; no checkpoint in {output_dir} yet"
    return f"{line}; latest checkpoint: {found[-1][1]} (continue with --resume)"


def quiet_launcher_logs() -> None:
    """The launcher's own error dumps repeat what the ranks reported; keep only its criticals."""
    for name in ("torch.distributed.elastic", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def exit_code_of(failure: Any) -> int:
    code = getattr(failure, "exitcode", EXIT_ERROR)
    return int(code) if code is not None else EXIT_ERROR


class FailureWatch:
    """In the launching process: once a rank has failed, end the ranks still running after
    ``SHUTDOWN_GRACE_S`` — a stopped or hung rank never exits on the SIGTERM the launcher sends it,
    and the elastic agent's stop after a failure waits a fixed 30 s before its SIGKILL. The run is
    lost at that point anyway; this only makes it end within ``--timeout`` plus a few seconds.

    Ranks report a failure by a file in ``path`` (``run_reporting``). Linux (``/proc``); elsewhere
    the agent's own 30 s apply.
    """

    def __init__(self) -> None:
        self.path = tempfile.mkdtemp(prefix="ulysses-sp-failed-")
        self._done = threading.Event()
        self.killed: list[int] = []
        """Worker pids this watch killed (still running after a failure and the grace)."""
        self._thread = threading.Thread(target=self._watch, name="ulysses-sp-failure-watch", daemon=True)

    def __enter__(self) -> FailureWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        shutil.rmtree(self.path, ignore_errors=True)

    def _watch(self) -> None:
        while not self._done.wait(0.2):
            if os.listdir(self.path):
                if not self._done.wait(SHUTDOWN_GRACE_S):  # the others report their own errors first
                    failed = {pid for _, pid in self._reports().values()}  # exiting on their own
                    for pid in set(_spawned_children()) - failed:
                        with contextlib.suppress(OSError):
                            os.kill(pid, signal.SIGKILL)
                            self.killed.append(pid)
                return

    def _reports(self) -> dict[int, tuple[int, int]]:
        """``rank -> (exit code, pid)`` of the ranks that reported a failure."""
        out = {}
        for name in os.listdir(self.path):
            with contextlib.suppress(OSError, ValueError):
                with open(os.path.join(self.path, name)) as f:
                    code, pid = (int(v) for v in f.read().split())
                out[int(name.removeprefix("rank"))] = (code, pid)
        return out

    def exit_codes(self, seen: dict[int, int]) -> dict[int, int]:
        """The failures to blame: the launcher's ``seen`` (rank -> exit code; it reports only the first
        failure it noticed), completed by the ranks' own reports, without the ranks this watch had to
        kill (they did not fail: they stopped answering)."""
        reported = {rank: code for rank, (code, _) in self._reports().items()}
        if self.killed:
            seen = {r: c for r, c in seen.items() if c != -signal.SIGKILL or r in reported}
        return {**seen, **reported}


def _spawned_children() -> list[int]:
    """This process's running worker processes: the ``multiprocessing`` children it started (the launcher's
    ranks, forked by its forkserver or spawned)."""
    import multiprocessing

    return [p.pid for p in multiprocessing.active_children() if p.pid is not None]
