"""The ``(data_parallel, sequence_parallel)`` device mesh, its process groups, and the DP world-size rule.

Every other module receives its groups from here (explicitly, never through a global). The layout
matches the reference system: with ``W = dp_size * sp_size`` ranks arranged row-major as
``arange(W).view(dp_size, sp_size)``, each **row** is one sequence-parallel group (ranks that share
samples and split each sequence) and each **column** is one data-parallel group (ranks that see
different samples). With 8 ranks and ``(2, 4)``: SP groups ``[0,1,2,3] [4,5,6,7]``, DP groups
``[0,4] [1,5] [2,6] [3,7]``.

Pure arithmetic (``resolve_mesh_shape``, ``data_parallel_world_size``) needs no process group and
is what the config validation and the unit tests use; ``init_mesh`` creates the real layout, an
``SPMesh`` over a torch ``DeviceMesh`` (a collective: every rank must call it). ``SPMesh`` is the
one object the rest of the library takes: its named views (``sp_group``, ``dp_group``,
``reduce_group``, ``fsdp_mesh``, ``mpu``) say what each group is for.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ulysses_sp.checks import positive_int
from ulysses_sp.parallel._teardown import release_groups, track_mesh
from ulysses_sp.parallel.mesh_shape import check_mesh_param, resolve_mesh_shape

DP_AXIS = "data_parallel"
SP_AXIS = "sequence_parallel"
MESH_AXES = (DP_AXIS, SP_AXIS)
RING_AXIS = "ring"
ULYSSES_AXIS = "ulysses"

LAUNCH_HINT = (
    "launch with `torchrun --nproc-per-node N your_script.py` (or `ulysses-sp train --nproc N`), "
    "or call torch.distributed.init_process_group(...) before this"
)


def default_device_type() -> str:
    """The accelerator's device type (``"cuda"``, ...) when one is usable, else ``"cpu"`` (gloo).
    Decided at run time, never hard-coded."""
    if torch.accelerator.is_available():
        return torch.accelerator.current_accelerator().type
    return "cpu"


def default_device() -> torch.device:
    """The device this rank computes on: the accelerator's current device, or the CPU."""
    kind = default_device_type()
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, torch.get_device_module(kind).current_device())


def default_backend() -> str:
    """The process-group backend for ``default_device_type()``: ``"nccl"`` with CUDA, ``"gloo"`` on CPU."""
    return dist.Backend.default_device_backend_map.get(default_device_type(), "gloo")


def require_process_group(what: str) -> None:
    """Raise a ``ValueError`` telling how to launch when no default process group exists."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{what} needs an initialized torch.distributed process group: {LAUNCH_HINT}")


def init_mesh(
    mesh_param: tuple[int, int] | None = None,
    *,
    dp_size: int | None = None,
    sp_size: int | None = None,
    ring_size: int | None = None,
    device_type: str | None = None,
) -> SPMesh:
    """The ``(data_parallel, sequence_parallel)`` layout over all ranks, as an ``SPMesh``.

    Args:
        mesh_param: ``(dp_size, sp_size)``; alternatively give either size by keyword and the
            other is derived from the world size.
        ring_size: factor the SP axis into ``ring_size x (sp_size / ring_size)`` (ring x Ulysses,
            Ulysses ranks contiguous; ``mesh_shape`` documents the layout). ``None``: a live
            layout of this shape whatever its ring size, else ``1`` (Ulysses alone).
        device_type: ``"cpu"`` / ``"cuda"``; ``None`` chooses at run time.

    A collective the first time a shape is asked for: every rank must call it with the same
    arguments. Asking again for the same shape and device type on the same process group returns
    the layout already built (its communicators are reused, never doubled).
    """
    require_process_group("init_mesh")
    if mesh_param is not None:
        mdp, msp = check_mesh_param(mesh_param)
        for name, given, from_param in (("dp_size", dp_size, mdp), ("sp_size", sp_size, msp)):
            if given is not None and given != from_param:
                raise ValueError(f"{name}={given} disagrees with mesh_param={tuple(mesh_param)}")
        dp_size, sp_size = mdp, msp
    dp_size, sp_size = resolve_mesh_shape(dist.get_world_size(), dp_size, sp_size)
    kind = device_type or default_device_type()
    live = [m for k, m in list(_layouts.items()) if k[:2] == (dp_size, sp_size) and k[3] == kind and m.is_current()]
    if ring_size is None:
        if live:
            return live[0]
        ring_size = 1
    ring_size = positive_int("ring_size", ring_size)
    if sp_size % ring_size:
        raise ValueError(f"ring_size ({ring_size}) does not divide sequence_parallel_size ({sp_size})")
    for mesh in live:
        if mesh.ring_size == ring_size:
            return mesh
    mesh = SPMesh(track_mesh(init_device_mesh(kind, (dp_size, sp_size), mesh_dim_names=MESH_AXES)), ring_size)
    _layouts[(dp_size, sp_size, ring_size, kind)] = mesh
    return mesh


# Live layouts by (dp, sp, ring, device type), so that a second init_mesh reuses the communicators.
_layouts: weakref.WeakValueDictionary[tuple[int, int, int, str], SPMesh] = weakref.WeakValueDictionary()


def ring_size_of(sp_group: dist.ProcessGroup | None) -> int:
    """The ring size of the live layout whose ``sp_group`` this is (``1`` when none is): how the data
    path learns the token layout that the attention registered on that group expects."""
    for mesh in list(_layouts.values()):
        if sp_group is not None and mesh.is_current() and mesh.sp_group is sp_group:
            return mesh.ring_size
    return 1


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
    _layouts.clear()
    release_groups()


class SPMesh:
    """The ``(data_parallel, sequence_parallel)`` layout of a run: groups, sizes, coordinates, device.

    One value object that every component takes instead of a bare ``DeviceMesh``, an ``mpu`` or a
    group: each purpose has a named view, so no caller has to know which axis or which global
    group stands for what.

    - ``sp_group``: this rank's sequence-parallel group (its row): attention all-to-all, the loss
      sum, the data adapter's exchange.
    - ``dp_group``: this rank's data-parallel group (its column): ZeRO partitioning, loss averaging.
    - ``reduce_group``: all ``dp * sp`` ranks of the layout: the gradient reduction (sum over SP,
      mean over DP in one collective) and run-wide metrics.
    - ``fsdp_mesh(partition)``: the mesh FSDP2 shards over (HSDP ``(SP replicate, DP shard)`` or
      1-D over all ranks), built once from the existing groups.
    - ``mpu``: the reference system's ``mpu`` view (``get_sequence_parallel_group()`` ...).

    Build one with ``init_mesh``; a second ``init_mesh`` with the same shape on the same process
    group returns the same object (no second set of communicators). A later sequence axis
    factored into ``ring x ulysses`` (``ring_size > 1``) adds ``ulysses_group`` (the all-to-all)
    and ``ring_group`` (K/V passing); the views above keep meaning the whole axis.
    """

    def __init__(self, device_mesh: DeviceMesh, ring_size: int = 1) -> None:
        if not isinstance(device_mesh, DeviceMesh):
            raise TypeError(f"expected a torch DeviceMesh, got {type(device_mesh).__name__}")
        if tuple(device_mesh.mesh_dim_names or ()) != MESH_AXES:
            raise ValueError(f"mesh must have axes {MESH_AXES}, got {device_mesh.mesh_dim_names}")
        self.device_mesh = device_mesh
        """The 2-D torch ``DeviceMesh`` (axes ``MESH_AXES``)."""
        self.dp_size, self.sp_size = device_mesh.size(0), device_mesh.size(1)
        self.dp_rank = device_mesh.get_local_rank(DP_AXIS)
        self.sp_rank = device_mesh.get_local_rank(SP_AXIS)
        # The default group this layout was built on, weakly: shutdown must be able to free it.
        self._world = weakref.ref(dist.group.WORLD)
        self._fsdp_meshes: dict[str, DeviceMesh] = {}
        self.ring_size = positive_int("ring_size", ring_size)
        """Ring groups ``R`` the SP axis factors into (``1``: Ulysses alone)."""
        self.ulysses_size = self.sp_size // ring_size
        """``U = sp_size / ring_size``: the ranks of one all-to-all."""
        self.ring_rank, self.ulysses_rank = divmod(self.sp_rank, self.ulysses_size)
        self._hybrid = None
        if ring_size > 1:  # a collective: every rank builds the (dp, ring, ulysses) groups
            shape = (self.dp_size, ring_size, self.ulysses_size)
            self._hybrid = track_mesh(
                init_device_mesh(self.device_type, shape, mesh_dim_names=(DP_AXIS, RING_AXIS, ULYSSES_AXIS))
            )

    @property
    def ulysses_group(self) -> dist.ProcessGroup:
        """The all-to-all group: the whole SP group without a ring, else this rank's ``U`` Ulysses ranks."""
        return self.sp_group if self._hybrid is None else self._hybrid.get_group(ULYSSES_AXIS)

    @property
    def ring_group(self) -> dist.ProcessGroup | None:
        """The ``R`` ranks that pass K/V around (same Ulysses rank, one per ring rank); ``None`` without a ring."""
        return None if self._hybrid is None else self._hybrid.get_group(RING_AXIS)

    @property
    def world_size(self) -> int:
        """``dp_size * sp_size``: the ranks of the layout."""
        return self.dp_size * self.sp_size

    @property
    def sp_group(self) -> dist.ProcessGroup:
        """The sequence-parallel group (this rank's row of the mesh)."""
        return self.device_mesh.get_group(SP_AXIS)

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The data-parallel group (this rank's column of the mesh)."""
        return self.device_mesh.get_group(DP_AXIS)

    @property
    def reduce_group(self) -> dist.ProcessGroup:
        """All ``dp * sp`` ranks: the gradient reduction and run-wide metrics.

        ``init_mesh`` lays the mesh over the whole default group, so this is that group (named
        here, never used as a bare ``WORLD``)."""
        group = self._world()
        if group is None:
            raise RuntimeError("this SPMesh's process group was destroyed (ulysses_sp.shutdown)")
        return group

    @property
    def device_type(self) -> str:
        return self.device_mesh.device_type

    @property
    def device(self) -> torch.device:
        """The device this rank computes on, from the mesh's device type (never hard-coded)."""
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, torch.get_device_module(self.device_type).current_device())

    @property
    def mpu(self) -> Mpu:
        """The reference system's ``mpu`` view of this layout."""
        return Mpu(self)

    def fsdp_mesh(self, partition: str) -> DeviceMesh:
        """The mesh FSDP2 shards over, built once per ``partition`` from the existing groups.

        ``"data_parallel"``: HSDP, a 2-D mesh whose first axis replicates along an SP group and
        whose second shards along a DP group (the transpose of the ``(dp, sp)`` grid).
        ``"all"``: 1-D over all ``dp * sp`` ranks.
        """
        if partition not in self._fsdp_meshes:
            if partition == "all":
                mesh = DeviceMesh.from_group(self.reduce_group, self.device_type, mesh_dim_names=("dp_sp",))
            elif partition == "data_parallel":
                # [dp, sp] rank grid -> [sp, dp]: dim 0 runs along an SP group, dim 1 along a DP group.
                grid = torch.arange(self.world_size).view(self.dp_size, self.sp_size).T
                mesh = DeviceMesh.from_group(
                    [self.sp_group, self.dp_group],
                    self.device_type,
                    mesh=grid,
                    mesh_dim_names=(SP_AXIS, DP_AXIS),
                )
            else:
                raise ValueError(f"partition must be 'data_parallel' or 'all', got {partition!r}")
            self._fsdp_meshes[partition] = track_mesh(mesh)
        return self._fsdp_meshes[partition]

    def is_current(self) -> bool:
        """Whether this layout's groups belong to the live default process group."""
        return dist.is_available() and dist.is_initialized() and self._world() is dist.group.WORLD

    def __repr__(self) -> str:
        return (
            f"SPMesh(dp_size={self.dp_size}, sp_size={self.sp_size}, dp_rank={self.dp_rank}, "
            f"sp_rank={self.sp_rank}, ring_size={self.ring_size}, device_type={self.device_type!r})"
        )


def as_sp_mesh(mesh: Any) -> SPMesh:
    """``mesh`` as an ``SPMesh``: an ``SPMesh`` itself, a 2-D ``DeviceMesh`` with our axis names, or an
    ``mpu``/registration holding one. Raises ``TypeError`` for anything else."""
    if isinstance(mesh, SPMesh):
        return mesh
    if isinstance(mesh, DeviceMesh):
        return SPMesh(mesh)
    held = getattr(mesh, "mesh", None)
    if isinstance(held, SPMesh):
        return held
    raise TypeError(
        f"expected an SPMesh (ulysses_sp.init_mesh), a (data_parallel, sequence_parallel) DeviceMesh or "
        f"an mpu from register_with_transformers, got {type(mesh).__name__}"
    )


class Mpu:
    """The model-parallel-unit view of an ``SPMesh``, with the method names the reference system uses.

    ``SPMesh.mpu`` returns one; ``initialize(mpu=...)`` accepts it (or any object with
    ``get_sequence_parallel_world_size`` and friends).
    """

    def __init__(self, mesh: SPMesh | DeviceMesh) -> None:
        self.mesh = as_sp_mesh(mesh)

    def get_sequence_parallel_group(self) -> dist.ProcessGroup:
        return self.mesh.sp_group

    def get_sequence_parallel_world_size(self) -> int:
        return self.mesh.sp_size

    def get_sequence_parallel_rank(self) -> int:
        return self.mesh.sp_rank

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.mesh.dp_group

    def get_data_parallel_world_size(self) -> int:
        return self.mesh.dp_size

    def get_data_parallel_rank(self) -> int:
        return self.mesh.dp_rank

    def get_ulysses_group(self) -> dist.ProcessGroup:
        """The all-to-all sub-group of the hybrid layout (the SP group without a ring)."""
        return self.mesh.ulysses_group

    def get_ring_group(self) -> dist.ProcessGroup | None:
        """The ring sub-group of the hybrid layout (``None`` without a ring)."""
        return self.mesh.ring_group

    def __repr__(self) -> str:
        return f"Mpu(dp_size={self.mesh.dp_size}, sp_size={self.mesh.sp_size})"
