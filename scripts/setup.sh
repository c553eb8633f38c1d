#!/usr/bin/env bash
# Creates .venv (if missing) and installs kvtier with the CPU build of torch and its extras.
# Sourced by test.sh and demo.sh; safe to re-run.
set -euo pipefail
VENV=${KVTIER_VENV:-}
# A relative KVTIER_VENV is from the caller's directory, as the scripts' other paths are: read
# from the repository root it named another, missing, environment, and one was created there.
if [ -n "$VENV" ] && [ "${VENV#/}" = "$VENV" ]; then
  VENV="$PWD/$VENV"
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
# Also over an environment without pip (a venv made where ensurepip was missing, or with
# --without-pip): it has a python, and every later run stopped at "No module named pip".
# venv keeps what is installed and adds pip.
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import pip" 2>/dev/null; then
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off

# Pinned: an unpinned torch pulls a multi-GB CUDA build. This project's machines serve 2.13.0 as
# the CPU build; elsewhere install it first into $VENV from https://download.pytorch.org/whl/cpu
# (README): 2.13.0+cpu satisfies this pin, so pip keeps it and fetches nothing.
python -m pip install -q "torch==2.13.0"
# vLLM 0.33.0 on CPU: its declared dependencies include CUDA-only pins no CPU machine can meet, so
# it goes in without them and its pure-Python dependencies come from requirements/. Skip with
# KVTIER_WITH_VLLM=0 (the vLLM tests then skip themselves). Another version in a reused
# environment is replaced: kvtier's vLLM tests and requirements/ are for this one.
if [ "${KVTIER_WITH_VLLM:-1}" = "1" ] && ! python -c "import sys, importlib.metadata as m, vllm
sys.exit(m.version('vllm') != '0.33.0')" 2>/dev/null; then
  python -m pip install -q --no-deps "vllm==0.33.0"
  python -m pip install -q -r requirements/vllm033-cpu.txt
  python -m pip install -q --no-deps "xgrammar==0.2.8" apache-tvm-ffi
fi
python -m pip install -q -e ".[dev,plot,hf]"
export HF_HUB_OFFLINE=1
