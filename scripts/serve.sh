#!/usr/bin/env bash
# Start the OpenAI-compatible server (arguments go to dflash-serve; none = the default preset).
# Sets up .venv first if needed; works from any directory.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
dflash_ensure_venv "."
dflash_preload_openblas
exec "$VENV/bin/dflash-serve" "$@"
