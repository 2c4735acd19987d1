#!/usr/bin/env bash
# Create bench/.venv-deepspeed: a SEPARATE virtual environment holding DeepSpeed (from PyPI), the same
# torch and transformers as the main venv, used only by the side-by-side benchmark
# (bench/steploop.py --impl deepspeed). DeepSpeed is never a dependency of ulysses-sp.
#
#   bash bench/setup_deepspeed.sh            # idempotent; a stamp skips the install when done
#
# On a machine without CUDA the torch pin (constraints/cpu.txt: torch==2.13.0) is passed as a pip
# constraint to every install, so no dependency of deepspeed can pull a multi-GB CUDA torch.
# DS_BUILD_OPS=0: no C++/CUDA op is compiled at install time (DeepSpeed JIT-builds ops on first use;
# the Ulysses path with ZeRO 0-2 and torch.optim needs none).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=bench/.venv-deepspeed
DS_VERSION=${DS_VERSION:-0.19.8}
TRANSFORMERS_VERSION=$(.venv/bin/python -c 'import transformers; print(transformers.__version__)' 2>/dev/null || echo "")
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp=$VENV/.installed
want=$(printf '%s %s %s' "$DS_VERSION" "$TRANSFORMERS_VERSION" "$(cat constraints/cpu.txt)" | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
pip_args=(-q --disable-pip-version-check)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  cons=()
else
  cons=(-c constraints/cpu.txt)
fi
tf_spec=transformers
if [ -n "$TRANSFORMERS_VERSION" ]; then tf_spec="transformers==$TRANSFORMERS_VERSION"; fi
"$VENV/bin/pip" install "${pip_args[@]}" "${cons[@]}" 'torch==2.13.0'
# deepspeed's setup.py imports these at build time when it has to build from an sdist.
"$VENV/bin/pip" install "${pip_args[@]}" "${cons[@]}" py-cpuinfo ninja packaging psutil hjson msgpack pydantic numpy tqdm
DS_BUILD_OPS=0 DS_SKIP_CUDA_CHECK=1 "$VENV/bin/pip" install "${pip_args[@]}" "${cons[@]}" \
  "deepspeed==$DS_VERSION" "$tf_spec" safetensors
"$VENV/bin/python" -c 'import deepspeed, torch, transformers; print("deepspeed", deepspeed.__version__, "torch", torch.__version__, "transformers", transformers.__version__)'
echo "$want" > "$stamp"
