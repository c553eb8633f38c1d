#!/usr/bin/env bash
# Sets up a fresh machine (scripts/setup.sh) and runs kvtier's main job.
# Extra arguments go to the command, relative paths (--model, --json) from where it was called.
set -euo pipefail
caller=$PWD
# shellcheck source=scripts/setup.sh
. "$(dirname "$0")/setup.sh"  # moves to the repository root

cd "$caller"
kvtier demo "$@"
