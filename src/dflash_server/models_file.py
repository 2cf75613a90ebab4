"""``--models FILE``: the models one server serves (docs/operations.md, "Several models").

A TOML file of ``[[models]]`` tables. Each names an ``id`` (what a request's ``model`` picks),
a ``target`` and its ``draft`` or a ``preset`` (whose keys it may override), ``aliases``,
``kind`` ("chat", the default, or "embeddings"), ``pinned`` (loaded at start, never unloaded),
``ttl`` (seconds idle before it is unloaded) and any per-model setting (``PER_MODEL``: context
length, KV bits, KV budget, prefix cache, sampling defaults, ...), which apply to it alone
over the server's. Each entry becomes a ``ModelEntry`` with its own whole ``Settings``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from dflash_server.cli_parser import did_you_mean
from dflash_server.config_files import SettingsError, find_config, read_config_file
from dflash_server.generation.sampling_params import SERVED_FIELDS
from dflash_server.settings import Settings

# The settings a models-file entry may set for its model alone.
PER_MODEL = frozenset(
    {
        "context_length", "kv_bits", "kv_group_size", "quantized_kv_start", "max_kv_memory",
        "prefix_cache", "prefix_cache_bytes", "block_size", "draft_window", "speculative",
        "suffix_drafts", "suffix_max_tokens", "suffix_cache_bytes", "max_tokens",
        "enable_thinking", "max_thinking_tokens", "vision", "max_images", "max_image_pixels",
        "max_active", "max_verify", "prefill_step_size", "batching", *SERVED_FIELDS,
    }
)  # fmt: skip
ENTRY_KEYS = frozenset({"id", "kind", "target", "draft", "preset", "aliases", "pinned", "ttl"})
KINDS = ("chat", "embeddings")


@dataclass(frozen=True)
class ModelEntry:
    """One configured model: its id and names, kind, residency rules and whole settings."""

    id: str
    settings: Settings
    kind: str = "chat"
    aliases: tuple[str, ...] = ()
    pinned: bool = False
    ttl: float | None = None


def single_entry(settings: Settings) -> ModelEntry:
    """The one-model server (``--target``) as an entry: its target's id is an alias."""
    alias = (settings.target,) if settings.target and settings.target != settings.model_id else ()
    return ModelEntry(settings.model_id, settings, aliases=alias, pinned=True)


def read_models_file(path: str | Path, server: Settings) -> list[ModelEntry]:
    """The entries of a models file over the server's settings; raises ``SettingsError`` with
    one line naming the file, the entry and the fix."""
    file = Path(path).expanduser()
    try:
        import tomllib
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    try:
        data = tomllib.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise SettingsError(f"cannot read the models file {file}: {exc}") from exc
    tables = data.get("models")
    extra = sorted(set(data) - {"models"})
    if extra:
        raise SettingsError(f"{file}: only [[models]] tables belong here, found {extra}")
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise SettingsError(f"{file}: no [[models]] tables (see the README's example)")
    entries = [_entry(file, i, table, server) for i, table in enumerate(tables)]
    seen: dict[str, str] = {}
    for entry in entries:
        for name in (entry.id, *entry.aliases):
            if name in seen:
                raise SettingsError(
                    f"{file}: {name!r} names both {seen[name]!r} and {entry.id!r}: ids and "
                    "aliases must be unique"
                )
            seen[name] = entry.id
    return entries


def _entry(file: Path, index: int, table: dict[str, Any], server: Settings) -> ModelEntry:
    where = f"{file}, [[models]] #{index + 1}"
    table = {str(k).replace("-", "_"): v for k, v in table.items()}
    if isinstance(table.get("id"), str):
        where += f" ({table['id']!r})"
    known = ENTRY_KEYS | PER_MODEL
    if unknown := sorted(set(table) - known):
        names = ", ".join(f"{key!r}{did_you_mean(key, known)}" for key in unknown)
        raise SettingsError(f"{where}: unknown key(s) {names}")
    preset: dict[str, Any] = {}
    if "preset" in table:
        preset = read_config_file(find_config(str(table["preset"])))
    model_id = table.get("id") or preset.get("served_model_name")
    if not isinstance(model_id, str) or not model_id.strip():
        raise SettingsError(f"{where}: give it an id (what a request's 'model' names)")
    kind = table.get("kind", "chat")
    if kind not in KINDS:
        raise SettingsError(f"{where}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    target = table.get("target") or preset.get("target")
    if not isinstance(target, str):
        raise SettingsError(f"{where}: give it a 'target' (hub id or folder) or a 'preset'")
    draft = table.get("draft", preset.get("draft"))
    if kind == "embeddings" and draft not in (None, "none"):
        raise SettingsError(f"{where}: an embeddings model takes no 'draft'")
    aliases = table.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
        raise SettingsError(f"{where}: aliases must be a list of names")
    ttl = table.get("ttl", server.model_ttl)
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int | float) or ttl <= 0):
        raise SettingsError(f"{where}: ttl must be a number of seconds above 0, got {ttl!r}")
    pinned = table.get("pinned", False)
    if not isinstance(pinned, bool):
        raise SettingsError(f"{where}: pinned must be true or false, got {pinned!r}")
    own = {k: v for k, v in preset.items() if k in PER_MODEL}
    own |= {k: v for k, v in table.items() if k in PER_MODEL}
    values = server.model_dump() | own
    values |= {"target": target, "draft": draft, "served_model_name": model_id, "models": None}
    try:
        settings = Settings.model_validate(values)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err.get("loc", ()))
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        raise SettingsError(f"{where}: {field}: {msg}") from None
    return ModelEntry(model_id, settings, kind, tuple(aliases), pinned, ttl)
