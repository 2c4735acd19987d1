#!/usr/bin/env bash
# Set up everything (see scripts/setup.sh), then run the main job: sequence-parallel training on
# the embedded recall task (2 local processes, sp=2, CPU or CUDA), then evaluate the checkpoint
# against the untrained model and plot the per-position loss.
# Extra arguments go to `ulysses-sp train` (e.g. `bash scripts/demo.sh --steps 50`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
out=runs/demo
.venv/bin/ulysses-sp train --output-dir "$out" --overwrite --metrics-file "$out/metrics.jsonl" "$@"
.venv/bin/ulysses-sp eval --model tiny-llama "$out" --sp 2 --nproc 2 --output-json "$out/eval.json" --plot "$out/eval.png"
echo "demo: metrics $out/metrics.jsonl, evaluation $out/eval.json, plot $out/eval.png"
