"""What one rehearsed step allocates: live bytes per place, the peak, what is alive at it, collectives.

``StepTracker`` is a ``TorchDispatchMode`` run under ``FakeTensorMode`` (no data, no memory: only
shapes, dtypes and devices). Every aten op that returns a tensor whose storage is not one of its
inputs' creates a storage; its ``nbytes`` are added to the live count of its *place* and a
``weakref.finalize`` on the storage subtracts them when the program drops it (PyTorch keeps a
storage's Python object alive exactly as long as the storage). Like ``memory.meter``'s CPU tracker
it follows ``UntypedStorage.resize_`` (``memory.meter.following_resize``: FSDP2 allocates and frees
its unsharded parameters that way), so ZeRO 2/3 are counted; beyond it, it records for each storage the op and module that made it and
the phase (forward, backward, optimizer), so the report can list the largest tensors alive at the
peak.

Places: ``device`` (the accelerator the step runs on) and ``host``. On a fake accelerator the place is
the tensor's device type. On fake CPU tensors (a CPU rehearsal, or an accelerator emulated on a
machine whose PyTorch has none) host staging is told apart by the mark the library already sets
around it (``memory.meter.host_allocations``: activation offload, Ulysses-Offload's K/V); model
states that live on the host (FSDP2's CPU offload) are moved to ``host`` by the caller (``rehome``).

Collectives are counted by kind with their tensor bytes (the c10d ops a fake process group still
dispatches). Where it sits: around one step of ``rehearse.step``; it never changes what runs.
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry as FLOP_FORMULAS

from ulysses_sp.memory.meter import is_host_allocation, local_tensor, storage_of

_SDPA_FORWARD = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")  # fmt: skip
_SDPA_BACKWARD = tuple(f"{name}_backward" for name in _SDPA_FORWARD)


def attention_flops(name: str, args: tuple, kwargs: dict) -> int | None:
    """FLOPs of one fused attention kernel (forward or backward), halved for a causal one (the
    masked half of the scores is skipped); ``None`` for another op. torch's own formulas count the
    full ``S x S`` and have none for the CPU kernel an emulated rehearsal runs."""
    if name in _SDPA_FORWARD:
        q, k, v = args[:3]
        matmuls = 2  # q k^T, p v
        causal = kwargs.get("is_causal", args[4] if len(args) > 4 and isinstance(args[4], bool) else False)
    elif name in _SDPA_BACKWARD:
        _, q, k, v = args[:4]
        matmuls = 4  # dv, dp, dq, dk
        causal = kwargs.get("is_causal", next((a for a in args[6:9] if isinstance(a, bool)), False))
    else:
        return None
    b, h, s_q, d = q.shape  # [B, H, S_q, D]; K/V may have fewer (GQA) heads, each query head attends all keys
    flops = matmuls * 2 * b * h * s_q * k.shape[-2] * max(d, v.shape[-1])
    return flops // 2 if causal else flops


TOP = 10
"""How many of the largest storages alive at the peak are kept."""


@dataclass
class Alloc:
    """One storage the step made."""

    nbytes: int
    place: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    op: str
    module: str
    phase: str
    ref: weakref.ref = field(repr=False)


@dataclass
class PlaceStats:
    """Live and peak bytes of one place (``device`` or ``host``)."""

    current: int = 0
    peak: int = 0
    peak_at: list[Alloc] = field(default_factory=list)
    """The ``TOP`` largest storages alive at the peak (the first time it was reached)."""
    peak_all: list[tuple[weakref.ref, int, str]] = field(default_factory=list)
    """Every storage alive at the peak: ``(storage ref, bytes then, phase made in)``."""
    peak_phase: str = ""
    peak_module: str = ""


def kernel_workspace(name: str, args: tuple, device_type: str) -> int:
    """Bytes a CUDA flash-attention backward allocates inside the kernel, which no fake kernel makes:
    FlashAttention-2's fp32 ``dq`` accumulator ``[B, S_q (to 128), H, D (to 32)]`` and ``softmax_d``
    ``[B, H, S_q]``, and with fewer kv heads than query heads ``dk``/``dv`` expanded to ``[B, S_k, H, D]``
    before their sum (``mha_bwd``). 0 for another op or device: a CPU kernel's buffers are per thread."""
    if device_type != "cuda" or name not in ("_scaled_dot_product_flash_attention_backward",
                                             "_scaled_dot_product_flash_attention_for_cpu_backward"):  # fmt: skip
        return 0
    q, k = args[1], args[2]  # [B, H, S, D], [B, Hkv, S_k, D]
    b, h, s_q, d = q.shape
    s_r, d_r = -(-s_q // 128) * 128, -(-d // 32) * 32
    expanded = 2 * b * k.shape[-2] * h * d * q.element_size() if k.shape[1] != h else 0
    return 4 * b * s_r * h * (d_r + 1) + expanded


class StepTracker(TorchDispatchMode):
    """Counts storages per place during a rehearsed step (see the module docstring).

    Args:
        device_type: the accelerator's device type, or ``"cpu"``; on ``"cpu"`` host staging is
            known by its ``host_allocations`` mark.
        modules: a ``ModTracker`` (or anything with ``parents``) naming the running module, or ``None``.
        kernels: the device the step's kernels stand for (default ``device_type``): ``"cuda"`` adds the
            workspaces of ``kernel_workspace``.
    """

    def __init__(self, device_type: str, modules: Any = None, kernels: str | None = None) -> None:
        super().__init__()
        self.device_type = device_type
        self.kernels = kernels or device_type
        """The device whose kernels' workspaces are modelled (``cuda`` when emulated on CPU tensors)."""
        self.modules = modules
        self.phase = "setup"
        self.places = {"device": PlaceStats(), "host": PlaceStats()}
        self.live: dict[int, Alloc] = {}
        self.collectives: Counter[str] = Counter()
        self.collective_bytes: Counter[str] = Counter()
        self.flops = self.attention_forward_flops = 0  # (the fused attention kernels' forward: rehearse.timing)
        self.largest: tuple[int, tuple[int, ...], str] = (0, (), "")
        """``(elements, shape, op)`` of the largest tensor any op made in the step (an ``S x S`` check)."""
        self.phase_peaks: Counter[str] = Counter()
        """The device's live bytes at its high point within each phase."""
        self.host_traffic: Counter[str] = Counter()
        """Bytes copied ``h2d`` (host to device) and ``d2h`` by the step's ops (offload, CPU-offloaded states)."""
        self.host_phases: set[str] = set()
        """Phases whose allocations are host memory on fake CPU tensors (the optimizer of host-resident states)."""
        self._dirty: set[str] = set()
        self._finalizers: list[weakref.finalize] = []

    # -- places and bookkeeping --
    def _place(self, t: torch.Tensor) -> str | None:
        kind = t.device.type
        if kind == "meta":
            return None
        if self.device_type == "cpu":
            return "host" if is_host_allocation() or self.phase in self.host_phases else "device"
        return "device" if kind == self.device_type else "host"

    def _module(self) -> str:
        parents = getattr(self.modules, "parents", None)
        return parents[-1] if parents else ""

    def track(self, storage: torch.UntypedStorage, t: torch.Tensor, place: str, op: str) -> None:
        key = storage._cdata
        nbytes = storage.nbytes()
        if key in self.live or nbytes == 0:
            return
        self._add(key, Alloc(nbytes, place, tuple(local_tensor(t).shape), t.dtype, op, self._module(), self.phase,
                             weakref.ref(storage)))  # fmt: skip
        self._finalizers.append(weakref.finalize(storage, self._free, key))

    def _add(self, key: int, alloc: Alloc) -> None:
        self.live[key] = alloc
        stats = self.places[alloc.place]
        if stats.current + alloc.nbytes > stats.peak:  # a new high: snapshot once it starts to fall
            self._dirty.add(alloc.place)
        stats.current += alloc.nbytes
        self._raise(alloc.place, stats)

    def _raise(self, place: str, stats: PlaceStats) -> None:
        stats.peak = max(stats.peak, stats.current)
        if place == "device":
            self.phase_peaks[self.phase] = max(self.phase_peaks[self.phase], stats.current)

    def _free(self, key: int) -> None:
        alloc = self.live.get(key)
        if alloc is None:
            return
        if alloc.place in self._dirty:
            self._snapshot(alloc.place)
        del self.live[key]
        self.places[alloc.place].current -= alloc.nbytes

    def _snapshot(self, place: str) -> None:
        self._dirty.discard(place)
        stats = self.places[place]
        if stats.current < stats.peak:
            return
        mine = [a for a in self.live.values() if a.place == place]
        stats.peak_at = [replace(a) for a in sorted(mine, key=lambda a: -a.nbytes)[:TOP]]
        stats.peak_all = [(a.ref, a.nbytes, a.phase) for a in mine]
        stats.peak_phase, stats.peak_module = self.phase, self._module()

    def resized(self, storage: torch.UntypedStorage, new_nbytes: int) -> None:
        """``storage.resize_(new_nbytes)`` happened (FSDP2's unsharded parameters)."""
        key = storage._cdata
        alloc = self.live.get(key)
        if alloc is None:
            return
        delta = new_nbytes - alloc.nbytes
        if delta > 0 and self.places[alloc.place].current + delta > self.places[alloc.place].peak:
            self._dirty.add(alloc.place)
        if delta < 0 and alloc.place in self._dirty:
            self._snapshot(alloc.place)
        alloc.nbytes = new_nbytes
        stats = self.places[alloc.place]
        stats.current += delta
        self._raise(alloc.place, stats)

    def rehome(self, keys: set[int], place: str) -> None:
        """Count the live storages ``keys`` at ``place`` from now on (an emulated accelerator's
        host-resident model states: FSDP2's CPU offload, whose device moves are no-ops there)."""
        for key in keys:
            alloc = self.live.get(key)
            if alloc is None or alloc.place == place:
                continue
            self.places[alloc.place].current -= alloc.nbytes
            alloc.place = place
            stats = self.places[place]
            if stats.current + alloc.nbytes > stats.peak:
                self._dirty.add(place)
            stats.current += alloc.nbytes
            self._raise(place, stats)

    def start_step(self) -> None:
        """Start the peaks afresh from what is live now, and the counts from zero (the rehearsed step
        after the warm-up)."""
        self._dirty.clear()
        self.collectives.clear()
        self.collective_bytes.clear()
        self.host_traffic.clear()
        self.flops = self.attention_forward_flops = 0  # (the fused attention kernels' forward: rehearse.timing)
        for stats in self.places.values():
            stats.peak, stats.peak_at, stats.peak_all = stats.current, [], []
        self.phase_peaks.clear()
        for place in self.places:
            self._dirty.add(place)

    def finish(self) -> None:
        """Take the pending peak snapshots and stop watching the storages."""
        for place in list(self._dirty):
            self._snapshot(place)
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()

    # -- the dispatch hook --
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name
        attn = attention_flops(name.split("::", 1)[-1], args, kwargs)
        count = FLOP_FORMULAS.get(func.overloadpacket)
        if attn is not None:
            self.flops += attn
            self.attention_forward_flops += attn if name.split("::", 1)[-1] in _SDPA_FORWARD else 0
        elif count is not None:
            self.flops += int(count(*args, **kwargs, out_val=out))
        if name.startswith(("c10d::", "_c10d_functional::")):
            self._count_collective(name.split("::", 1)[1], args)
        inputs = {
            s._cdata for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and (s := storage_of(t)) is not None
        }  # fmt: skip
        self._count_traffic(func, args, out)
        if ws := kernel_workspace(name.split("::", 1)[-1], args, self.kernels):  # alive with the outputs
            key = -len(self._finalizers) - 1  # no storage has a negative key
            self._add(key, Alloc(ws, "device", (ws,), torch.uint8, "kernel workspace (modelled)", self._module(),
                                 self.phase, lambda: None))  # fmt: skip
            self._pending_workspace = key
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and (place := self._place(t)) is not None:
                s = storage_of(t)
                if s is not None and s._cdata not in inputs:
                    self.track(s, t, place, name.split("::", 1)[-1])
                    local = local_tensor(t)
                    if local.numel() > self.largest[0]:
                        self.largest = (local.numel(), tuple(local.shape), name.split("::", 1)[-1])
        if (key := self.__dict__.pop("_pending_workspace", None)) is not None:
            self._free(key)  # the kernel returned: its workspace goes
        return out

    def _where(self, t: torch.Tensor) -> str | None:
        s = storage_of(t)
        alloc = self.live.get(s._cdata) if s is not None else None
        return alloc.place if alloc is not None else self._place(t)

    def _count_traffic(self, func: Any, args: tuple, out: Any) -> None:
        """Bytes an op moves between places: each tensor input on the other place than its output
        (an in-place op's output is its first argument)."""
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outs or func._schema.name.startswith(("c10d::", "_c10d_functional::")):
            return
        dst = self._where(outs[0])
        if dst is None:
            return
        first = args[0] if args else None
        skip = {id(first)} if func._schema.is_mutable and isinstance(first, torch.Tensor) else set()
        for t in tree_leaves(args):
            if isinstance(t, torch.Tensor) and id(t) not in skip and self._where(t) not in (None, dst):
                nbytes = local_tensor(t).numel() * t.element_size()
                self.host_traffic["h2d" if dst == "device" else "d2h"] += nbytes

    def _count_collective(self, kind: str, args: tuple) -> None:
        kind = kind.rstrip("_")
        if kind in ("wait_tensor", "barrier", "monitored_barrier"):
            return
        tensors = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
        # the payload: what the op sends (first tensor argument or list), not the receive buffers
        first = args[0] if args else None
        sent = [t for t in tree_leaves(first) if isinstance(t, torch.Tensor)] or tensors[:1]
        self.collectives[kind] += 1
        self.collective_bytes[kind] += sum(t.numel() * t.element_size() for t in sent)


class ModuleStack:
    """The modules whose forward is running (global module hooks): ``parents`` names them by their
    qualified name in ``root`` (``name_modules``), innermost last. Backward is not followed: a
    storage made there is attributed to its op and phase only."""

    def __init__(self) -> None:
        self.names: dict[int, str] = {}
        self.stack: list[str] = []
        self._handles: list[Any] = []

    def name_modules(self, root: torch.nn.Module) -> None:
        self.names.update({id(m): n or type(m).__name__ for n, m in root.named_modules()})

    @property
    def parents(self) -> list[str]:
        return self.stack[-1:] if self.stack else []

    def __enter__(self) -> ModuleStack:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        def pre(module, args):  # noqa: ANN001
            self.stack.append(self.names.get(id(module), type(module).__name__))

        def post(module, args, out):  # noqa: ANN001
            if self.stack:
                self.stack.pop()

        self._handles = [
            register_module_forward_pre_hook(pre),
            register_module_forward_hook(post, always_call=True),
        ]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.stack.clear()
