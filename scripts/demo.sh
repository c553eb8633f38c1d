#!/usr/bin/env bash
# Sets up a fresh machine (scripts/setup.sh) and runs kvtier's main job.
# Extra arguments go to the command, relative paths (--model, --json) from where it was called.
set -euo pipefail
caller=$PWD
# A failed set-up (pip, venv) exits 2 with one line, as kvtier demo does without transformers:
# its own status, 1, is the demo's "tokens differ".
trap 'echo "demo.sh: error: setting up the environment (scripts/setup.sh) failed with" \
  "status $?; the lines above say why" >&2; exit 2' ERR
# Ctrl-C during set-up exits 130, as kvtier does: pip's status for it, 1, ran the ERR trap's
# "failed". bash runs this trap first; kvtier demo reports its own interruption.
trap 'echo "demo.sh: interrupted" >&2; exit 130' INT
# shellcheck source=scripts/setup.sh
. "$(dirname "$0")/setup.sh"  # moves to the repository root
trap - ERR INT

cd "$caller"
kvtier demo "$@"
