"""ulysses-sp: Ulysses sequence parallelism and ALST long-sequence training for HuggingFace models.

Importing the package has no side effects: no process groups, no registration, no env writes.
The names below are loaded on first use, so ``import ulysses_sp`` stays cheap.

Packages, bottom to top (imports run one way; ``tests/test_architecture.py`` enforces it):
``checks`` → ``parallel`` → {``attention``, ``memory``, ``data``} → {``config``, ``state``,
``engine``, ``plan``, ``tasks``} → {``run``, ``integrations``} → ``cli``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Mpu": "parallel.mesh",
    "init_mesh": "parallel.mesh",
    "shutdown": "parallel.mesh",
    "data_parallel_world_size": "parallel.mesh_shape",
    "UlyssesSPAttentionHF": "attention.ulysses",
    "sp_causal_lm_loss": "parallel.loss",
    "UlyssesSPDataLoaderAdapter": "data",
    "PackingCollator": "data",
    "sp_data_sampler": "data",
    "declare_position_wise": "mixers.guard",
    "initialize": "engine",
    "Engine": "engine",
    "TrainingConfig": "config",
    "load_config": "config",
    "TiledMLP": "memory.tiling",
    "apply_tiled_mlp": "memory.tiling",
    "sequence_tiled_compute": "memory.tiling",
    "tiled_causal_lm_loss": "memory.tiling",
    "TiledCausalLMLoss": "memory.tiling",
    "enable_activation_offload": "memory.offload",
    "track_peak_memory": "memory.meter",
    "sequence_logps": "objectives.logps",
    "model_logps": "objectives.logps",
    "SequenceLogps": "objectives.logps",
    "gather_sequence": "objectives.logps",
    "sum_over_sequence": "objectives.logps",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
