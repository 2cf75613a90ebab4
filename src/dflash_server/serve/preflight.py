"""What can be refused before minutes of loading: the flags checked against the target's
``config.json`` (docs/operations.md, "Quantized KV cache")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_server.generation.kv_quant import config_head_dim
from dflash_server.settings import Settings


def refusal(settings: Settings, target: Path) -> str | None:
    """Why these settings cannot serve the target in folder ``target``, or None (what the
    config does not say is checked again on the loaded model)."""
    kv = settings.kv_quant
    if kv is None or (dim := config_head_dim(target_config(target))) is None:
        return None
    try:
        kv.check_head_size(dim)
    except ValueError as exc:
        return str(exc)
    return None


def target_config(folder: Path) -> dict[str, Any]:
    """The folder's ``config.json`` ({} when absent or unreadable: the loader names that)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}
