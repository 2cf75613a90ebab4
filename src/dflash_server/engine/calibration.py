"""The costs measured at load, kept on disk per model pair and machine.

Measuring the cycle costs (``CostModel``) and the batched pass costs (``PassCosts``) takes
seconds, tens of seconds on real models; the same pair on the same machine measures the same, so
a later start reads a small JSON file instead. A file is keyed by the pair's fingerprint, the
machine (platform, CPU/GPU, MLX and its device, the BLAS in use, the measuring code) and the
measuring parameters; a missing, unreadable or foreign file is measured again, never trusted.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import math
import os
import platform
import tempfile
from collections.abc import Callable
from dataclasses import asdict, fields
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import mlx.core as mx

from dflash_server.engine.blas import openblas_loaded
from dflash_server.engine.phases import phase
from dflash_server.generation.pauses import pause

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

log = logging.getLogger("dflash_server")
T = TypeVar("T", bound="DataclassInstance")

FORMAT = 1  # bump when the files' layout changes
# The modules whose code decides what a measurement yields: editing one re-measures.
MEASURING_CODE = (
    "dflash_server.generation.calibrate",
    "dflash_server.generation.calibrate_passes",
    "dflash_server.adaptive.costs",
    "dflash_server.adaptive.pass_costs",
)
# Environment that changes how fast the same code runs.
SPEED_ENV = ("MLX_DISABLE_COMPILE", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def default_folder() -> Path:
    """``$XDG_CACHE_HOME/dflash-server/calibration``, else ``~/.cache/dflash-server/...``."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "dflash-server" / "calibration"


@functools.lru_cache(maxsize=1)
def machine() -> dict[str, Any]:
    """What makes the same pair run at another speed: hardware, MLX and its device, the BLAS,
    the speed-related environment, the Python and the measuring code."""
    info: dict[str, Any] = {}
    device_info = getattr(mx, "device_info", None) or getattr(mx.metal, "device_info", None)
    if device_info is not None:  # absent on older MLX
        with contextlib.suppress(Exception):  # no GPU to describe
            info = {k: v for k, v in device_info().items() if isinstance(v, (str, int, float))}
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": _cpu_name(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "mlx": getattr(mx, "__version__", None),
        "mlx_lm": _version("mlx-lm"),
        "device": str(mx.default_device()),
        "device_info": info,
        "openblas": openblas_loaded(),
        "env": {name: os.environ.get(name) for name in SPEED_ENV},
        "code": _code_digest(),
    }


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _code_digest() -> str:
    h = hashlib.sha256()
    for name in MEASURING_CODE:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin is not None:
            h.update(Path(spec.origin).read_bytes())
    return h.hexdigest()[:16]


def measured(kind: str, measure: Callable[[], T], kept: bool) -> T:
    """``measure()``, announced first (it takes seconds, minutes on a big model) and timed."""
    name = {"batch": "batched pass"}.get(kind, kind)
    later = "kept for later starts" if kept else "--calibration-cache off: at every start"
    log.info("measuring the %s costs of this pair on this machine (%s) ...", name, later)
    with phase(f"{name} costs measured"):
        return measure()


class CalibrationCache:
    """The measured costs of one model pair (``fingerprint``) on this machine, as JSON files in
    ``folder``; ``folder=None``: off (always measure, never write)."""

    def __init__(self, folder: str | Path | None, fingerprint: str) -> None:
        self.folder = None if folder is None else Path(folder).expanduser()
        self.fingerprint = fingerprint

    def fetch(self, kind: str, cls: type[T], measure: Callable[[], T], **params: Any) -> T:
        """The ``cls`` (a dataclass) cached for ``kind`` and ``params``, else ``measure()``'s
        result, then stored for the next start. A ``partial`` one (measured beside other
        models' streams, its pieces held short) is measured again at a load with none."""
        value = self.cached(kind, cls, **params)
        if value is not None and getattr(value, "partial", False) and not pause():
            log.info("%s costs were measured beside other models' streams: measuring whole", kind)
            value = None  # no other model is streaming now (they ran no pass at this pause)
        if value is None:
            value = measured(kind, measure, self.folder is not None)
            self.keep(kind, value, **params)
        return value

    def cached(self, kind: str, cls: type[T], **params: Any) -> T | None:
        """The ``cls`` cached for ``kind`` and ``params``, or None (off, absent, unreadable)."""
        if self.folder is None:
            return None
        key, path = self._key(kind, params)
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
            if data.get("key") != key:  # another pair's or machine's file under this name
                raise ValueError("its key does not match")
            value = _decode(cls, data["value"])
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            log.warning("ignoring calibration file %s (%s): measuring again", path, exc)
            return None
        log.info(
            "%s costs from the calibration cache %s (to measure again: delete it, or "
            "--calibration-cache off)",
            kind,
            path,
        )
        return value

    def keep(self, kind: str, value: DataclassInstance, **params: Any) -> None:
        """Store a measured ``value`` for the next start (nothing when off)."""
        if self.folder is not None:
            key, path = self._key(kind, params)
            # Links (None here) and a cache it keeps for itself (not an init field) are not data.
            given = {f.name for f in fields(value) if f.init}
            data = {k: v for k, v in asdict(value).items() if v is not None and k in given}
            self._write(path, {"key": key, "value": data})

    def _key(self, kind: str, params: dict[str, Any]) -> tuple[dict[str, Any], Path]:
        assert self.folder is not None
        key = {
            "format": FORMAT,
            "kind": kind,
            "fingerprint": self.fingerprint,
            "params": params,
            "machine": machine(),
        }
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        return key, self.folder / f"{kind}-{digest[:24]}.json"

    def _write(self, path: Path, data: dict[str, Any]) -> None:
        """Write ``path`` whole or not at all (a temporary file renamed over it): a reader, or a
        second server starting, never sees half a file."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
        except OSError as exc:
            log.warning("cannot write calibration file %s: %s", path, exc)
            return
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("cannot write calibration file %s: %s", path, exc)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        else:
            log.info("calibration saved to %s", path)


def _decode(cls: type[T], data: Any) -> T:
    """A dataclass of numbers, flags and width -> seconds maps from its ``asdict`` form as read
    back from JSON (whose keys are strings); ValueError when it is not one."""
    names = {f.name for f in fields(cls)}
    if not isinstance(data, dict) or not set(data) <= names:
        raise ValueError(f"not a {cls.__name__}")
    return cls(**{name: _value(v) for name, v in data.items()})


def _value(v: Any) -> Any:
    if isinstance(v, bool):
        return v
    if isinstance(v, dict):
        return {int(k): _number(x) for k, x in v.items()}
    return _number(v)


def _number(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{v!r} is not a number")
    return float(v)
