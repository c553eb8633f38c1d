#!/usr/bin/env bash
# Creates .venv (if missing) and installs kvtier with the CPU build of torch and its extras.
# Sourced by test.sh and demo.sh; safe to re-run.
set -euo pipefail
# Refused by name: any value but 1 skipped vLLM, so KVTIER_WITH_VLLM=true or yes did the opposite.
WITH_VLLM=${KVTIER_WITH_VLLM:-1}
if [ "$WITH_VLLM" != 0 ] && [ "$WITH_VLLM" != 1 ]; then
  echo "setup.sh: error: KVTIER_WITH_VLLM='$WITH_VLLM'; expected 0 (skip vLLM) or 1 (install it," \
    "the default)" >&2
  exit 2
fi
VENV=${KVTIER_VENV:-}
# A relative KVTIER_VENV is from the caller's directory, as the scripts' other paths are: read
# from the repository root it named another, missing, environment, and one was created there.
if [ -n "$VENV" ] && [ "${VENV#/}" = "$VENV" ]; then
  VENV="$PWD/$VENV"
fi
# So is a relative PYTHON path (PYTHON=./py): a bare name (python3.12) is looked up in PATH.
PY=${PYTHON:-python3}
if [ "${PY#*/}" != "$PY" ] && [ "${PY#/}" = "$PY" ]; then
  PY="$PWD/$PY"
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# How an error names a setting (NAME VALUE RESOLVED UNSET-TEXT): its value, and the path it
# was read as where that differs.
setting() {
  if [ -z "$2" ]; then
    echo "$4"
  elif [ "$2" = "$3" ]; then
    echo "$1='$2'"
  else
    echo "$1='$2' ($3)"
  fi
}

VENV=${VENV:-.venv}
# A python that no longer runs (a link to an interpreter since removed) venv cannot repair: it
# failed with "[Errno 2] No such file or directory".
if [ -L "$VENV/bin/python" ] && [ ! -e "$VENV/bin/python" ]; then
  echo "setup.sh: error: $VENV/bin/python links to a Python that is gone (one removed or" \
    "upgraded since); remove $VENV to have it rebuilt, or name another one in KVTIER_VENV" >&2
  exit 2
fi
# venv writes into whatever it is given: KVTIER_VENV=. or =src put bin/, lib/ and pyvenv.cfg
# into the repository. An environment has pyvenv.cfg (or, from old virtualenvs, bin/activate).
named=$(setting KVTIER_VENV "${KVTIER_VENV:-}" "$VENV" \
  "$PWD/$VENV (the default; KVTIER_VENV names another)")
if [ -e "$VENV" ] && [ ! -d "$VENV" ]; then
  echo "setup.sh: error: $named is not a directory; expected a virtual environment, an empty" \
    "directory or a path to create one at" >&2
  exit 2
fi
if [ -d "$VENV" ] && [ ! -e "$VENV/pyvenv.cfg" ] && [ ! -e "$VENV/bin/activate" ] \
    && [ -n "$(ls -A "$VENV")" ]; then
  echo "setup.sh: error: $named is a directory that is neither a virtual environment (no" \
    "pyvenv.cfg) nor empty; expected an environment, an empty directory or a path to create" \
    "one at" >&2
  exit 2
fi
# Also over an environment without pip (a venv made where ensurepip was missing, or with
# --without-pip): it has a python, and every later run stopped at "No module named pip".
# venv keeps what is installed and adds pip.
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import pip" 2>/dev/null; then
  # Checked before venv runs: a missing PYTHON ended in bash's "command not found", and a 3.10
  # one (Ubuntu 22.04's python3) left a new environment behind that had to be removed by hand.
  pyname=$(setting PYTHON "${PYTHON:-}" "$PY" "$PY (PYTHON unset)")
  if ! command -v "$PY" >/dev/null; then
    echo "setup.sh: error: $pyname is not a command; expected a Python 3.11 or newer to create" \
      "$VENV with: set PYTHON to one" >&2
    exit 2
  fi
  if ! found=$("$PY" -c 'import sys; print(sys.version.split()[0])
sys.exit(sys.version_info < (3, 11))'); then
    found=${found:+Python $found}
    echo "setup.sh: error: $pyname is ${found:-no Python that runs}; kvtier needs 3.11 or newer" \
      "to create $VENV with: set PYTHON to such a python" >&2
    exit 2
  fi
  "$PY" -m venv "$VENV"
fi
# Older than kvtier's requires-python: with 3.10, torch went in and then pip spent over ten
# minutes resolving kvtier's extras, saying nothing.
if ! found=$("$VENV/bin/python" -c 'import sys; print(sys.version.split()[0])
sys.exit(sys.version_info < (3, 11))'); then
  echo "setup.sh: error: $VENV has Python $found; kvtier needs 3.11 or newer: remove $VENV and" \
    "run again with PYTHON set to such a python (now ${PYTHON:-python3})" >&2
  exit 2
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
# environment is replaced: kvtier's vLLM tests and requirements/ are for this one. Its
# dependencies are checked on every run, not only with vLLM: `import vllm` needs few of them, so
# a run stopped after vLLM went in left it importable and the rest never installed.
if [ "$WITH_VLLM" = 1 ]; then
  if ! python -c "import sys, importlib.metadata as m, vllm
sys.exit(m.version('vllm') != '0.33.0')" 2>/dev/null; then
    python -m pip install -q --no-deps "vllm==0.33.0"
  fi
  python -m pip install -q -r requirements/vllm033-cpu.txt
  python -m pip install -q --no-deps "xgrammar==0.2.8" "apache-tvm-ffi==0.1.15.post2"
fi
python -m pip install -q -e ".[dev,plot,hf]"
export HF_HUB_OFFLINE=1
