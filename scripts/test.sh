#!/usr/bin/env bash
# Set up everything (see scripts/setup.sh), lint, build the docs site strictly, then run the whole test suite.
# Arguments go to pytest: `--quick` leaves out the end-to-end and multi-rank tests (tests/conftest.py);
# CI (.ci/run) runs it without arguments, i.e. everything. pytest-xdist runs the modules on
# ULYSSES_SP_TEST_JOBS workers (default 2; `-n 0` among the arguments: one process), each module whole on
# one worker (`--dist loadfile`: module-scoped fixtures run once), the longest modules first (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests bench scripts
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet   # seconds; a broken link or page fails CI
.venv/bin/python -m pytest -q -n "${ULYSSES_SP_TEST_JOBS:-2}" --dist loadfile --durations=15 "$@"
