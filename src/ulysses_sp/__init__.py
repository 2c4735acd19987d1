"""ulysses-sp: Ulysses sequence parallelism and ALST long-sequence training for HuggingFace models.

Importing the package has no side effects: no process groups, no registration, no env writes.
The names below are loaded on first use, so ``import ulysses_sp`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Mpu": "mesh",
    "init_mesh": "mesh",
    "shutdown": "mesh",
    "data_parallel_world_size": "mesh_shape",
    "UlyssesSPAttentionHF": "attention",
    "sp_causal_lm_loss": "loss",
    "UlyssesSPDataLoaderAdapter": "data",
    "PackingCollator": "data",
    "sp_data_sampler": "data",
    "initialize": "engine",
    "Engine": "engine",
    "TrainingConfig": "config",
    "load_config": "config",
    "TiledMLP": "tiling",
    "apply_tiled_mlp": "tiling",
    "sequence_tiled_compute": "tiling",
    "tiled_causal_lm_loss": "tiling",
    "TiledCausalLMLoss": "tiling",
    "enable_activation_offload": "offload",
    "track_peak_memory": "memory",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
