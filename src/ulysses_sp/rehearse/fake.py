"""The stage a rehearsal runs on: a fake process group, fake tensors, and answers to host reads.

* ``fake_world(world_size, rank)``: PyTorch's ``"fake"`` process-group backend (every collective
  returns at once, nothing moves) as this process's default group, torn down afterwards. The
  program's meshes and groups are built on it exactly as on a real group.
* ``rehearsal_device(requested)``: where the rehearsed step runs. ``cuda`` is a fake CUDA device
  when this PyTorch was built with CUDA (a GPU machine; no GPU memory is used). A CPU-only PyTorch
  cannot run autograd on fake CUDA tensors (its autograd engine needs a CUDA device guard), so there
  the accelerator is *emulated* on fake CPU tensors: the step is the same program, and what it
  stages on the host is told apart by the mark the library sets (``memory.meter.host_allocations``).
* ``HostReads``: a host read of a tensor value (``.item()``, ``float()``, ``bool()``, ``.tolist()``)
  has no answer on fake tensors. Inside the layers none may happen (DESIGN.md, "Scale without a
  GPU"): there it raises ``HostReadError`` naming the call. At the optimizer boundary the engine
  reads the loss and the gradient norm (clipping, the divergence guard): the rehearsal answers
  those with a placeholder (1.0 / True) — the values do not exist, the shapes and bytes do.
* ``HostValues``: host metadata is not a device value. An op whose tensor arguments are all real CPU
  tensors (the data adapter's layout attached to the batch: a VLM's frame plan, its vision tower's
  ``cu_seqlens``, ``vlm.layout``) runs for real, outside the fake mode and the tracker, as it runs on
  the host in a real step; a move of such a tensor to a device is an upload and makes a fake tensor.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

HOST_READS = {
    torch.Tensor.item: 1.0,
    torch.Tensor.__float__: 1.0,
    torch.Tensor.__int__: 1,
    torch.Tensor.__index__: 1,
    torch.Tensor.__bool__: True,
    torch.Tensor.tolist: None,
}


class HostReadError(RuntimeError):
    """A tensor value was read on the host inside the rehearsed step's layers."""


@dataclass(frozen=True)
class RehearsalDevice:
    """Where a rehearsed step runs."""

    requested: str
    """What the user asked for: ``"cuda"`` or ``"cpu"``."""
    tensor_device: str
    """The fake tensors' device type: ``"cuda"`` (native fake CUDA) or ``"cpu"``."""

    @property
    def emulated(self) -> bool:
        """Whether an accelerator is emulated on fake CPU tensors."""
        return self.requested != "cpu" and self.tensor_device == "cpu"

    def describe(self) -> str:
        if self.requested == "cpu":
            return "cpu (fake tensors)"
        if self.emulated:
            return f"{self.requested} (emulated on fake CPU tensors: this PyTorch has no CUDA; host staging told apart by its mark)"
        return f"{self.requested} (fake tensors; no GPU memory used)"


def rehearsal_device(requested: str) -> RehearsalDevice:
    """``requested``: ``"cuda"`` or ``"cpu"``; raises ``ValueError`` otherwise."""
    if requested not in ("cuda", "cpu"):
        raise ValueError(f"--device must be 'cuda' or 'cpu' for a rehearsal, got {requested!r}")
    native = requested == "cuda" and torch.backends.cuda.is_built() and torch.cuda.is_available()
    return RehearsalDevice(requested, "cuda" if native else "cpu")


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """This process as ``rank`` of ``world_size`` ranks on PyTorch's fake process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ValueError("a rehearsal runs in a process without a process group (it starts a fake one)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        from ulysses_sp.parallel.mesh import shutdown

        shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()


class HostReads(TorchFunctionMode):
    """Answers host reads at the optimizer boundary; refuses them elsewhere (see the module docstring).

    ``answering`` is switched on by the rehearsal around ``engine.step()`` and the loss report.
    """

    def __init__(self) -> None:
        super().__init__()
        self.answering = False
        self.answered = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS and _is_fake(args[0] if args else None):
            if not self.answering:
                where = "".join(traceback.format_stack(limit=8)[:-1])
                raise HostReadError(
                    f"host read of a tensor value ({getattr(func, '__name__', func)}) inside the step: a "
                    f"value a fake tensor does not have, and a device sync on a GPU. Called from:\n{where}"
                )
            self.answered += 1
            value = HOST_READS[func]
            return _zeros_list(args[0].shape) if value is None else value  # tolist: zeros of the shape
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def answer(self) -> Iterator[None]:
        prev = self.answering
        self.answering = True
        try:
            yield
        finally:
            self.answering = prev


_LIFTS = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default, torch.ops.aten.lift.default}


class HostValues(TorchDispatchMode):
    """Runs an op whose tensor arguments are all real CPU tensors (host metadata, module docstring) for
    real, under none of the rehearsal's modes (not faked, not counted); anything else goes on to them.
    A dispatch mode, so the backward's checkpoint recomputes pass through it too."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        # plain tensors only: a DTensor (FSDP2's parameters) wraps fake shards, its own type says nothing
        host = bool(tensors) and all(type(t) is torch.Tensor and t.device.type == "cpu" for t in tensors)
        lift = func in _LIFTS  # torch.tensor(data) in the step: the fake mode makes it fake, as it always did
        if host and not lift and (device is None or torch.device(device).type == "cpu"):  # an upload makes a fake tensor
            with _disable_current_modes():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _is_fake(t: object) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


@contextlib.contextmanager
def real_submeshes() -> Iterator[None]:
    """``DeviceMesh[name]`` (FSDP2 slices its HSDP mesh) computed on real tensors: a mesh's rank map
    must be real even while the fake mode is on."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__getitem__

    def getitem(self, names):  # noqa: ANN001 - DeviceMesh's own signature
        with unset_fake_temporarily():
            return original(self, names)

    DeviceMesh.__getitem__ = getitem
    try:
        yield
    finally:
        DeviceMesh.__getitem__ = original


def _zeros_list(shape: torch.Size) -> list | int:
    if not shape:
        return 0
    return [_zeros_list(shape[1:]) for _ in range(shape[0])]
