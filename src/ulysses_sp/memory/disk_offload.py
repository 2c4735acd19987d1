"""A disk tier for activation offload: the first layers' checkpointed inputs in files, not host memory.

At the longest sequences the offloaded layer inputs outgrow the node's host memory (Llama-3-8B:
256 KiB per token over its 32 layers, 1,953 GiB at 8,000,000 tokens, more than a 2 TB node holds).
``--disk-layers K`` writes the inputs of the first ``K`` checkpointed layers to files under
``--offload-dir`` (a local NVMe: DGX-class nodes have tens of TB) instead of keeping them in host
memory. Those layers run first in the forward and last in the backward, so each file is written
long before it is read: a layer's step takes minutes at such lengths, a file of a few GiB seconds.

``DiskStore.put(t)`` returns what autograd keeps instead of ``t`` (``_OnDisk``: the file's path and
the tensor's shape, dtype and device); a background thread writes the bytes (on an accelerator
after the device-to-host copy, on a side stream, has finished), so the forward does not wait for the
disk. ``get`` waits for that write, reads the file back and removes it. Exact: the bytes written are
the bytes read. Under a rehearsal's fake tensors (no data) nothing is written: the tensor's shape is
kept and an empty tensor of it returned, so the rehearsal counts neither host nor device bytes for it.

Where it sits: inside ``memory.offload``'s pack/unpack hooks around checkpointed layers (steps 3
and 6 of DESIGN.md's data flow). Files are removed when read, when autograd drops them unread, and
the directory when the store is closed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

MAX_PENDING = 2
"""Writes in flight at most: each holds a staged copy of a layer input in (pinned) host memory."""


class _OnDisk:
    """A saved tensor written to a file (the packed form autograd keeps instead of the tensor)."""

    __slots__ = ("__weakref__", "device", "dtype", "path", "shape", "written")

    def __init__(self, path: str | None, written: Future | None, shape: torch.Size, dtype: torch.dtype,
                 device: torch.device) -> None:  # fmt: skip
        self.path, self.written, self.shape, self.dtype, self.device = path, written, shape, dtype, device


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _write(staged: torch.Tensor, event: Any, path: str) -> None:
    if event is not None:
        event.synchronize()  # the device-to-host copy into ``staged`` has finished
    staged.reshape(-1).view(torch.uint8).numpy().tofile(path)


class DiskStore:
    """Saved tensors in files under a fresh directory inside ``directory`` (module docstring)."""

    def __init__(self, directory: str | None = None) -> None:
        base = directory or tempfile.gettempdir()
        os.makedirs(base, exist_ok=True)
        self.directory = tempfile.mkdtemp(prefix="ulysses-sp-activations-", dir=base)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ulysses-sp-disk")
        self._count = 0
        self._pending: list[Future] = []  # writes not known to be done: at most MAX_PENDING staged copies held
        self.written_bytes = 0
        """Bytes written so far (cumulative)."""

    def put(self, t: torch.Tensor, stream: Any = None) -> _OnDisk:
        """Write ``t`` to a file (asynchronously); ``stream``: an accelerator's side stream for the
        device-to-host copy (``None`` on CPU)."""
        if is_fake(t):  # a rehearsal: shapes only, no bytes to write
            return _OnDisk(None, None, t.shape, t.dtype, t.device)
        self._count += 1
        path = os.path.join(self.directory, f"{self._count}.bin")
        event = None
        if t.device.type == "cpu":
            staged = t.detach().contiguous()
        else:
            mod = torch.get_device_module(t.device.type)
            staged = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            stream.wait_stream(mod.current_stream(t.device))  # t is fully written
            with mod.stream(stream):
                staged.copy_(t, non_blocking=True)
            t.record_stream(stream)  # the allocator must not reuse t's memory before the copy ends
            event = stream.record_event()
        self.written_bytes += t.numel() * t.element_size()
        written = self._writer.submit(_write, staged, event, path)
        self._pending = [f for f in self._pending if not f.done()] + [written]
        while len(self._pending) > MAX_PENDING:  # the disk is behind: wait, rather than hold more staged copies
            self._pending.pop(0).result()
        packed = _OnDisk(path, written, t.shape, t.dtype, t.device)
        weakref.finalize(packed, _remove, path)  # autograd dropped it unread (an exception, no backward)
        return packed

    def get(self, packed: _OnDisk) -> torch.Tensor:
        """The tensor ``put`` wrote, on its device; the file is removed."""
        if packed.path is None:  # a rehearsal's
            return torch.empty(packed.shape, dtype=packed.dtype, device=packed.device)
        packed.written.result()  # the write has finished (and raised, if it failed)
        nbytes = packed.shape.numel() * torch.empty((), dtype=packed.dtype).element_size()
        data = torch.from_file(packed.path, shared=False, size=nbytes, dtype=torch.uint8)
        _remove(packed.path)
        out = data.view(packed.dtype).reshape(packed.shape)
        # on CPU a copy made by an aten op, so the CPU meter counts it as it counts the host tier's
        return out.clone() if packed.device.type == "cpu" else out.to(packed.device)

    def close(self) -> None:
        """Stop the writer and remove the directory with whatever it still holds."""
        self._writer.shutdown(wait=True)
        shutil.rmtree(self.directory, ignore_errors=True)
