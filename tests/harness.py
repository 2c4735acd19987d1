"""A small multi-process harness: a pool of spawned workers that run one function on N ranks.

Workers are spawned once (per test session) and reused; each ``run`` gets a fresh ``FileStore``
and a fresh gloo process group with a collective timeout, so a hang in a collective becomes an
error on every rank, and a worker that does not answer within ``timeout`` fails the test and is
replaced. Functions and arguments must be picklable (module-level functions in test modules).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

# Generous: on a loaded 2-core machine one rank's first call (imports, jit) can lag the others.
COLLECTIVE_TIMEOUT_S = float(os.environ.get("ULYSSES_SP_TEST_COLLECTIVE_TIMEOUT", "180"))


class WorkerError(RuntimeError):
    """Raised in the test process when a rank raised; holds every failing rank's traceback."""

    def __init__(self, failures: dict[int, tuple[str, str, str]]):
        self.failures = failures
        parts = [f"--- rank {r}: {t}: {m}\n{tb}" for r, (t, m, tb) in sorted(failures.items())]
        super().__init__("worker rank(s) failed:\n" + "\n".join(parts))

    def messages(self) -> list[str]:
        return [m for (_, m, _) in self.failures.values()]

    def types(self) -> set[str]:
        return {t for (t, _, _) in self.failures.values()}


def _worker_main(inbox: mp.Queue, outbox: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    while True:
        task = inbox.get()
        if task is None:
            return
        task_id, rank, world_size, store_path, fn, args, kwargs = task
        try:
            store = dist.FileStore(store_path, world_size)
            dist.init_process_group(
                "gloo",
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
            )
            # Pickle here, not in the queue's feeder thread: an unpicklable result must fail this
            # task at once instead of never arriving.
            result = pickle.dumps(fn(*args, **kwargs))
            outbox.put((task_id, rank, True, result))
        except BaseException as e:  # report everything, including KeyboardInterrupt in the worker
            outbox.put((task_id, rank, False, (type(e).__name__, str(e), traceback.format_exc())))
        finally:
            if dist.is_initialized():
                # Tear down only once every rank is done: a rank that fails at once (bad input) and
                # destroys its group while a slower peer is still connecting can leave that peer
                # stuck inside gloo's connect. A store barrier works even when the group is broken.
                try:
                    store.set(f"done/{rank}", "1")
                    store.wait(
                        [f"done/{r}" for r in range(world_size)], timedelta(seconds=COLLECTIVE_TIMEOUT_S)
                    )
                except Exception:  # noqa: BLE001 - a peer that never finishes is reported by run()
                    pass
                # Destroy, and release the groups meshes still hold, so their threads do not pile
                # up in this long-lived worker.
                from ulysses_sp.parallel.mesh import shutdown

                shutdown()


class WorkerPool:
    """``max_workers`` persistent spawned processes; ``run(fn, world_size)`` uses the first N."""

    def __init__(self, max_workers: int = 8, timeout: float = 600.0) -> None:
        self.max_workers = max_workers
        self.timeout = timeout
        self._ctx = mp.get_context("spawn")
        self._outbox: mp.Queue = self._ctx.Queue()
        self._workers: list[tuple[mp.Process, mp.Queue]] = []
        self._task = 0
        self._tmp = tempfile.TemporaryDirectory(prefix="ulysses-sp-tests-")

    def _ensure(self, n: int) -> None:
        if n > self.max_workers:
            raise ValueError(f"world_size {n} > max_workers {self.max_workers}")
        while len(self._workers) < n:
            inbox = self._ctx.Queue()
            p = self._ctx.Process(target=_worker_main, args=(inbox, self._outbox), daemon=True)
            p.start()
            self._workers.append((p, inbox))

    def run(self, fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on ranks ``0..world_size-1``; return the results by rank.

        Raises ``WorkerError`` with every failing rank's exception when any rank raised.
        """
        self._ensure(world_size)
        self._task += 1
        store_path = os.path.join(self._tmp.name, f"store-{self._task}")
        for rank in range(world_size):
            self._workers[rank][1].put((self._task, rank, world_size, store_path, fn, args, kwargs))
        results: dict[int, Any] = {}
        failures: dict[int, tuple[str, str, str]] = {}
        while len(results) + len(failures) < world_size:
            try:
                task_id, rank, ok, payload = self._outbox.get(timeout=self.timeout)
            except queue.Empty:
                self._restart()
                raise TimeoutError(
                    f"{fn.__name__} on {world_size} ranks did not finish in {self.timeout}s; "
                    f"{len(results)} finished, {len(failures)} failed"
                ) from None
            if task_id != self._task:
                continue  # a late answer from a task that already timed out
            (results if ok else failures)[rank] = payload
        if failures:
            raise WorkerError(failures)
        return [pickle.loads(results[r]) for r in range(world_size)]

    def _restart(self) -> None:
        for p, _ in self._workers:
            p.kill()
        self._workers = []

    def close(self) -> None:
        for _, inbox in self._workers:
            inbox.put(None)
        for p, _ in self._workers:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self._workers = []
        self._tmp.cleanup()
