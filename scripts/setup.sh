#!/usr/bin/env bash
# Creates .venv (if missing) and installs kvtier with the CPU build of torch and its extras.
# Sourced by test.sh and demo.sh; safe to re-run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY=${PYTHON:-python3}
VENV=${KVTIER_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off

# The CPU build of torch: an unpinned torch pulls a multi-GB CUDA build.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev,plot]"
