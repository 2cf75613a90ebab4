# Shared setup for scripts/serve.sh and scripts/test.sh (sourced, not run).
# Creates the virtual environment (default .venv, or $DFLASH_VENV) on first use and reinstalls the
# project only when pyproject.toml changed since the last install (stamp file inside the venv).

DFLASH_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DFLASH_VENV:-$DFLASH_ROOT/.venv}"
STAMP="$VENV/.dflash-installed"

dflash_stamp_line() {  # $1: pip target relative to the repo root, "." or ".[test]"
  local hash
  hash="$(python3 - "$DFLASH_ROOT/pyproject.toml" <<'PY'
import hashlib, sys
print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())
PY
)"
  echo "$hash $1"
}

dflash_mark_installed() {  # record that $1 is installed for the current pyproject.toml
  dflash_stamp_line "$1" >>"$STAMP"
}

dflash_ensure_venv() {  # $1: ".", or ".[test]" for the test extra
  local want
  if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV" >&2
    "${PYTHON:-python3}" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
  fi
  want="$(dflash_stamp_line "$1")"
  # The test extra is a superset: it also satisfies a plain install.
  if grep -qxF "$want" "$STAMP" 2>/dev/null \
    || { [ "$1" = "." ] && grep -qxF "$want[test]" "$STAMP" 2>/dev/null; }; then
    return 0
  fi
  echo "[setup] pip install -e '$1' into $VENV" >&2
  (cd "$DFLASH_ROOT" && "$VENV/bin/python" -m pip install --quiet -e "$1")
  dflash_mark_installed "$1"
}

dflash_openblas() {  # print the path of OpenBLAS if the dynamic linker knows it (Linux only)
  local ldconfig
  ldconfig="$(command -v ldconfig || echo /sbin/ldconfig)"
  [ -x "$ldconfig" ] || return 0
  "$ldconfig" -p 2>/dev/null | awk '/libopenblas\.so\.0 / && !found {print $NF; found=1}' || true
}

dflash_preload_openblas() {
  # mlx[cpu] on Linux links a reference BLAS; OpenBLAS makes fp32 matmul ~200x faster.
  local blas
  blas="$(dflash_openblas)"
  if [ -n "$blas" ] && [[ ":${LD_PRELOAD:-}:" != *":$blas:"* ]]; then
    export LD_PRELOAD="$blas${LD_PRELOAD:+:$LD_PRELOAD}"
  fi
}
