#!/usr/bin/env bash
# Set up everything (see scripts/setup.sh), then run the main job: sequence-parallel training on
# the embedded default task (2 local processes, sp=2, CPU or CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ulysses-sp train "$@"
