#!/usr/bin/env bash
# Sets up a fresh machine (scripts/setup.sh) and runs kvtier's main job.
# Extra arguments go to the command, relative paths (--model, --json) from where it was called.
set -euo pipefail
caller=$PWD
# A failed set-up (pip, venv) exits 2 with one line, as kvtier demo does without transformers:
# its own status, 1, is the demo's "tokens differ".
trap 'echo "demo.sh: error: setting up the environment (scripts/setup.sh) failed with" \
  "status $?; the lines above say why" >&2; exit 2' ERR
# shellcheck source=scripts/setup.sh
. "$(dirname "$0")/setup.sh"  # moves to the repository root
trap - ERR

cd "$caller"
kvtier demo "$@"
