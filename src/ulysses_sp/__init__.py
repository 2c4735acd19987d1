"""ulysses-sp: Ulysses sequence parallelism and ALST long-sequence training for HuggingFace models.

Importing the package has no side effects: no process groups, no registration, no env writes.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .mesh import Mpu, data_parallel_world_size, init_mesh

__all__ = ["Mpu", "__version__", "data_parallel_world_size", "init_mesh"]
