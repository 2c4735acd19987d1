#!/usr/bin/env bash
# Set up everything (see scripts/setup.sh), lint, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests bench
.venv/bin/python -m pytest -q "$@"
