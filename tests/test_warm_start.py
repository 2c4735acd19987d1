"""``--nproc N`` ranks forked from one warm server (``cli/warm_start.py``): reused while the launching
process's environment is unchanged, restarted when it changed, so a rank sees the environment a
spawned one would. (The CLI tests that kill or stop one rank find it as the server's child.)"""

from __future__ import annotations

import multiprocessing
import os

from ulysses_sp.cli import warm_start


def _probe(queue) -> None:
    queue.put(os.environ.get("ULYSSES_SP_WARM_START_PROBE"))


def _start_one() -> tuple[str, str | None, int]:
    method = warm_start.worker_start_method()
    ctx = multiprocessing.get_context(method)
    queue = ctx.SimpleQueue()
    proc = ctx.Process(target=_probe, args=(queue,))
    proc.start()
    proc.join()
    assert proc.exitcode == 0
    from multiprocessing import forkserver

    return method, queue.get(), forkserver._forkserver._forkserver_pid


def test_ranks_start_from_one_server_that_follows_the_environment(monkeypatch):
    monkeypatch.setattr(warm_start, "PRELOAD", ())  # the mechanism, without paying the imports here
    monkeypatch.delenv("ULYSSES_SP_WARM_START_PROBE", raising=False)
    method, seen, server = _start_one()
    assert method == "forkserver" and seen is None
    assert _start_one() == (method, None, server)  # the same server: nothing imported twice
    monkeypatch.setenv("ULYSSES_SP_WARM_START_PROBE", "changed")
    method, seen, restarted = _start_one()
    assert (method, seen) == ("forkserver", "changed") and restarted != server
