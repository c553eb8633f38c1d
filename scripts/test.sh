#!/usr/bin/env bash
# Sets up a fresh machine (scripts/setup.sh) and runs kvtier's checks: ruff, mypy, pytest.
# Extra arguments go to pytest.
set -euo pipefail
# shellcheck source=scripts/setup.sh
. "$(dirname "$0")/setup.sh"

echo "== ruff"
ruff check src tests benchmarks
ruff format --check src tests benchmarks
echo "== mypy"
mypy
echo "== pytest"
python -m pytest -q "$@"
