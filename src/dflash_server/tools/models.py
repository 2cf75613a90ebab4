"""``dflash-serve models``: the hub models in the local cache, their sizes on disk and whether
this server loads them (as a chat target, a drafter or an embeddings model), read from each
one's ``config.json`` alone; nothing is downloaded or loaded (docs/tools.md, "models")."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflash_server.cli_parser import Parser


def build_parser() -> Parser:
    p = Parser(
        prog="dflash-serve models",
        description="List the hub models in the local cache (HF_HUB_CACHE), their size and "
        "whether dflash-serve loads them; a name for --target, --draft or a models file.",
    )
    p.add_argument("--cache-dir", help="the hub cache to read (default: huggingface_hub's)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def verdict(config: dict[str, Any]) -> tuple[str, str]:
    """(kind, whether and how it loads) for a checkpoint's ``config.json``."""
    from dflash_server.drafters import registry
    from dflash_server.models.embedding import is_embedding_config

    try:
        family = next((f for f in registry.FAMILIES if f.claims(config)), None)
    except Exception:  # a family's check that trips on an odd config claims nothing
        family = None
    if family is not None and family.name != registry.MTP:
        return "drafter", f"yes ({family.name}): --draft"
    model_type = (config.get("text_config") or {}).get("model_type") or config.get("model_type")
    if not isinstance(model_type, str):
        return "?", "no: its config.json names no model_type"
    module = {"qwen3_5_moe": "qwen3_5_moe"}.get(model_type, model_type)
    if importlib.util.find_spec(f"mlx_lm.models.{module}") is None:
        return "?", f"no: mlx-lm has no model type {model_type!r}"
    if is_embedding_config(config):
        return "embeddings", 'yes: kind = "embeddings" in a models file'
    return "chat", "yes: --target"


def rows(cache_dir: str | None = None) -> list[dict[str, Any]]:
    """One row per cached model repo (datasets and spaces are left out)."""
    from huggingface_hub import scan_cache_dir

    out = []
    for repo in sorted(scan_cache_dir(cache_dir).repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        revision = max(repo.revisions, key=lambda r: r.last_modified, default=None)
        config: dict[str, Any] = {}
        if revision is not None and (Path(revision.snapshot_path) / "config.json").is_file():
            try:
                config = json.loads((Path(revision.snapshot_path) / "config.json").read_text())
            except (OSError, ValueError):
                config = {}
        kind, loads = verdict(config) if config else ("?", "no: no config.json in the cache")
        out.append(
            {"id": repo.repo_id, "size_bytes": repo.size_on_disk, "kind": kind, "loads": loads}
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        found = rows(args.cache_dir)
    except Exception as exc:  # huggingface_hub's CacheNotFound and the like: one line
        print(f"dflash-serve models: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(found, indent=2))
        return 0
    if not found:
        print("no models in the local hub cache")
        return 0
    width = max(len(r["id"]) for r in found)
    print(f"{'model':<{width}}  {'size':>9}  {'kind':<10}  loads")
    for r in found:
        size = f"{r['size_bytes'] / 1e9:.2f} GB"
        print(f"{r['id']:<{width}}  {size:>9}  {r['kind']:<10}  {r['loads']}")
    return 0
