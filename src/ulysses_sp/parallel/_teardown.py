"""Ending a run cleanly: the process groups' worker threads are joined while the interpreter lives.

A gloo process group runs worker threads that stay alive as long as the group object does, and
``dist.destroy_process_group()`` does not stop them. A worker that finishes a collective drops
its reference to the work (and its tensors) a moment *after* the caller has been released; if
the caller is the script's last collective and the interpreter is already finalizing by then,
the worker cannot take the GIL to free the tensors and the process aborts ("terminate called
without an active exception", SIGABRT) although the run succeeded. torch >= 2.13 meshes keep
their groups alive (``DeviceMesh._pg_registry``), so a module-level ``mesh`` is enough to hit it.
``shutdown`` releases the groups while the interpreter is alive: the group's destructor then
joins its workers (it releases the GIL while joining), and nothing is left for finalization.
The public entry point is ``mesh.shutdown``; this private module is its mechanism.
"""

from __future__ import annotations

import atexit
import gc
import time
import weakref

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

_EXIT_GRACE_S = 0.1
_tracked: weakref.WeakValueDictionary[int, DeviceMesh] = weakref.WeakValueDictionary()
_exit_hook_registered = False


def track_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """Remember ``mesh`` so that ``shutdown`` can release the process groups it holds; return it."""
    global _exit_hook_registered
    _tracked[id(mesh)] = mesh
    if not _exit_hook_registered:
        atexit.register(_release_at_exit)
        _exit_hook_registered = True
    return mesh


def release_groups() -> None:
    """Drop the groups that tracked meshes hold, then collect: their destructors join the workers.
    Also forget DTensor's cached sharding decisions (``_clear_dtensor_caches``)."""
    for mesh in list(_tracked.values()):
        registry = getattr(mesh, "_pg_registry", None)  # torch >= 2.13: the mesh holds its groups
        if isinstance(registry, dict):
            registry.clear()
    _tracked.clear()
    _clear_dtensor_caches()
    gc.collect()


def _clear_dtensor_caches() -> None:
    """DTensor caches sharding propagation (in Python and in its C++ dispatch fast path) and
    redistribution plans keyed by specs whose mesh compares
    equal by layout alone (``DeviceMesh.__eq__`` ignores the process groups). After the groups are
    destroyed and a new run in the same process builds an equal mesh, a cache hit hands back the old
    mesh, whose group names no longer resolve ("Could not resolve the process group registered under
    the name N"). Private torch internals, looked up defensively: a rename makes this a no-op."""
    try:
        from torch.distributed.tensor import DTensor, _redistribute
    except ImportError:  # pragma: no cover - torch without DTensor
        return
    prop = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    for cached in (getattr(prop, "propagate_op_sharding", None), getattr(_redistribute, "_gen_transform_infos", None)):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    clear_plans = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if callable(clear_plans):
        clear_plans()
    import torch

    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ fast path's
    if callable(clear_native):
        clear_native()


def _release_at_exit() -> None:
    """Safety net for scripts that end with ``dist.destroy_process_group()`` and globals."""
    if not (dist.is_available() and dist.is_initialized()):  # the groups are no longer in use
        release_groups()
    # Let a worker that still has to free a finished collective's tensors take the GIL now,
    # while the interpreter is alive (groups that live objects hold are only freed later).
    time.sleep(_EXIT_GRACE_S)
