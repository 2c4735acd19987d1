"""Peak memory measurement of a region of code, on an accelerator or on the CPU.

``with track_peak_memory(device) as m: ...`` then ``m.peak_bytes``. Used by the tests, the
benchmarks and the CLI's ``peak_mem_bytes``. Where it sits in the step: anywhere, around a forward,
a backward or a whole step; it measures, it never changes what runs.

Two mechanisms, one contract (``baseline_bytes`` live at entry, ``peak_bytes`` the highest live
count during the region, ``extra_bytes = peak_bytes - baseline_bytes``):

* **Accelerators** (CUDA and any ``torch.<device>`` module with the same memory API): the caching
  allocator's own counters, ``memory_allocated`` at entry and ``max_memory_allocated`` after
  ``reset_peak_memory_stats``. Exact for tensor memory; it resets the device's peak counter, so two
  nested accelerator trackers share one peak.
* **CPU**: PyTorch's CPU allocator keeps no statistics, so a ``TorchDispatchMode`` watches every
  aten op run in the region (forward *and* backward: the autograd engine runs CPU backward on the
  calling thread with the mode active). A storage is *new* when an op returns a tensor whose
  storage is not among the op's inputs (views and in-place ops return their input's storage); its
  ``nbytes`` are added to the live count and a ``weakref.finalize`` on the storage object
  subtracts them when the storage is freed. PyTorch keeps a storage's Python object alive exactly
  as long as the C++ storage (PyObject preservation), so the finalizer fires at the real free.
  The count is deterministic: same code, same shapes, same bytes.

Blind spots of the CPU mechanism (documented, tested where they matter):

* tensors alive at entry are not counted unless passed in ``include=`` (``model.parameters()``),
  and the freeing of uncounted ones is not seen;
* memory that is not a tensor storage: kernel scratch buffers, the Python heap, allocator slack;
* storages created without an aten op (``torch.from_numpy``), ops run on other threads, and the
  local ops inside tensor subclasses such as ``DTensor`` (the mode sees the subclass op, not its
  local ops; a ``DTensor`` it sees made, or one in ``include``, is counted by its local shard);
* storages marked as host-side (below) are counted separately in ``host_*``.

``UntypedStorage.resize_`` is followed (``following_resize``; FSDP2 allocates and frees its
unsharded parameters that way, so ZeRO 2/3 steps are measured): a counted storage's bytes change
with it, and an uncounted one that grows (FSDP2's all-gather buffers, made in an earlier step and
resized to 0) is counted from then on. ``rehearse.tracker`` uses the same hook.

On a CPU-only machine the "accelerator" and the host are the same memory. Code that stages data
on the host (activation offload) marks those allocations with ``host_allocations()``, so the CPU
tracker reports what would have left the accelerator: they go to ``host_current_bytes`` /
``host_peak_bytes`` instead of ``current_bytes`` / ``peak_bytes``.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ulysses_sp.parallel.mesh import default_device

_HOST_SIDE: contextvars.ContextVar[bool] = contextvars.ContextVar("ulysses_sp_host_side", default=False)


@contextlib.contextmanager
def host_allocations() -> Iterator[None]:
    """Mark tensors created inside as host-side staging memory (see the module docstring).

    Only the CPU tracker reads the mark; on an accelerator host memory is a different device and
    the allocator counters never include it.
    """
    token = _HOST_SIDE.set(True)
    try:
        yield
    finally:
        _HOST_SIDE.reset(token)


def is_host_allocation() -> bool:
    """Whether tensors made now are host-side staging (inside ``host_allocations()``)."""
    return _HOST_SIDE.get()


class PeakMemory:
    """What ``track_peak_memory`` measured: live while the region runs, final after it.

    All values are bytes of tensor storage on ``device``.

    Attributes:
        device: the device measured.
        mechanism: ``"allocator"`` (accelerator counters) or ``"dispatch"`` (CPU storage tracking).
        baseline_bytes: live at entry: the allocator's count, or on CPU the storages of ``include``.
    """

    def __init__(self, device: torch.device, mechanism: str) -> None:
        self.device = device
        self.mechanism = mechanism
        self.baseline_bytes = 0
        self._peak = 0
        self._current = 0
        self._host_peak = 0
        self._host_current = 0
        self._live: dict[int, tuple[int, bool]] = {}
        self._allocator: Any = None  # the torch.<device> module while an accelerator region runs

    @property
    def peak_bytes(self) -> int:
        """Highest live count during the region so far, baseline included."""
        if self._allocator is not None:
            return self._allocator.max_memory_allocated(self.device)
        return self._peak

    @property
    def current_bytes(self) -> int:
        """Live count now (at exit once the region is over)."""
        if self._allocator is not None:
            return self._allocator.memory_allocated(self.device)
        return self._current

    @property
    def extra_bytes(self) -> int:
        """``peak_bytes - baseline_bytes``: what the region added at its worst."""
        return self.peak_bytes - self.baseline_bytes

    @property
    def host_peak_bytes(self) -> int:
        """CPU only: highest live count of storages made under ``host_allocations()``."""
        return self._host_peak

    @property
    def host_current_bytes(self) -> int:
        """CPU only: live count of host-side storages now."""
        return self._host_current

    def as_dict(self) -> dict[str, Any]:
        """Plain-number summary (for JSON)."""
        return {
            "device": str(self.device),
            "mechanism": self.mechanism,
            "baseline_bytes": self.baseline_bytes,
            "peak_bytes": self.peak_bytes,
            "extra_bytes": self.extra_bytes,
            "current_bytes": self.current_bytes,
            "host_peak_bytes": self.host_peak_bytes,
        }

    def __repr__(self) -> str:
        return f"PeakMemory({', '.join(f'{k}={v}' for k, v in self.as_dict().items())})"

    # -- CPU bookkeeping (called by _StorageTracker and the storages' finalizers) --
    def _add(self, key: int, nbytes: int, host: bool) -> None:
        self._live[key] = (nbytes, host)
        if host:
            self._host_current += nbytes
            self._host_peak = max(self._host_peak, self._host_current)
        else:
            self._current += nbytes
            self._peak = max(self._peak, self._current)

    def _free(self, key: int) -> None:
        nbytes, host = self._live.pop(key, (0, False))
        if host:
            self._host_current -= nbytes
        else:
            self._current -= nbytes

    def _resize(self, key: int, nbytes: int) -> None:
        host = self._live[key][1]
        self._free(key)
        self._add(key, nbytes, host)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns the memory: a ``DTensor``'s local shard (a dispatch mode sees DTensor
    ops, whose local ops run below it), else ``t``."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage holding ``t``'s memory (its local shard's for a ``DTensor``), ``None`` where
    there is none to count (other wrapper subclasses, sparse, nested tensors)."""
    try:
        return local_tensor(t).untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


@contextlib.contextmanager
def following_resize(on_resize: Callable[[torch.UntypedStorage, int], None]) -> Iterator[None]:
    """Call ``on_resize(storage, new_nbytes)`` after every ``UntypedStorage.resize_`` in the block
    (FSDP2's ``alloc_storage`` / ``free_storage`` of its unsharded parameters). Patches the method
    for the block and restores the previous one (nested blocks restore in order)."""
    previous = torch.UntypedStorage.resize_

    def resize_(self, size):  # noqa: ANN001 - the storage method's own signature
        out = previous(self, size)
        on_resize(self, int(size))
        return out

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = previous


_ALIASING: dict[Any, bool] = {}


def _may_alias(func: Any) -> bool:
    """Whether aten op ``func`` may return a tensor sharing an input's storage (a view, an in-place or
    ``out=`` op: a return with alias information in its schema); cached per op."""
    known = _ALIASING.get(func)
    if known is None:
        schema = getattr(func, "_schema", None)
        known = _ALIASING[func] = (schema is None or schema.name == "aten::_unsafe_view"  # a view its schema hides
                                   or any(r.alias_info is not None for r in schema.returns))  # fmt: skip
    return known


class _StorageTracker(TorchDispatchMode):
    """Counts the bytes of storages created by aten ops on one device type (CPU mechanism)."""

    def __init__(self, stats: PeakMemory) -> None:
        super().__init__()
        self.stats = stats
        self._finalizers: list[weakref.finalize] = []

    def track(self, storage: torch.UntypedStorage, *, host: bool) -> None:
        key = storage._cdata
        nbytes = storage.nbytes()
        if key in self.stats._live or nbytes == 0:
            return
        self.stats._add(key, nbytes, host)
        self._finalizers.append(weakref.finalize(storage, self.stats._free, key))

    def track_existing(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            if t.device.type == self.stats.device.type and (s := storage_of(t)) is not None:
                self.track(s, host=False)

    def resized(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """``storage.resize_(nbytes)`` happened: a counted storage changes size; an uncounted one
        that grows is counted from now on (its earlier bytes, if any, were never seen)."""
        if storage.device.type != self.stats.device.type:
            return
        if storage._cdata in self.stats._live:
            self.stats._resize(storage._cdata, nbytes)
        elif nbytes > 0:
            self.track(storage, host=_HOST_SIDE.get())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # an op whose schema declares no aliased return (most: matmul, add, ...) returns new storages only;
        # for views, in-place and out= ops, an output sharing an input's storage is not new memory
        inputs = {
            s._cdata
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and (s := storage_of(t)) is not None
        } if _may_alias(func) else ()  # fmt: skip
        host = _HOST_SIDE.get()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == self.stats.device.type:
                s = storage_of(t)
                if s is not None and s._cdata not in inputs:
                    self.track(s, host=host)
        return out

    def close(self) -> None:
        # Storages that outlive the region must not call back into a finished measurement.
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()


@contextlib.contextmanager
def track_peak_memory(
    device: torch.device | str | None = None, *, include: Iterable[torch.Tensor] = ()
) -> Iterator[PeakMemory]:
    """Measure peak tensor memory on ``device`` while the ``with`` body runs.

    Args:
        device: the device to measure; ``None`` is this rank's default device (CUDA if usable).
        include: CPU only: tensors alive at entry to count in the baseline (e.g. the model's
            parameters), so that the peak is comparable to an accelerator's absolute count.
            Ignored on accelerators, whose allocator already counts everything.

    Yields:
        A ``PeakMemory`` that is updated as the region runs and final after it.

    Example::

        with track_peak_memory("cpu", include=model.parameters()) as m:
            model(input_ids).logits.sum().backward()
        print(m.peak_bytes, m.extra_bytes)
    """
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cpu":
        stats = PeakMemory(device, "dispatch")
        tracker = _StorageTracker(stats)
        tracker.track_existing(include)
        include = ()  # this generator frame must not keep the included tensors alive
        stats.baseline_bytes = stats._peak = stats._current
        try:
            with tracker, following_resize(tracker.resized):
                yield stats
        finally:
            tracker.close()
        return
    try:
        mod = torch.get_device_module(device.type)
    except RuntimeError:
        mod = None
    if not hasattr(mod, "max_memory_allocated"):
        raise ValueError(f"no allocator statistics for device type {device.type!r}; measure on 'cpu'")
    stats = PeakMemory(device, "allocator")
    mod.reset_peak_memory_stats(device)
    stats.baseline_bytes = mod.memory_allocated(device)
    stats._allocator = mod
    try:
        yield stats
    finally:
        # Freeze the final numbers: later allocations must not change a finished measurement.
        stats._peak, stats._current = mod.max_memory_allocated(device), mod.memory_allocated(device)
        stats._allocator = None
