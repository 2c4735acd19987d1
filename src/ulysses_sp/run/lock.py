"""One run per output directory: an OS-level exclusive lock on ``<output_dir>/.ulysses-sp.lock``.

``RunLock(output_dir).acquire()`` takes ``fcntl.flock(LOCK_EX | LOCK_NB)`` on the lock file and
writes the holder (PID, host, start time) into it. The kernel releases a ``flock`` when the holding
process exits **for any reason** — ``kill -9`` included — so a lock file left by a killed run is
not locked: the next run takes it over (and says so), with no PID guessing and no race (the
``flock`` itself is the arbiter). A second run while the first is alive is refused at once, naming
the holder. ``train.run`` holds the lock on rank 0 from before it touches the directory
(``prepare_output_dir``, whose ``--overwrite`` deletes files) to the end of the run, so
``--overwrite`` never deletes a live run's files; the CLI probes it in the launching process
(``check_unlocked``) so a busy directory is refused before any worker starts.

Limits: ``flock`` is advisory (only ulysses-sp runs honour it) and, on some network file systems,
local to one host; the lock then still keeps the runs of one host apart.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from typing import Any

logger = logging.getLogger(__name__)

LOCK_NAME = ".ulysses-sp.lock"


class RunLockedError(ValueError):
    """Another live run holds the output directory's lock."""


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "another process (no holder recorded)"
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "?"
    return f"PID {holder.get('pid')} on host {holder.get('host')} (started {when})"


class RunLock:
    """The exclusive lock of one output directory (see the module docstring)."""

    def __init__(self, output_dir: str) -> None:
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, LOCK_NAME)
        self._fd: int | None = None

    def _read_holder(self, fd: int) -> dict[str, Any]:
        try:
            raw = os.pread(fd, 4096, 0)
            return json.loads(raw) if raw.strip() else {}
        except (OSError, ValueError):
            return {}

    def acquire(self) -> RunLock:
        """Take the lock or raise ``RunLockedError`` naming its holder. Idempotent."""
        if self._fd is not None:
            return self
        os.makedirs(self.output_dir, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._read_holder(fd)
            os.close(fd)
            raise RunLockedError(
                f"--output-dir {self.output_dir!r} is in use by another ulysses-sp run: "
                f"{_describe(holder)}; wait for it to finish, stop it, or choose another --output-dir"
            ) from None
        previous = self._read_holder(fd)
        if previous:  # flock is free although a holder is recorded: its process ended
            logger.warning("%s: taking over the lock of a run that ended without releasing it (%s)",
                           self.output_dir, _describe(previous))  # fmt: skip
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Give the lock back (also done by the kernel when the process exits)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)  # no holder recorded: the next run takes it without a warning
        finally:
            os.close(fd)  # closing the descriptor releases the flock

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def check_unlocked(output_dir: str) -> None:
    """Raise ``RunLockedError`` if a live run holds ``output_dir``'s lock (probe: take and release).

    Creates nothing: a directory without a lock file is free.
    """
    if os.path.isfile(os.path.join(output_dir, LOCK_NAME)):
        RunLock(output_dir).acquire().release()
