"""``ulysses-sp env``: what a bug report needs about this machine, as ``transformers env`` prints it.

The package and Python versions, torch's build (CUDA / NCCL / cuDNN where present, the CPU build
otherwise), the libraries the Trainer path and the kernels use (transformers, accelerate, TRL, PEFT,
datasets, safetensors, flash-attn, liger-kernel: "not installed" where absent), the distributed
backends torch was built with, the accelerators with their memory, and the host's CPU count and
memory. Nothing is initialised beyond what ``torch.cuda`` queries need; ``--json`` gives a dict.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import platform
from typing import Any

LIBRARIES = ("transformers", "accelerate", "trl", "peft", "datasets", "safetensors", "flash-attn", "liger-kernel")
"""Distributions reported by version (a missing one: ``not installed``)."""


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _host_memory() -> int | None:
    """Total host memory in bytes (``sysconf``), ``None`` where the platform does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def collect() -> dict[str, Any]:
    """The report as a dict of strings and numbers (``env_report`` formats it)."""
    import torch
    import torch.distributed as dist

    from ulysses_sp import __version__

    info: dict[str, Any] = {
        "ulysses-sp": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch CUDA": torch.version.cuda or "none (CPU build)",
    }
    info.update({name: _version(name) for name in LIBRARIES})
    backends = [b for b, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()),
                                ("mpi", dist.is_mpi_available())) if ok]  # fmt: skip
    info["distributed backends"] = ", ".join(backends) or "none"
    if torch.cuda.is_available():
        info["NCCL"] = ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else "none"
        info["cuDNN"] = str(torch.backends.cudnn.version())
        info["devices"] = [
            f"{torch.cuda.get_device_name(i)} ({torch.cuda.get_device_properties(i).total_memory / 2**30:.1f} GiB, "
            f"compute capability {'.'.join(map(str, torch.cuda.get_device_capability(i)))})"
            for i in range(torch.cuda.device_count())
        ]
        info["bf16 supported"] = bool(torch.cuda.is_bf16_supported())
    else:
        info["devices"] = ["cpu only (no CUDA device visible)"]
    info["CPU cores"] = os.cpu_count()
    memory = _host_memory()
    info["host memory"] = f"{memory / 2**30:.1f} GiB" if memory else "unknown"
    for var in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "NCCL_DEBUG"):
        if var in os.environ:
            info[var] = os.environ[var]
    return info


def env_report(as_json: bool = False) -> str:
    """The report: ``- key: value`` lines to paste into an issue, or JSON."""
    info = collect()
    if as_json:
        return json.dumps(info, indent=1)
    lines = ["Copy-and-paste the text below into your issue:", ""]
    for key, value in info.items():
        if isinstance(value, list):
            lines.append(f"- {key}:")
            lines += [f"    - {v}" for v in value]
        else:
            lines.append(f"- {key}: {value}")
    return "\n".join(lines)
