from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# Under pytest-xdist (``scripts/test.sh``: 2 workers) the workers share the machine's cores: each
# worker's in-process training, and the processes it launches, get cores / workers compute threads
# (the CLI honours OMP_NUM_THREADS). Two workers running 2-thread OpenMP work on 2 cores stall each
# other far beyond 2x (measured: the two in-process learning tests side by side, 152 s -> 60 s).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

from harness import WorkerPool  # noqa: E402

# ``--quick`` (``scripts/test.sh --quick``): the suite without its end-to-end runs, for the edit-test
# loop; CI runs everything. Left out: every test marked ``slow``, every test of these modules (each
# launches ``ulysses-sp``/torchrun/an example as processes, trains for long, or drives the HF Trainer
# / TRL / accelerate stack), the single tests named below, and every test that runs on the worker
# pool (the multi-rank gloo equivalence tests: sp vs no sp, ring, ZeRO, resharding). What stays runs
# in this one process: units, the data pipeline, the planner, the guard, the CLI's refusals and config.
END_TO_END_MODULES = {
    "test_cli", "test_cli_eval", "test_cli_eval_sp", "test_cli_precision", "test_cli_ring",
    "test_data_chat_learn", "test_examples", "test_gpu_check", "test_hf_trainer", "test_hf_trainer_alst",
    "test_hf_trainer_dpo", "test_hf_trainer_exact", "test_hf_trainer_grpo", "test_hf_trainer_other", "test_mixers_cli",
    "test_mixers_trainer", "test_model_sweep", "test_plan_judge", "test_rehearse", "test_reliability_cli",
    "test_shutdown", "test_vlm_cli",
}  # fmt: skip
END_TO_END_TESTS = {
    "test_guard.py::test_the_cli_refuses_a_local_model_whose_attention_bypasses_the_registry",
    "test_plan.py::test_predicted_peak_is_within_10_percent_of_measured_on_20_settings",
    "test_plan.py::test_bf16_compute_predicted_within_10_percent_and_conservative_with_norm_recompute",
}


def pytest_addoption(parser):
    parser.addoption(
        "--quick",
        action="store_true",
        help="leave out the end-to-end runs (tests/conftest.py lists them); CI runs the full suite",
    )


def _end_to_end(item) -> bool:
    module = item.path.stem
    name = f"{item.path.name}::{item.originalname}"
    return (
        module in END_TO_END_MODULES
        or name in END_TO_END_TESTS
        or item.get_closest_marker("slow") is not None
        or "pool" in getattr(item, "fixturenames", ())
    )


# The longest modules first (measured: `pytest --durations`, 2 cores), so that under pytest-xdist
# (`scripts/test.sh` runs `-n 2 --dist loadfile`: each module on one worker) no long module starts last
# and runs alone at the end; the rest keep their order. Order within a module is unchanged.
LONGEST_FIRST = [
    "test_cli", "test_examples", "test_rehearse", "test_reliability_cli", "test_bench", "test_data_chat_learn",
    "test_cli_eval", "test_cli_eval_sp", "test_vlm_cli", "test_mixers_cli", "test_hf_trainer_exact",
    "test_hf_trainer_grpo", "test_hf_trainer_dpo", "test_hf_trainer_kto_reward", "test_cli_precision", "test_cli_ring",
    "test_plan_judge", "test_shutdown", "test_engine", "test_plan",
]  # fmt: skip


def _longest_first(items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the rest keep their order


def pytest_collection_modifyitems(config, items):
    _longest_first(items)
    if not config.getoption("--quick"):
        return
    kept = [i for i in items if not _end_to_end(i)]
    left = [i for i in items if _end_to_end(i)]
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept


@pytest.fixture(scope="session")
def pool():
    """Persistent spawned workers shared by the whole session (start-up is paid once)."""
    p = WorkerPool(max_workers=8)
    yield p
    p.close()
