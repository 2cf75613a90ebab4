"""Every drafter family the server loads, and ``load_drafter``: a checkpoint folder (or hub id)
in, a bound ``Drafter`` out.

A family is one module of this package that defines its model and a ``Family`` (how to tell its
``config.json`` and how to load its folder unmodified); ``FAMILIES`` lists the built-in ones, and
``register`` adds another at run time (docs/development.md, "A drafter family"). The first family
that claims a config loads it; a config no family claims is refused, naming the ones there are.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.nn as nn

from dflash_server.drafters import dflash, dflash2, dspark, eagle3, mtp
from dflash_server.drafters.dflash import DFlashDraftModel
from dflash_server.drafters.protocol import Drafter, Family
from dflash_server.drafters.window import DEFAULT_WINDOW
from dflash_server.models.loading import resolve_model_path

__all__ = ["DEFAULT_WINDOW", "FAMILIES", "family_of", "load_draft", "load_drafter", "register"]

# DSpark first: its checkpoints may also be named like DFlash ones (a Markov head says which).
FAMILIES: list[Family] = [
    dspark.FAMILY,
    dflash.FAMILY,
    dflash2.FAMILY,
    dflash.ASSISTANT,
    eagle3.FAMILY,
    mtp.FAMILY,
]
MTP = "MTP"  # the family that reads a target checkpoint's own head (``--draft mtp``)


def register(family: Family) -> None:
    """Add a family (ahead of the built-in ones, so it may also claim a layout they know)."""
    FAMILIES.insert(0, family)


def family_of(raw: dict, name: str | None = None) -> Family:
    """The family named ``name``, else the first that claims this ``config.json`` (one that
    claims none and names no architecture is a DFlash (v1) export, as older ones were
    written); a ValueError naming the architecture and the loadable ones otherwise."""
    for family in FAMILIES:
        if family.name == name if name is not None else family.claims(raw):
            return family
    if name is None and not raw.get("architectures"):
        return dflash.FAMILY
    arch = (raw.get("architectures") or [raw.get("model_type")])[0]
    known = ", ".join(family.describes or family.name for family in FAMILIES)
    raise ValueError(
        f"unsupported drafter architecture {arch!r} (config.json 'architectures'); "
        f"this server loads: {known}"
    )


def load_drafter(
    path_or_repo: str | Path,
    target: nn.Module | None = None,
    *,
    window: int | None = None,
    fallback_window: int | None = None,
    family: str | None = None,
) -> Drafter:
    """Load a drafter folder (or hub id) unmodified, MLX-quantized exports included; bound to
    ``target`` when given (the MTP head needs it). ``family``: the family to load it as, else
    the one its ``config.json`` declares. ``window`` bounds its full-attention layers' context
    (docs/design.md, "Drafter window"; 0: the whole context); None keeps the one its config
    names (``sliding_window_size``), else takes ``fallback_window``, else the whole context."""
    path = resolve_model_path(path_or_repo, ["*.safetensors", "*.json"])
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"no config.json in {path}: is this a drafter folder?")
    raw = json.loads(config_file.read_text())
    drafter = family_of(raw, family).load(path, raw, target)
    drafter.set_window(drafter.window or fallback_window if window is None else window)
    return drafter


def load_draft(
    path_or_repo: str | Path,
    target: nn.Module | None = None,
    sliding_window_size: int | None = None,
) -> DFlashDraftModel:
    """The Python API's loader, as the reference names it: a DFlash-family drafter (DFlash,
    DFlash2, "assistant" exports), with the reference's ``sliding_window_size`` as its window
    (default: the config's, else the whole context). ``load_drafter`` loads every family."""
    drafter = load_drafter(path_or_repo, target, window=sliding_window_size)
    if not isinstance(drafter, DFlashDraftModel):
        raise ValueError(
            f"{path_or_repo} holds a {drafter.family} drafter, not a DFlash one: use load_drafter"
        )
    return drafter
