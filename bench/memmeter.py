"""Peak live tensor bytes over a region, on CPU or any device (torch only; used in both venvs).

``PeakMeter.step()`` is a context manager. On entry it finds every live tensor storage (a ``gc`` scan:
parameters, gradients, optimizer state, cached buffers) and then tracks, through a ``TorchDispatchMode``,
every storage that an op creates inside the region, each released through a weakref finaliser on its
storage (storages keep one Python object for their lifetime, so the finaliser fires when the memory is
freed). ``peak`` is the largest sum of live storage bytes seen. The same meter runs on both sides of the
DeepSpeed comparison, so its blind spots (allocator caching, storages made by C++ outside dispatch,
e.g. inside a collective's backend) bias both sides alike. One blind spot is one-sided: FSDP2 (our
ZeRO 2/3) re-allocates unsharded parameters with ``UntypedStorage.resize_``, which no dispatch mode
sees; bench/ours_worker.py adds those bytes explicitly (``unsharded_param_bytes``).
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _Track(TorchDispatchMode):
    def __init__(self, meter: PeakMeter) -> None:
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.meter._add(t)
        return out


class PeakMeter:
    """Peak bytes of live tensor storages inside ``step()`` regions (max over all regions)."""

    def __init__(self) -> None:
        self.peak = 0
        self.current = 0
        self._live: dict[int, int] = {}

    def _add(self, t: torch.Tensor) -> None:
        try:
            st = t.untyped_storage()
            key = st.data_ptr()  # raises for storages FSDP2 has freed with resize_(0)
            n = st.nbytes()
        except (RuntimeError, NotImplementedError, TypeError):
            return
        if key == 0 or n == 0 or key in self._live:
            return
        self._live[key] = n
        self.current += n
        self.peak = max(self.peak, self.current)
        weakref.finalize(st, PeakMeter._release, weakref.ref(self), key)

    @staticmethod
    def _release(ref, key: int) -> None:
        m = ref()
        if m is not None:
            n = m._live.pop(key, None)
            if n is not None:
                m.current -= n

    def _scan(self) -> None:
        gc.collect()
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor):
                self._add(obj)
                if obj.is_leaf and obj.grad is not None:
                    self._add(obj.grad)

    @contextlib.contextmanager
    def step(self):
        self._scan()
        with _Track(self):
            yield self
