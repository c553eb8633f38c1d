#!/usr/bin/env bash
# Sets up a fresh machine (scripts/setup.sh) and runs kvtier's main job.
# Extra arguments go to the command.
set -euo pipefail
# shellcheck source=scripts/setup.sh
. "$(dirname "$0")/setup.sh"

kvtier demo "$@"
