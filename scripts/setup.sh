#!/usr/bin/env bash
# Create .venv and install ulysses-sp (editable, with the test and docs extras). Idempotent: a stamp keyed on
# pyproject.toml and the constraints file skips the install when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.ulysses-sp-installed
want=$(cat pyproject.toml constraints/cpu.txt | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
pip_args=(-q --disable-pip-version-check)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "setup: CUDA present, installing the default (CUDA) PyTorch build" >&2
  .venv/bin/pip install "${pip_args[@]}" -e '.[test,docs]'
else
  echo "setup: no CUDA, pinning the CPU build of PyTorch (constraints/cpu.txt)" >&2
  .venv/bin/pip install "${pip_args[@]}" -c constraints/cpu.txt 'torch==2.13.0'
  .venv/bin/pip install "${pip_args[@]}" -c constraints/cpu.txt -e '.[test,docs]'
fi
echo "$want" > "$stamp"
