"""The ``(data_parallel, sequence_parallel)`` device mesh, its process groups, and the DP world-size rule.

Every other module receives its groups from here (explicitly, never through a global). The layout
matches the reference system: with ``W = dp_size * sp_size`` ranks arranged row-major as
``arange(W).view(dp_size, sp_size)``, each **row** is one sequence-parallel group (ranks that share
samples and split each sequence) and each **column** is one data-parallel group (ranks that see
different samples). With 8 ranks and ``(2, 4)``: SP groups ``[0,1,2,3] [4,5,6,7]``, DP groups
``[0,4] [1,5] [2,6] [3,7]``.

Pure arithmetic (``resolve_mesh_shape``, ``data_parallel_world_size``) needs no process group and
is what the config validation and the unit tests use; ``init_mesh`` creates the real
``DeviceMesh`` (a collective: every rank must call it).
"""

from __future__ import annotations

import atexit
import gc
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DP_AXIS = "data_parallel"
SP_AXIS = "sequence_parallel"
MESH_AXES = (DP_AXIS, SP_AXIS)

LAUNCH_HINT = (
    "launch with `torchrun --nproc-per-node N your_script.py` (or `ulysses-sp train --nproc N`), "
    "or call torch.distributed.init_process_group(...) before this"
)


def _check_size(name: str, value: Any) -> int:
    # bool is an int subclass; True as a size is always a mistake.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a positive int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def resolve_mesh_shape(
    world_size: int, dp_size: int | None = None, sp_size: int | None = None
) -> tuple[int, int]:
    """Return ``(dp_size, sp_size)`` with any missing size derived from ``world_size``.

    Raises:
        ValueError: a size is not a positive int, or ``dp_size * sp_size != world_size``, or the
            given size does not divide the world size. The message names every number.
    """
    world_size = _check_size("world_size", world_size)
    if dp_size is not None:
        dp_size = _check_size("data_parallel_size", dp_size)
    if sp_size is not None:
        sp_size = _check_size("sequence_parallel_size", sp_size)
    if dp_size is None and sp_size is None:
        return world_size, 1
    if sp_size is None:
        if world_size % dp_size:
            raise ValueError(
                f"data_parallel_size ({dp_size}) does not divide world_size ({world_size}); "
                f"choose a divisor of {world_size}"
            )
        return dp_size, world_size // dp_size
    if dp_size is None:
        if world_size % sp_size:
            raise ValueError(
                f"sequence_parallel_size ({sp_size}) does not divide world_size ({world_size}); "
                f"choose a divisor of {world_size}"
            )
        return world_size // sp_size, sp_size
    if dp_size * sp_size != world_size:
        raise ValueError(
            f"dp_size ({dp_size}) * sp_size ({sp_size}) = {dp_size * sp_size} != world_size ({world_size})"
        )
    return dp_size, sp_size


def check_mesh_param(mesh_param: Any) -> tuple[int, int]:
    """Validate ``mesh_param`` as a ``(dp_size, sp_size)`` pair of positive ints and return it."""
    if not isinstance(mesh_param, (tuple, list)) or len(mesh_param) != 2:
        raise ValueError(
            f"mesh_param must be a pair (data_parallel_size, sequence_parallel_size), got {mesh_param!r}"
        )
    return _check_size("mesh_param[0] (dp_size)", mesh_param[0]), _check_size(
        "mesh_param[1] (sp_size)", mesh_param[1]
    )


def default_device_type() -> str:
    """``"cuda"`` when CUDA is usable, else ``"cpu"`` (gloo). Decided at run time, never hard-coded."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_device() -> torch.device:
    """The device this rank computes on: the current CUDA device, or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def default_backend() -> str:
    """``"nccl"`` with CUDA, else ``"gloo"``."""
    return "nccl" if default_device_type() == "cuda" else "gloo"


def require_process_group(what: str) -> None:
    """Raise a ``ValueError`` telling how to launch when no default process group exists."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{what} needs an initialized torch.distributed process group: {LAUNCH_HINT}")


def init_mesh(
    mesh_param: tuple[int, int] | None = None,
    *,
    dp_size: int | None = None,
    sp_size: int | None = None,
    device_type: str | None = None,
) -> DeviceMesh:
    """Create the 2-D ``(data_parallel, sequence_parallel)`` ``DeviceMesh`` over all ranks.

    Args:
        mesh_param: ``(dp_size, sp_size)``; alternatively give either size by keyword and the
            other is derived from the world size.
        device_type: ``"cpu"`` / ``"cuda"``; ``None`` chooses at run time.

    A collective: every rank must call it with the same arguments.
    """
    require_process_group("init_mesh")
    if mesh_param is not None:
        mdp, msp = check_mesh_param(mesh_param)
        for name, given, from_param in (("dp_size", dp_size, mdp), ("sp_size", sp_size, msp)):
            if given is not None and given != from_param:
                raise ValueError(f"{name}={given} disagrees with mesh_param={tuple(mesh_param)}")
        dp_size, sp_size = mdp, msp
    dp_size, sp_size = resolve_mesh_shape(dist.get_world_size(), dp_size, sp_size)
    return track_mesh(
        init_device_mesh(device_type or default_device_type(), (dp_size, sp_size), mesh_dim_names=MESH_AXES)
    )


# --- teardown -------------------------------------------------------------------------------------
#
# A gloo process group runs worker threads that stay alive as long as the group object does, and
# ``dist.destroy_process_group()`` does not stop them. A worker that finishes a collective drops
# its reference to the work (and its tensors) a moment *after* the caller has been released; if
# the caller is the script's last collective and the interpreter is already finalizing by then,
# the worker cannot take the GIL to free the tensors and the process aborts ("terminate called
# without an active exception", SIGABRT) although the run succeeded. torch >= 2.13 meshes keep
# their groups alive (``DeviceMesh._pg_registry``), so a module-level ``mesh`` is enough to hit it.
# ``shutdown`` releases the groups while the interpreter is alive: the group's destructor then
# joins its workers (it releases the GIL while joining), and nothing is left for finalization.

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


def shutdown() -> None:
    """End a distributed run: destroy every process group and stop the backends' worker threads.

    Call it once at the end of a script, where you would call ``dist.destroy_process_group()``.
    It also releases the groups that meshes from ``init_mesh`` (and the engine) hold, and collects
    garbage, so the groups' threads are joined now instead of during interpreter shutdown, where a
    late gloo worker aborts the process. Groups that your own live objects still hold (a loader
    or engine in a global variable) are released when those objects go: keep them inside a
    function. Safe to call twice and without a process group.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _release_groups()


def _release_groups() -> None:
    for mesh in list(_tracked.values()):
        registry = getattr(mesh, "_pg_registry", None)  # torch >= 2.13: the mesh holds its groups
        if isinstance(registry, dict):
            registry.clear()
    _tracked.clear()
    gc.collect()


def _release_at_exit() -> None:
    """Safety net for scripts that end with ``dist.destroy_process_group()`` and globals."""
    if not (dist.is_available() and dist.is_initialized()):  # the groups are no longer in use
        _release_groups()
    # Let a worker that still has to free a finished collective's tensors take the GIL now,
    # while the interpreter is alive (groups that live objects hold are only freed later).
    time.sleep(_EXIT_GRACE_S)


def check_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """Check that ``mesh`` is a 2-D mesh with our axis names; return it."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"expected a torch DeviceMesh, got {type(mesh).__name__}")
    if tuple(mesh.mesh_dim_names or ()) != MESH_AXES:
        raise ValueError(f"mesh must have axes {MESH_AXES}, got {mesh.mesh_dim_names}")
    return mesh


def sp_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The sequence-parallel group (this rank's row of the mesh)."""
    return mesh.get_group(SP_AXIS)


def dp_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The data-parallel group (this rank's column of the mesh)."""
    return mesh.get_group(DP_AXIS)


@dataclass(frozen=True)
class MeshInfo:
    """The resolved sizes and this rank's coordinates on the mesh."""

    dp_size: int
    """Number of data-parallel replicas (rows)."""
    sp_size: int
    """Ranks that split one sequence (columns)."""
    dp_rank: int
    """This rank's row."""
    sp_rank: int
    """This rank's column."""


def mesh_info(mesh: DeviceMesh) -> MeshInfo:
    """Sizes and coordinates of this rank on ``mesh``."""
    check_mesh(mesh)
    return MeshInfo(
        dp_size=mesh.size(0),
        sp_size=mesh.size(1),
        dp_rank=mesh.get_local_rank(DP_AXIS),
        sp_rank=mesh.get_local_rank(SP_AXIS),
    )


class Mpu:
    """The model-parallel-unit view of a mesh, with the method names the reference system uses.

    ``register_with_transformers`` returns one; ``initialize(mpu=...)`` accepts it (or any object
    with ``get_sequence_parallel_world_size`` and friends).
    """

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = check_mesh(mesh)

    def get_sequence_parallel_group(self) -> dist.ProcessGroup:
        return sp_group(self.mesh)

    def get_sequence_parallel_world_size(self) -> int:
        return self.mesh.size(1)

    def get_sequence_parallel_rank(self) -> int:
        return self.mesh.get_local_rank(SP_AXIS)

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return dp_group(self.mesh)

    def get_data_parallel_world_size(self) -> int:
        return self.mesh.size(0)

    def get_data_parallel_rank(self) -> int:
        return self.mesh.get_local_rank(DP_AXIS)

    def __repr__(self) -> str:
        return f"Mpu(dp_size={self.mesh.size(0)}, sp_size={self.mesh.size(1)})"


def data_parallel_world_size(
    world_size: int,
    *,
    mpu: Any | None = None,
    mesh: DeviceMesh | None = None,
    sequence_parallel_size: int | None = None,
) -> int:
    """The world size that ZeRO/FSDP partitions over and batch arithmetic uses.

    Decided in this order (the reference system's rule):

    1. an ``mpu`` with ``get_data_parallel_world_size()`` -> that;
    2. an ``mpu`` without it -> ``world_size / mpu.get_sequence_parallel_world_size()``;
    3. a ``mesh`` -> the size of its ``data_parallel`` axis;
    4. ``sequence_parallel_size`` -> ``world_size / sequence_parallel_size``;
    5. otherwise ``world_size``.
    """
    world_size = _check_size("world_size", world_size)
    if mpu is not None:
        if hasattr(mpu, "get_data_parallel_world_size"):
            return _check_size("mpu.get_data_parallel_world_size()", mpu.get_data_parallel_world_size())
        sp = _check_size("mpu.get_sequence_parallel_world_size()", mpu.get_sequence_parallel_world_size())
        return resolve_mesh_shape(world_size, sp_size=sp)[0]
    if mesh is not None:
        names = tuple(mesh.mesh_dim_names or ())
        return mesh.size(names.index(DP_AXIS)) if DP_AXIS in names else mesh.size(0)
    if sequence_parallel_size is not None:
        return resolve_mesh_shape(world_size, sp_size=sequence_parallel_size)[0]
    return world_size
