"""The hardware side of the planner: a small table of devices and links, and byte-size parsing.

Every constant the time model uses is here, stated once; ``Hardware`` is a frozen dataclass, so a
user (or ``ulysses-sp plan --tflops/--link-gbps/...``) overrides any field with
``dataclasses.replace``. The numbers are vendor peaks (dense, no sparsity) and the achieved
fractions are assumptions, written next to them, not measurements.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ulysses_sp.parallel.exchange_cost import GLOO_SHM, NCCL_IB, NCCL_NVLINK, LinkCost

GB = 10**9
GiB = 1 << 30


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One accelerator kind and the links between accelerators."""

    name: str
    """Table key (``h100``, ``a100``, ``h200``, ``cpu``)."""
    memory_bytes: int
    """Memory of one device, in bytes (what a rank may use)."""
    tflops: dict[str, float]
    """Peak dense matmul TFLOP/s by dtype (``"bf16"``, ``"fp32"``)."""
    mfu: float = 0.4
    """Achieved fraction of ``tflops`` for the model's compute (an assumption)."""
    intra_gbps: float = 360.0
    """Achieved all-to-all / all-reduce bandwidth per device inside a node, GB/s per direction."""
    inter_gbps: float = 40.0
    """Achieved bandwidth per device between nodes, GB/s per direction."""
    gpus_per_node: int = 8
    """Devices per node: groups larger than this cross the inter-node link."""
    reserve_bytes: int = 6 * GB
    """Held back for the runtime context, allocator fragmentation and kernel workspaces."""
    host_to_device_gbps: float = 25.0
    """Achieved host<->device copy bandwidth (activation and model-state offload)."""
    intra_link: LinkCost = NCCL_NVLINK
    """One all-to-all's latency and the copy cost inside a node (``parallel/exchange_cost.py``): the
    attention exchange's choice, packed or head by head, and its latency term."""
    inter_link: LinkCost = NCCL_IB
    """The same between nodes."""


DEVICES: dict[str, Hardware] = {
    # H100 SXM: 989 TFLOP/s bf16 dense, NVLink-4 450 GB/s per direction (80 % achieved), IB 400 Gb/s.
    "h100": Hardware(name="h100", memory_bytes=80 * GB, tflops={"bf16": 989.0, "fp32": 67.0}),
    "h200": Hardware(name="h200", memory_bytes=141 * GB, tflops={"bf16": 989.0, "fp32": 67.0}),
    # A100 SXM 80GB: 312 TFLOP/s bf16, NVLink-3 300 GB/s per direction.
    "a100": Hardware(
        name="a100",
        memory_bytes=80 * GB,
        tflops={"bf16": 312.0, "fp32": 19.5},
        intra_gbps=240.0,
        inter_gbps=20.0,
    ),
    # A CPU "device" (gloo over shared memory): only the memory side is meaningful; the speeds are a
    # rough 2-core laptop-class guess so that the time column is finite.
    "cpu": Hardware(
        name="cpu",
        memory_bytes=16 * GB,
        tflops={"bf16": 0.05, "fp32": 0.1},
        mfu=0.5,
        intra_gbps=2.0,
        inter_gbps=1.0,
        gpus_per_node=1 << 20,
        reserve_bytes=0,
        host_to_device_gbps=1e6,
        intra_link=GLOO_SHM,
        inter_link=GLOO_SHM,
    ),  # fmt: skip
}

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": GB, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20,
          "gib": GiB, "tib": 1 << 40}  # fmt: skip


def parse_bytes(text: str | int, *, what: str = "--memory") -> int:
    """``"80GB"``, ``"20 GiB"``, ``"512MB"`` or a plain number of bytes -> bytes (``ValueError``)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{what} must be a size like 80GB, 20GiB or 512MB, got {text!r}")
        value, unit = float(m.group(1)), m.group(2).lower()
    nbytes = int(value * _UNITS[unit])
    if nbytes <= 0:
        raise ValueError(f"{what} must be > 0 bytes, got {text!r}")
    return nbytes


def device(name: str) -> Hardware:
    """The table entry ``name`` (``ValueError`` naming the known ones)."""
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(DEVICES)}")
    return DEVICES[name]


def link_cost(hw: Hardware, group_size: int) -> LinkCost:
    """The ``LinkCost`` of a collective over ``group_size`` consecutive ranks (as ``link_gbps``)."""
    return hw.intra_link if group_size <= hw.gpus_per_node else hw.inter_link


def link_gbps(hw: Hardware, group_size: int, stride: int = 1) -> float:
    """Bandwidth a collective over ``group_size`` ranks spaced ``stride`` apart gets: the
    inter-node link once the group spans more than one node."""
    return hw.intra_gbps if group_size * stride <= hw.gpus_per_node else hw.inter_gbps
