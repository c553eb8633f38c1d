#!/usr/bin/env bash
# Sets up a fresh machine (scripts/setup.sh) and runs kvtier's checks: ruff, mypy, pytest.
# Extra arguments go to pytest. A test path (or node id, path::name) is read from the directory
# it was called from, and from the repository root where it names nothing there; values of
# options that are not paths (-k, -m, -p, ...) are passed as given.
set -euo pipefail
caller=$PWD
# Ctrl-C exits 130, as kvtier does: pip's status for it, 1, read as a failed check, and
# pytest's, 2, as a usage error.
trap 'echo "test.sh: interrupted" >&2; exit 130' INT
# shellcheck source=scripts/setup.sh
. "$(dirname "$0")/setup.sh"  # moves to the repository root

# Made absolute: pytest runs from the root, where `cd tests && test.sh policies/test_arc.py`
# found no such file. Left alone from the root (CI) and where the caller has no such path;
# --deselect takes a node id as pytest names it, from the root.
if [ "$caller" != "$PWD" ]; then
  n=$# prev=
  while [ "$n" -gt 0 ]; do
    arg=$1
    shift
    n=$((n - 1))
    case $prev in
      -k | -m | -p | -o | -W | -r | -n | --tb | --maxfail | --durations | --deselect \
        | --import-mode | --capture | --color | --log-level | --override-ini) ;;
      *)
        if [ -n "$arg" ] && [ "${arg#[-/]}" = "$arg" ] && [ -e "$caller/${arg%%::*}" ]; then
          arg=$caller/$arg
        fi
        ;;
    esac
    set -- "$@" "$arg"
    prev=$arg
  done
fi

echo "== ruff"
ruff check src tests benchmarks
ruff format --check src tests benchmarks
echo "== mypy"
mypy
echo "== pytest"
python -m pytest -q "$@"
