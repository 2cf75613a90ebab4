#!/usr/bin/env bash
# Run all checks: ruff lint, ruff format check, mypy over src/, then pytest (extra arguments go
# to pytest).
# Sets up .venv with the test extra first if needed; works from any directory.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$DFLASH_ROOT"
dflash_ensure_venv ".[test]"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
"$VENV/bin/mypy"  # configured in pyproject.toml: src/dflash_server
dflash_preload_openblas
exec "$VENV/bin/python" -m pytest "$@"
