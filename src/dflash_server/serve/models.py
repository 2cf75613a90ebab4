"""The models of a models file as a ``ModelSet`` (docs/operations.md, "Several models"): each
entry's engine (chat) or embedding runner, built over its own settings, its files fetched on a
thread of their own, and what it is expected to take of the memory budget."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from pathlib import Path

from dflash_server.api.metrics import Metrics
from dflash_server.engine.embeddings import Embedder
from dflash_server.engine.kv_budget import gib, machine_memory
from dflash_server.engine.loader import TARGET_PATTERNS, resolve_draft, resolve_model
from dflash_server.engine.model_slots import EMBEDDINGS, ModelSpec, Resident
from dflash_server.engine.models import ModelSet
from dflash_server.models.embedding import load_embedding_model
from dflash_server.models.loading import KeptTokenizer
from dflash_server.models_file import ModelEntry
from dflash_server.serve.engine import build_engine
from dflash_server.settings import Settings

log = logging.getLogger("dflash_server")
MODEL_SHARE = 0.75  # the default budget's share of the machine's memory (as the KV budget's)
KV_SHARE = 4  # a model's default KV budget: one request at its context, at most budget / 4
PREFIX_SHARE = 16  # a model's default prefix cache RAM: budget / 16


def model_budget(settings: Settings) -> int:
    """The loaded models' memory budget in bytes (0: none)."""
    given = settings.model_memory_bytes
    return int(MODEL_SHARE * machine_memory()) if given is None else given


def build_models(
    settings: Settings,
    entries: list[ModelEntry],
    *,
    metrics: Metrics | None = None,
    on_fatal: Callable[[str], None] | None = None,
) -> ModelSet:
    """The set of ``entries``; nothing is loaded until it starts (pinned models then)."""
    budget = model_budget(settings)

    def ready() -> None:
        log.info(
            "ready: serving %s at http://%s:%d/v1",
            ", ".join(repr(e.id) for e in entries), settings.host, settings.port,
        )  # fmt: skip

    specs = [_spec(entry, budget, metrics) for entry in entries]
    log.info(
        "models: %s; memory budget %s",
        ", ".join(f"{e.id} ({e.kind}{', pinned' if e.pinned else ''})" for e in entries),
        gib(budget) if budget else "none",
    )
    return ModelSet(specs, budget=budget, on_fatal=on_fatal, on_ready=ready)


def _own_settings(entry: ModelEntry, budget: int) -> Settings:
    """An entry's settings with the several-model defaults: a prefix cache RAM share of the
    budget, its disk tier in a folder of its own."""
    s, update = entry.settings, dict[str, object]()
    if s.prefix_cache and s.prefix_cache_bytes is None and budget:
        update["prefix_cache_bytes"] = max(1, budget // PREFIX_SHARE)
    if s.prefix_cache_dir:
        update["prefix_cache_dir"] = str(Path(s.prefix_cache_dir) / re.sub(r"\W", "_", entry.id))
    return s.model_copy(update=update) if update else s


def _spec(entry: ModelEntry, budget: int, metrics: Metrics | None) -> ModelSpec:
    settings = _own_settings(entry, budget)
    paths: dict[str, str | None] = {}
    kept = KeptTokenizer()  # its tokenizer, from one load to the next
    kv_cap = budget // KV_SHARE if budget else None

    def fetch() -> int:
        """Download (no MLX) and say what it will take: weights on disk, KV, prefix cache."""
        target = resolve_model(str(settings.target), "target", TARGET_PATTERNS)
        paths["target"] = str(target)
        paths["draft"] = None
        folders = [target]
        if entry.kind != EMBEDDINGS:
            paths["draft"] = draft = resolve_draft(settings.drafter)
            if draft is not None and draft != "mtp":
                folders.append(Path(draft))
        weights = sum(f.stat().st_size for d in folders for f in d.glob("*.safetensors"))
        if entry.kind == EMBEDDINGS:
            return weights
        kv = settings.kv_memory_bytes if settings.kv_memory_bytes is not None else kv_cap or 0
        return weights + kv + settings.prefix_cache_budget

    def make(cond: threading.Condition) -> Resident:
        if entry.kind == EMBEDDINGS:
            folder = Path(str(paths["target"]))
            return Embedder(lambda: load_embedding_model(folder, lazy=True, kept=kept), cond)
        return build_engine(
            settings, target_path=paths["target"], draft_path=paths["draft"], metrics=metrics,
            managed=cond, kv_default_cap=kv_cap, kept=kept,
        )  # fmt: skip

    return ModelSpec(
        entry.id, make, kind=entry.kind, aliases=entry.aliases, pinned=entry.pinned,
        ttl=entry.ttl, fetch=fetch, config=settings,
    )  # fmt: skip
