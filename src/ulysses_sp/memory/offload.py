"""Activation offload: checkpointed layer inputs live in host memory between forward and backward.

With activation checkpointing, what a decoder layer keeps for backward is its input hidden states
``[B, S_l, h]`` (everything else is recomputed). Over ``L`` layers that is ``L * B * S_l * h``
elements, which dominates at long sequence. ``enable_activation_offload(model)`` moves each of
those inputs to host memory right after the layer's forward and brings it back when the backward
recomputes the layer. Where it sits in the step: around each checkpointed decoder layer (step 3 of
DESIGN.md's data flow) and its recompute in step 6.

Mechanism: a forward pre-hook / forward hook pair on each HF ``GradientCheckpointingLayer`` with
checkpointing on installs ``torch.autograd.graph.saved_tensors_hooks`` around the layer's call.
Inside the layer the checkpoint's own hooks take precedence, so ours see exactly what the
checkpoint saves *for itself*: the layer's positional tensor inputs (``use_reentrant`` either
way). These are what get offloaded; nothing else changes.

* On an accelerator: a pinned host buffer, the device-to-host copy on a side stream (overlapping
  the next layer's compute), the source kept alive for that stream by ``record_stream``; in
  backward the compute stream waits for the copy's event and copies back ``non_blocking``.
* On CPU the "device" already is host memory: the mechanism still runs, copying each input to a
  second storage allocated under ``memory.host_allocations()`` (so the CPU memory tracker counts
  it as host-side) and copying it back in backward. This is for testing the mechanism: it saves
  no real memory and costs two copies, so do not enable it for speed on CPU.

Transformers has ``activation_checkpointing_enable(offload=True)`` (``save_on_cpu`` around the same
call, copies on the compute stream); this one adds the side stream, byte counting and an undo
handle. Do not enable both.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from ulysses_sp.memory.disk_offload import DiskStore, _OnDisk
from ulysses_sp.memory.meter import host_allocations

logger = logging.getLogger(__name__)


@dataclass
class OffloadStats:
    """Counters of one ``ActivationOffloadHandle`` (cumulative since it was created)."""

    offloaded_tensors: int = 0
    """Tensors moved to host memory."""
    offloaded_bytes: int = 0
    """Bytes moved to host memory."""
    restored_bytes: int = 0
    """Bytes brought back to the device for backward."""
    disk_bytes: int = 0
    """Bytes written to files instead (``disk_layers``: ``memory.disk_offload``)."""


class _Offloaded:
    """A saved tensor's host copy (the packed form autograd keeps instead of the tensor)."""

    __slots__ = ("device", "event", "host")

    def __init__(self, host: torch.Tensor, device: torch.device, event: Any) -> None:
        self.host, self.device, self.event = host, device, event


def _checkpoint_layers(model: nn.Module) -> list[nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def decoder_layers(model: nn.Module, layers: list[nn.Module]) -> list[nn.Module]:
    """Of ``layers``, those of the model's decoder stack (``get_decoder()``), in order: a VLM's vision blocks
    come first in ``model.modules()`` and are not the layers the planner's disk term counts."""
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else None
    inside = {id(m) for m in decoder.modules()} if isinstance(decoder, nn.Module) else None
    return [m for m in layers if inside is None or id(m) in inside]


class ActivationOffloadHandle:
    """Returned by ``enable_activation_offload``; ``remove()`` uninstalls the hooks."""

    def __init__(self, model: nn.Module, *, min_bytes: int, disk_dir: str | None = None, disk_layers: int = 0) -> None:
        self.stats = OffloadStats()
        self.min_bytes = min_bytes
        self._active: list[saved_tensors_hooks] = []
        self._streams: dict[torch.device, Any] = {}
        self._hooks = []
        layers = _checkpoint_layers(model)
        self._disk = DiskStore(disk_dir) if disk_layers > 0 else None  # the first layers' inputs in files
        self._on_disk = {id(layer) for layer in decoder_layers(model, layers)[:disk_layers]}
        for layer in layers:
            self._hooks.append(layer.register_forward_pre_hook(self._enter))
            self._hooks.append(layer.register_forward_hook(self._exit, always_call=True))

    # -- hooks around each checkpointed layer --
    def _enter(self, layer: nn.Module, args: tuple) -> None:
        if layer.gradient_checkpointing and layer.training and torch.is_grad_enabled():
            pack = self._pack_to_disk if id(layer) in self._on_disk else self._pack
            ctx = saved_tensors_hooks(pack, self._unpack)
            ctx.__enter__()
            self._active.append(ctx)
        else:
            self._active.append(None)

    def _exit(self, layer: nn.Module, args: tuple, output: Any) -> None:
        ctx = self._active.pop() if self._active else None
        if ctx is not None:
            ctx.__exit__(None, None, None)

    # -- pack / unpack --
    def _stream(self, device: torch.device) -> Any:
        """The side stream for ``device``'s copies to the host."""
        if device not in self._streams:
            self._streams[device] = torch.get_device_module(device.type).Stream(device)
        return self._streams[device]

    def _pack_to_disk(self, t: torch.Tensor) -> Any:
        nbytes = t.numel() * t.element_size()
        if nbytes < self.min_bytes or isinstance(t, nn.Parameter):
            return t
        self.stats.disk_bytes += nbytes
        return self._disk.put(t, None if t.device.type == "cpu" else self._stream(t.device))

    def _pack(self, t: torch.Tensor) -> Any:
        nbytes = t.numel() * t.element_size()
        if nbytes < self.min_bytes or isinstance(t, nn.Parameter):
            return t
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += nbytes
        if t.device.type == "cpu":
            with host_allocations(), torch.no_grad():
                return _Offloaded(t.clone(), t.device, None)
        mod = torch.get_device_module(t.device.type)
        stream = self._stream(t.device)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        stream.wait_stream(mod.current_stream(t.device))  # t is fully written
        with mod.stream(stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(stream)  # the allocator must not reuse t's memory before the copy ends
        return _Offloaded(host, t.device, stream.record_event())

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _OnDisk):
            self.stats.restored_bytes += packed.shape.numel() * packed.dtype.itemsize
            return self._disk.get(packed)
        if not isinstance(packed, _Offloaded):
            return packed
        self.stats.restored_bytes += packed.host.numel() * packed.host.element_size()
        if packed.event is None:
            return packed.host.clone()
        mod = torch.get_device_module(packed.device.type)
        mod.current_stream(packed.device).wait_event(packed.event)
        return packed.host.to(packed.device, non_blocking=True)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._disk is not None:
            self._disk.close()

    def __repr__(self) -> str:
        return f"ActivationOffloadHandle(layers={len(self._hooks) // 2}, {self.stats})"

    def __enter__(self) -> ActivationOffloadHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def enable_activation_checkpointing(model: nn.Module, *, use_reentrant: bool = False) -> None:
    """Turn on transformers' activation checkpointing of ``model``'s decoder layers.

    Uses ``activation_checkpointing_enable`` where the installed transformers has it (5.x, where
    ``gradient_checkpointing_enable`` is a deprecated alias due to go in v6), else
    ``gradient_checkpointing_enable`` (4.x). Each layer then keeps only its input for backward.
    """
    kwargs = {"use_reentrant": use_reentrant}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise ValueError(
            f"{type(model).__name__} is not a transformers model with activation checkpointing "
            "(no activation_checkpointing_enable / gradient_checkpointing_enable); wrap its layers "
            "with torch.utils.checkpoint yourself"
        )


def enable_activation_offload(
    model: nn.Module, *, min_bytes: int = 1, disk_dir: str | None = None, disk_layers: int = 0
) -> ActivationOffloadHandle:
    """Offload the inputs of ``model``'s checkpointed layers to host memory (see module docstring).

    Args:
        model: an HF model with activation checkpointing enabled
            (``enable_activation_checkpointing(model)``, or transformers' own
            ``activation_checkpointing_enable()`` / ``gradient_checkpointing_enable()``).
        min_bytes: tensors smaller than this stay on the device.
        disk_dir, disk_layers: the first ``disk_layers`` checkpointed layers' inputs go to files in a
            fresh directory under ``disk_dir`` (default: the system's temporary directory) instead of
            host memory (``memory.disk_offload``; removed when read and by ``remove()``).

    Returns:
        A handle with ``stats`` (bytes offloaded / restored) and ``remove()``.

    Raises:
        ValueError: no layer of ``model`` has activation checkpointing on.

    Applies on each forward to the layers that are checkpointed at that time (training mode, grad
    enabled). Composes with FSDP2 (its hooks run outside the checkpoint), tiled MLP and SP.
    """
    layers = _checkpoint_layers(model)
    if not any(getattr(m, "gradient_checkpointing", False) for m in layers):
        raise ValueError(
            "activation offload needs activation checkpointing: it moves the one tensor each "
            "checkpointed layer keeps for backward (its input [B, S_l, hidden]) to host memory. "
            f"{type(model).__name__} has {len(layers)} checkpointable layer(s) and none is checkpointed; "
            "without checkpointing every intermediate activation stays on the device and offloading "
            "the layer inputs alone would save nothing. Call "
            "ulysses_sp.memory.offload.enable_activation_checkpointing(model) (or model.gradient_checkpointing_enable()) first"
        )
    decoder = decoder_layers(model, layers)
    if disk_layers < 0 or disk_layers > len(decoder):
        raise ValueError(f"disk_layers {disk_layers} must be in [0, {len(decoder)}] (the decoder's checkpointed layers)")
    return ActivationOffloadHandle(model, min_bytes=min_bytes, disk_dir=disk_dir, disk_layers=disk_layers)
