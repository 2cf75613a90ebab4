"""Is MLX's CPU backend fast here? On Linux the ``mlx[cpu]`` wheel links a reference BLAS, and
float32 matmuls need OpenBLAS loaded into the process (docs/development.md, "OpenBLAS on Linux")."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx

MAPS = Path("/proc/self/maps")  # the files mapped into this process
SLOW_BLAS = (
    "MLX runs float32 matmuls on the mlx[cpu] wheel's reference BLAS here (decoding about 15x "
    "slower than with OpenBLAS): install OpenBLAS (apt-get install libopenblas0-pthread) and start "
    "with LD_PRELOAD=$(ldconfig -p | awk '/libopenblas.so.0 /{print $NF; exit}')"
)


def openblas_loaded(maps: Path = MAPS) -> bool:
    """OpenBLAS itself is loaded into this process (Linux only; numpy's own prefixed copy,
    libscipy_openblas64_, serves only numpy)."""
    if sys.platform != "linux":
        return False
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return False
    return any(line.rsplit("/", 1)[-1].startswith("libopenblas") for line in lines if "/" in line)


def blas_hint(maps: Path = MAPS) -> str | None:
    """One line saying what to install and set when MLX runs on a Linux CPU without OpenBLAS;
    None when it has it (or on macOS, or on a GPU)."""
    on_cpu = mx.default_device().type == mx.cpu
    if sys.platform != "linux" or not on_cpu or openblas_loaded(maps):
        return None
    return SLOW_BLAS
