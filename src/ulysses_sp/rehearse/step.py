"""One training step of a ``train`` run, rehearsed on fake tensors: the real program at real shapes.

``rehearse_step(cfg, model_config, batch, gpus=..., rank=..., device=...)`` builds what ``run.loop``
builds — the model from its config alone (parameters on the meta device, no weight read), the ALST
transforms (``run.model_checks.apply_techniques``), the SP registration, ``initialize`` (FSDP2 / DDP, the
optimizer) — as ``rank`` of ``gpus`` ranks on a fake process group, and runs one micro-step
(``run.loop.micro_step``: forward, backward) and ``engine.step()`` under ``StepTracker`` (bytes per
place, the tensors alive at the peak, collectives) and ``FlopCounterMode``. Nothing is allocated:
a Llama-3-8B step at a million tokens runs in a minute of CPU time.

Model states are counted directly (the issue's advice: count what you can count): the rank's
parameter shards, gradient shards and optimizer state after the step, by storage identity, and the
step's peak is split into them and the rest (activations alive from the forward, temporaries).

Shape legend: ``B`` micro-batch, ``S`` sequence, ``S_l = S/P``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ulysses_sp.memory.meter import following_resize
from ulysses_sp.rehearse.fake import (
    HostReadError,
    HostReads,
    HostValues,
    RehearsalDevice,
    fake_world,
    real_submeshes,
)
from ulysses_sp.rehearse.tracker import ModuleStack, StepTracker

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What a rehearsed step measured on one rank. Bytes unless named otherwise."""

    rank: int
    device_peak: int
    host_peak: int
    breakdown: dict[str, int]
    """The device peak split: parameters, gradients, optimizer state, activations, temporaries."""
    top: list[dict[str, Any]]
    """The largest device tensors alive at the peak: bytes, shape, dtype, op, module, phase."""
    peak_phase: str
    peak_module: str
    phase_peaks: dict[str, int]
    """The device's high point within each phase (forward, backward, optimizer)."""
    collectives: dict[str, dict[str, int]]
    """Per kind: ``count`` and ``bytes`` sent by this rank in the step."""
    flops: int
    seconds: float
    attention_forward_flops: int = 0
    """Of ``flops``: the fused attention kernels' forwards (checkpoint recomputes included)."""
    host_traffic: dict[str, int] = field(default_factory=dict)
    """Bytes copied ``h2d`` and ``d2h`` between host and device in the step."""
    largest: dict[str, Any] = field(default_factory=dict)
    """The largest tensor made anywhere in the step: ``numel``, ``shape``, ``op``."""
    phases: dict[str, float] = field(default_factory=dict)
    """Wall seconds of each phase of the rehearsal (build, forward+backward, optimizer)."""


def _fake_buffers(model: nn.Module, mode: Any) -> None:
    """Real (CPU) buffers -> fake tensors, so device moves stay inside the fake mode."""
    for module in model.modules():
        for name, b in list(module._buffers.items()):
            if b is not None and not b.is_meta:
                module._buffers[name] = mode.from_tensor(b)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _state_storages(engine: Any) -> dict[str, set[int]]:
    """Storage keys of this rank's parameter shards, gradient shards and optimizer state."""
    params = [p for p in engine.module.parameters()]
    keys: dict[str, set[int]] = {"parameters": set(), "gradients": set(), "optimizer state": set()}
    for p in params:
        keys["parameters"].add(_local(p).untyped_storage()._cdata)
        if p.grad is not None:
            keys["gradients"].add(_local(p.grad).untyped_storage()._cdata)
    opt = engine.optimizer
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer wraps the local optimizer
    for state in getattr(inner, "state", {}).values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.numel() > 1:
                keys["optimizer state"].add(_local(v).untyped_storage()._cdata)
    return keys


def _split(allocs: list[tuple[Any, int, str]], states: dict[str, set[int]]) -> dict[str, int]:
    """Bytes of ``allocs`` (``(storage ref, bytes, phase)`` alive at a peak) per category: a model
    state by storage identity, else activations (made in the forward) or temporaries."""
    owner = {k: name for name, ks in states.items() for k in ks}
    out = {"parameters": 0, "gradients": 0, "optimizer state": 0, "activations": 0, "temporaries": 0}
    for ref, nbytes, phase in allocs:
        s = ref()
        cat = owner.get(s._cdata) if s is not None else None
        if cat is None:
            cat = "activations" if phase == "forward" else "temporaries"
        out[cat] += nbytes
    return out


def rehearse_step(
    build: Callable[[], tuple[nn.Module, Any]],
    make_engine: Callable[[nn.Module, Any], Any],
    batch: dict[str, Any],
    *,
    gpus: int,
    rank: int,
    device: RehearsalDevice,
    micro_step: Callable[[Any, dict[str, Any]], None],
    host_states: bool = False,
    progress: Callable[[str], None] | None = None,
) -> StepResult:
    """One rehearsed step on ``rank`` of ``gpus`` fake ranks (see the module docstring).

    Args:
        build: ``() -> (model on meta, mesh)``, called on the fake world before the fake tensors
            exist (the meshes' own tensors must be real).
        make_engine: ``(model, mesh) -> engine``: the techniques, registration and ``initialize``.
        batch: this rank's micro-batch, real CPU tensors (``[B, S_l]`` entries).
        micro_step: ``(engine, batch) -> None``: the run's forward + backward.
        host_states: the model states live on the host (FSDP2 CPU offload); on an emulated
            accelerator they are counted there (``StepTracker.rehome``), elsewhere their device says so.
        progress: called with a line as each phase ends (model and engine built, forward+backward,
            optimizer step), or ``None``.
    """
    say = progress or (lambda line: None)
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    t0 = time.perf_counter()
    phases: dict[str, float] = {}
    from ulysses_sp.parallel.exchange_cost import fake_backend_as

    stands_for = "gloo" if device.requested == "cpu" else "nccl"  # the exchange a real run there would choose
    with fake_world(gpus, rank), fake_backend_as(stands_for):
        model, mesh = build()
        for partition in ("all", "data_parallel"):  # FSDP's meshes: built from real groups, outside the fake mode
            mesh.fsdp_mesh(partition)
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        mods = ModuleStack()
        tracker = StepTracker(device.tensor_device, mods, kernels=device.requested)
        reads = HostReads()
        homed = _grads_homed(tracker) if host_states and device.emulated else contextlib.nullcontext()
        with real_submeshes(), mode, reads, mods, tracker, following_resize(tracker.resized), homed, HostValues():
            _fake_buffers(model, mode)
            engine = make_engine(model, mesh)  # FSDP2 shards the meta parameters, then makes its shards
            mods.name_modules(engine.module)
            _warm_optimizer(engine, reads)
            if host_states and device.emulated:  # the optimizer updates host-resident states on the host
                tracker.rehome(set().union(*_state_storages(engine).values()), "host")
                tracker.host_phases.add("optimizer")
            tracker.start_step()  # the step's own peaks and counts (steady state), not the warm-up's
            phases["build"] = time.perf_counter() - t0
            say(f"rank {rank}: model and engine built ({phases['build']:.0f} s)")
            layout = batch.pop("_layout", None)
            fake_batch = {k: mode.from_tensor(v) if torch.is_tensor(v) else v for k, v in batch.items()}
            host = getattr(layout, "host_keys", ())  # kept on the host by the adapter (a VLM's pixels)
            fake_batch = {k: v.to(engine.device) if torch.is_tensor(v) and k not in host else v for k, v in fake_batch.items()}
            if hasattr(layout, "attach"):  # a VLM's (vlm.layout): on its input_ids, as the adapter yields them
                layout.attach(fake_batch)
            elif layout is not None:  # the data adapter's host layout, on the shard's position ids as it yields them
                from ulysses_sp.parallel.doc_layout import attach_layout

                attach_layout(fake_batch["position_ids"], layout)
            tracker.phase = "forward"
            _backward_phase(tracker, engine)
            try:
                micro_step(engine, fake_batch)
                states = _state_storages(engine)  # the gradients: gone after the step's zero_grad
            except DataDependentOutputException as e:
                raise HostReadError(
                    f"host read of a tensor value inside the step ({e}): the rehearsal cannot answer it, and on a "
                    "GPU it is a device sync; the layers must take layout values from the data adapter"
                ) from e
            phases["forward+backward"] = time.perf_counter() - t0 - phases["build"]
            say(f"rank {rank}: forward and backward ({phases['forward+backward']:.0f} s)")
            tracker.phase = "optimizer"
            with reads.answer():
                engine.step()
            phases["optimizer"] = time.perf_counter() - t0 - phases["build"] - phases["forward+backward"]
            say(f"rank {rank}: optimizer step ({phases['optimizer']:.0f} s)")
            tracker.finish()
            for name, keys in _state_storages(engine).items():
                states[name] |= keys
            result = _result(tracker, states, rank)
        del engine, model
    result.seconds = time.perf_counter() - t0
    result.phases = phases
    return result


def _warm_optimizer(engine: Any, reads: HostReads) -> None:
    """Make the optimizer's state as a run holds it from its second step on (AdamW builds it lazily
    at its first step): one step on zero gradients, then the gradients dropped. The rehearsed step is
    then a steady-state step, as ``bench/plan_check.py``'s warm-up step makes the measured one."""
    params = [p for p in engine.module.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    with reads.answer():
        engine.optimizer.step()
    engine.optimizer.zero_grad(set_to_none=True)


@contextlib.contextmanager
def _grads_homed(tracker: StepTracker) -> Any:
    """FSDP2 CPU offload on an emulated accelerator: each parameter group's reduced gradient shards
    counted on the host as soon as FSDP2 hands them over (its device-to-host copy is a no-op there).
    Wraps ``FSDPParamGroup.post_backward`` (PyTorch-internal; without it the gradients count on the
    device: a rehearsal that errs high)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError:
        yield
        return
    original = FSDPParamGroup.post_backward

    def post_backward(group, *args):  # noqa: ANN001 - FSDP2's own signature
        out = original(group, *args)
        grads = (getattr(p.sharded_param, "grad", None) for p in group.fsdp_params)
        tracker.rehome({_local(g).untyped_storage()._cdata for g in grads if g is not None}, "host")
        return out

    FSDPParamGroup.post_backward = post_backward
    try:
        yield
    finally:
        FSDPParamGroup.post_backward = original


def _backward_phase(tracker: StepTracker, engine: Any) -> None:
    """Switch the tracker's phase to ``backward`` when autograd starts on this step's loss."""
    original = engine.backward

    def backward(loss: torch.Tensor) -> torch.Tensor:
        tracker.phase = "backward"
        return original(loss)

    engine.backward = backward


def _result(tracker: StepTracker, states: dict[str, set[int]], rank: int) -> StepResult:
    dev, host = tracker.places["device"], tracker.places["host"]
    breakdown = _split(dev.peak_all, states)
    top = [
        {"bytes": a.nbytes, "shape": list(a.shape), "dtype": str(a.dtype).replace("torch.", ""), "op": a.op,
         "module": a.module, "phase": a.phase}
        for a in dev.peak_at
    ]  # fmt: skip
    collectives = {k: {"count": n, "bytes": tracker.collective_bytes[k]} for k, n in tracker.collectives.items()}
    return StepResult(rank=rank, device_peak=dev.peak, host_peak=host.peak, breakdown=breakdown,
                      top=top, peak_phase=dev.peak_phase,
                      peak_module=dev.peak_module, phase_peaks=dict(tracker.phase_peaks),
                      largest=dict(zip(("numel", "shape", "op"), tracker.largest)), collectives=collectives, flops=tracker.flops,
                      attention_forward_flops=tracker.attention_forward_flops,
                      host_traffic=dict(tracker.host_traffic),
                      seconds=0.0)  # fmt: skip


@contextlib.contextmanager
def quiet() -> Any:
    """Silence transformers' and torch.distributed's info logs while a rehearsal runs."""
    names = ("torch.distributed", "transformers", "torch._subclasses")
    prev = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for n, level in prev.items():
            logging.getLogger(n).setLevel(level)
