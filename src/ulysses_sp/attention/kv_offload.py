"""Ulysses-Offload: the full-sequence K/V of an attention layer kept on the host in chunks.

After the q/k/v all-to-all each rank holds K/V for the whole sequence (``[B, Hkv_l, S, D]`` each).
With ``offload_attention`` the blockwise core (``blockwise.blockwise_attention``) copies them to
host memory chunk by chunk in forward and keeps only the host chunks for backward; backward streams
them back one chunk at a time, prefetching the next while the current one computes. Device memory
for K/V between forward and backward is then zero, and during backward two chunks. The saved q and
output go to the host too, whole (``stash_whole``), and come back at the start of the backward.

* On an accelerator: pinned host buffers; the device-to-host copies on a side stream (the compute
  stream waits for them once, at the end of the layer's attention forward, so later host-to-device
  reads are ordered after them); host-to-device copies ``non_blocking`` on the side stream, the
  compute stream waiting on each chunk's event, the chunk marked with ``record_stream``.
* On CPU the "device" already is host memory: the mechanism still runs, copying each chunk to a
  second storage allocated under ``memory.host_allocations()`` (so the CPU tracker counts it as
  host-side) and back. It tests the mechanism; it saves no real memory and costs two copies.

Shape legend: ``B`` batch, ``S`` full sequence, ``Hkv_l`` kv heads on this rank, ``D`` head dim,
``c`` chunk length.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ulysses_sp.memory.meter import host_allocations


@dataclass
class KVOffloadStats:
    """Counters of one ``KVOffload`` (cumulative)."""

    offloaded_bytes: int = 0
    """K/V bytes copied to the host."""
    restored_bytes: int = 0
    """K/V bytes brought back to the device (each backward pass streams every chunk once)."""
    chunks: int = 0
    """Chunks stashed."""


class KVOffload:
    """The host home of K/V chunks and the side streams that move them (one per device).

    Held by the attention that uses it (``UlyssesSPAttentionHF`` with ``offload_attention=True``);
    no state outside it.
    """

    def __init__(self) -> None:
        self.stats = KVOffloadStats()
        self._streams: dict[torch.device, Any] = {}

    def _stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            mod = torch.get_device_module(device.type)
            stream = self._streams[device] = mod.Stream(device)
        return stream

    def stash(self, x: torch.Tensor, spans: list[tuple[int, int]], *, count: bool = True) -> list[torch.Tensor]:
        """Host copies of ``x [B, Hkv_l, S, D]`` cut along ``S`` at ``spans``: ``[B, Hkv_l, c, D]`` each
        (``count``: in the K/V ``stats``)."""
        self.stats.chunks += len(spans) * count
        self.stats.offloaded_bytes += x.numel() * x.element_size() * count
        if x.device.type == "cpu":
            with host_allocations(), torch.no_grad():
                return [x[:, :, a:b].clone() for a, b in spans]
        mod = torch.get_device_module(x.device.type)
        stream = self._stream(x.device)
        stream.wait_stream(mod.current_stream(x.device))  # x is fully written
        out = []
        with mod.stream(stream):
            for a, b in spans:
                host = torch.empty(x[:, :, a:b].shape, dtype=x.dtype, pin_memory=True)
                host.copy_(x[:, :, a:b], non_blocking=True)
                out.append(host)
        x.record_stream(stream)  # the allocator must not reuse x's memory before the copies end
        return out

    def settle(self, device: torch.device) -> None:
        """Order the compute stream after every copy issued so far (end of a forward)."""
        if device.type != "cpu":
            mod = torch.get_device_module(device.type)
            mod.current_stream(device).wait_stream(self._stream(device))

    def stash_whole(self, x: torch.Tensor) -> torch.Tensor:
        """A host copy of ``x [B, H, S, D]`` in one piece (q and the output; not in the K/V ``stats``)."""
        return self.stash(x, [(0, x.shape[2])], count=False)[0]

    def restore(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The device copy of a ``stash_whole``, ordered on the compute stream."""
        return host.clone() if device.type == "cpu" else host.to(device, non_blocking=True)

    def stream_in(
        self, k_host: list[torch.Tensor], v_host: list[torch.Tensor], device: torch.device
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield the device copies of chunk ``i`` (k, v) in order, the next one already in flight."""
        if device.type == "cpu":
            for kh, vh in zip(k_host, v_host):
                self.stats.restored_bytes += 2 * kh.numel() * kh.element_size()
                yield kh.clone(), vh.clone()
            return
        mod = torch.get_device_module(device.type)
        stream = self._stream(device)
        compute = mod.current_stream(device)

        def load(i: int):
            stream.wait_stream(compute)  # the buffers of an earlier chunk may be reused
            with mod.stream(stream):
                pair = (k_host[i].to(device, non_blocking=True), v_host[i].to(device, non_blocking=True))
            return pair, stream.record_event()

        pending = load(0) if k_host else None
        for i in range(len(k_host)):
            (kd, vd), event = pending
            pending = load(i + 1) if i + 1 < len(k_host) else None  # prefetch while chunk i computes
            compute.wait_event(event)
            kd.record_stream(compute)
            vd.record_stream(compute)
            self.stats.restored_bytes += 2 * kd.numel() * kd.element_size()
            yield kd, vd
