#!/usr/bin/env bash
# Set up everything (see scripts/setup.sh), lint, build the docs site strictly, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests bench scripts
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet   # seconds; a broken link or page fails CI
.venv/bin/python -m pytest -q "$@"
