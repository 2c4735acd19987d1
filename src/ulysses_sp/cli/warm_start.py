"""Worker processes started from one warm interpreter: ``--nproc N`` imports torch, transformers and
the training loop once per launch instead of once per rank.

The launcher (torch's elastic agent) starts its ranks through ``multiprocessing``. With ``spawn``
each rank is a fresh interpreter that imports everything itself: about 5 s of CPU per rank before
the first step, N times over. With ``forkserver`` one server process imports the modules below once
and forks every rank from that state (copy-on-write): the ranks start with them loaded. The server
is single-threaded and never touches an accelerator, so a rank forked from it initialises CUDA
itself as a spawned one does (``fork`` from the launcher would copy its rendezvous store's threads).
Where ``forkserver`` does not exist (not on Linux/macOS) the launcher keeps ``spawn``.

A forked rank's environment is the server's (plus the launcher's ``RANK``, ``MASTER_PORT``, ...), taken
when the server started; a process that launches again after changing ``os.environ`` (``main()`` called
from Python) gets a new server, so its ranks see the environment a spawned rank would.
"""

from __future__ import annotations

import multiprocessing
import os

PRELOAD = (
    "torch",
    "torch.distributed",
    "transformers",
    "ulysses_sp.cli.main",
    "ulysses_sp.cli.evaluate",
    "ulysses_sp.run.loop",
)
"""Imported once by the server; anything a rank imports later it imports itself."""


def worker_start_method() -> str:
    """``"forkserver"`` with its server started and holding ``PRELOAD`` (``"spawn"`` where there is no
    forkserver); the launcher's ``start_method``. A module that fails to import in the server is
    skipped there (multiprocessing ignores its ``ImportError``) and the rank then reports it."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    from multiprocessing import forkserver

    global _server_env
    server = forkserver._forkserver  # the process-wide server multiprocessing's forkserver context uses
    if _server_env != dict(os.environ):  # not started here, or the environment changed since
        stop = getattr(server, "_stop", None)
        if stop is None:  # no way to restart it with this environment
            return "spawn"
        stop()
        multiprocessing.set_forkserver_preload(list(PRELOAD))
    server.ensure_running()
    _server_env = dict(os.environ)
    return "forkserver"


_server_env: dict[str, str] | None = None
"""The environment the server was started with (``None``: not started by this module)."""
