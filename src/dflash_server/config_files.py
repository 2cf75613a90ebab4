"""Config files and presets: where ``--config`` points, and the layer of settings it adds.

A config file is a flat TOML or JSON table of setting names; a bare name picks a preset shipped
in ``dflash_server/presets`` (package data, so a wheel install has them).
"""

from __future__ import annotations

import importlib.resources
import json
import os
from pathlib import Path
from typing import Any

from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from dflash_server.cli_parser import did_you_mean

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DEFAULT_PRESET = "qwen3.5-4b"
# Presets are package data, so a wheel install has them; the repo's configs/ links here.
PRESETS = Path(str(importlib.resources.files("dflash_server") / "presets"))


class SettingsError(ValueError):
    """A configuration problem the user can fix; the CLI prints it as one line."""


def find_config(name_or_path: str | os.PathLike[str]) -> Path:
    """Resolve ``--config``: an existing file, else a shipped preset's name (``qwen3.5-9b``)."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    for suffix in ("", ".toml", ".json"):
        candidate = PRESETS / f"{name_or_path}{suffix}"
        if candidate.is_file():
            return candidate
    raise SettingsError(
        f"config file or preset {str(name_or_path)!r} not found "
        f"(presets: {', '.join(list_presets()) or 'none'})"
    )


def list_presets() -> list[str]:
    """Names of the shipped presets."""
    if not PRESETS.is_dir():
        return []
    return sorted(p.stem for p in PRESETS.glob("*.toml"))


def read_config_file(path: Path) -> dict[str, Any]:
    """Flat TOML/JSON mapping of setting names (dashes or underscores) to values."""
    try:
        if path.suffix == ".json":
            data = json.loads(path.read_text())
        else:
            data = tomllib.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SettingsError(f"cannot read config {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise SettingsError(f"config {path} must hold a table of settings")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


class ConfigFileSource(PydanticBaseSettingsSource):
    """The config-file layer; files are merged in order, later ones winning."""

    def __init__(self, settings_cls: type[BaseSettings], paths: list[str]) -> None:
        super().__init__(settings_cls)
        self._data: dict[str, Any] = {}
        for name in paths:
            data = read_config_file(find_config(name))
            known = {*settings_cls.model_fields, "config"}
            if unknown := sorted(set(data) - known):
                names = ", ".join(f"{key!r}{did_you_mean(key, known)}" for key in unknown)
                raise SettingsError(f"unknown setting(s) in config {name}: {names}")
            self._data.update(data)

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return self._data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self._data)
