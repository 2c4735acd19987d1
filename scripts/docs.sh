#!/usr/bin/env bash
# Build or serve the documentation site (mkdocs.yml): bash scripts/docs.sh [build|serve] [mkdocs args].
# Sets up .venv (scripts/setup.sh, which installs the `docs` extra), installs the extra if this
# .venv lacks it (with the CPU constraints where there is no CUDA: never a CUDA torch), then runs
# `mkdocs build --strict` (the CI check: any broken link or docstring warning fails) or `mkdocs serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if ! .venv/bin/python -c "import mkdocs, material, mkdocstrings_handlers.python" 2>/dev/null; then
  echo "docs: installing the docs extra into .venv" >&2
  .venv/bin/pip install -q --disable-pip-version-check -c constraints/cpu.txt -e '.[docs]'
fi
export NO_MKDOCS_2_WARNING=1
cmd=${1:-build}
[ $# -gt 0 ] && shift
case "$cmd" in
  build) exec .venv/bin/mkdocs build --strict "$@" ;;
  serve) exec .venv/bin/mkdocs serve --strict "$@" ;;
  *) echo "usage: bash scripts/docs.sh [build|serve] [mkdocs args]" >&2; exit 2 ;;
esac
