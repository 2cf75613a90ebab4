"""The engine built from settings: what its worker loads, the prefix cache, the lockstep over
several ranks (``ranks.py`` runs the other ranks), and the app around it (``server.py``)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_server.api.metrics import Metrics
from dflash_server.engine.distributed import Channel
from dflash_server.engine.loader import LoadedModels, load_models
from dflash_server.engine.lockstep import Leader
from dflash_server.engine.prefix_cache import PrefixCache
from dflash_server.engine.prefix_disk import PrefixDisk
from dflash_server.engine.summary import ModelSummary, describe
from dflash_server.engine.worker import Engine, LoaderFn, StreamsFn
from dflash_server.models.loading import KeptTokenizer
from dflash_server.settings import Settings

log = logging.getLogger("dflash_server")


def build_loader(
    settings: Settings,
    prefix_cache: PrefixCache | None,
    *,
    target_path: str | None = None,
    draft_path: str | None = None,
    group: Any = None,
    kept: KeptTokenizer | None = None,
) -> LoaderFn:
    """What the engine's worker runs first: load the configured models (tensor-sharded over
    ``group``'s ranks when given), log what it got, add the prefix cache's disk tier;
    ``kept``: where the tokenizer is kept between loads (``load_models``)."""

    def loader() -> LoadedModels:
        models = load_models(
            target_path or str(settings.target),
            draft_path or settings.drafter,
            settings.context_length,
            target_label=settings.target,
            draft_label=settings.drafter,
            draft_window=settings.draft_window,
            suffix_tokens=settings.suffix_tokens,
            suffix_cache_bytes=settings.suffix_cache_bytes,
            calibration_cache=settings.calibration_folder,
            vision=settings.vision,
            group=group,
            kept=kept,
        )
        for line in describe(models.summary).splitlines():
            log.info("%s", line)
        if models.summary.vision:
            remote = "http(s) URLs too" if settings.allow_remote_images else "data URLs only"
            log.info(
                "images: at most %d per request, resized to at most %d pixels, %s",
                settings.max_images,
                settings.max_image_pixels,
                remote,
            )
        for line in capped_settings(settings, models.summary):
            log.warning("%s", line)
        if settings.kv_quant is not None:
            log.info("%s", settings.kv_quant.describe())
        if prefix_cache is None:
            log.info("prefix cache: off")
        else:
            if settings.prefix_cache_dir:
                folder = Path(settings.prefix_cache_dir).expanduser()
                if group is not None:  # each rank keeps its own shard's entries
                    folder = folder / f"rank{group.rank()}-of-{group.size()}"
                budget = settings.prefix_cache_disk_bytes
                # Snapshots queued for writing add at most a quarter to the RAM tier's memory.
                queued = prefix_cache.budget // 4
                disk = PrefixDisk(folder, budget, models.summary.fingerprint, max_pending=queued)
                prefix_cache.add_disk(disk)
            log.info("prefix cache: %s", prefix_cache.describe())
        return models

    return loader


def capped_settings(settings: Settings, summary: ModelSummary) -> list[str]:
    """A line for each setting the loaded models cannot honour as given, and what runs
    instead: it changes the numbers, so it is never silent."""
    lines = []
    asked, trained = settings.block_size, summary.block_size
    if isinstance(asked, int) and trained is not None and not 2 <= asked <= trained:
        runs = max(2, min(asked, trained))
        lines.append(
            f"--block-size {asked} is outside the drafter's 2..{trained} (its trained block): "
            f"runs as {runs}"
        )
    if settings.context_length and settings.context_length > summary.context_length:
        lines.append(
            f"--context-length {settings.context_length} is above the model's limit: capped to "
            f"{summary.context_length}"
        )
    return lines


def prefix_cache_of(settings: Settings) -> PrefixCache | None:
    return PrefixCache(settings.prefix_cache_budget) if settings.prefix_cache else None


def build_engine(
    settings: Settings,
    *,
    target_path: str | None = None,
    draft_path: str | None = None,
    on_fatal: Callable[[str], None] | None = None,
    streams: StreamsFn | None = None,
    metrics: Metrics | None = None,
    group: Any = None,
    managed: threading.Condition | None = None,
    kv_default_cap: int | None = None,
    kept: KeptTokenizer | None = None,
) -> Engine:
    """An engine that loads the configured models on its worker thread and logs what it got.

    ``target_path``/``draft_path`` are already-downloaded folders (the CLI fetches first);
    ``streams``: a double for the running requests (tests); ``metrics`` hears of every batched
    pass.
    ``group``: the MLX distributed group this is rank 0 of; the other ranks follow its rounds
    (``serve/ranks.py``). ``managed``: one of several models, driven by the models' worker
    (``engine/models.py``) whose condition this is; ``kv_default_cap``: its default KV budget's
    cap; ``kept``: where its tokenizer is kept from one load to the next.
    """
    prefix_cache = prefix_cache_of(settings)
    loader = build_loader(
        settings, prefix_cache, target_path=target_path, draft_path=draft_path, group=group,
        kept=kept,
    )  # fmt: skip

    def ready() -> None:  # the engine calls it once /health says 200, not before
        log.info(
            "ready: serving %r at http://%s:%d/v1", settings.model_id, settings.host, settings.port
        )

    leader = None
    if group is not None:
        leader = Leader(Channel(group), settings.rank_timeout, lambda why: engine.abort(why))
    engine = Engine(
        loader,
        max_queue=settings.max_queue,
        max_active=settings.max_active,
        prefill_step_size=settings.prefill_step_size,
        batching=settings.batching,
        max_verify=settings.max_verify,
        kv=settings.kv_quant,
        streams=streams,
        on_fatal=on_fatal,
        on_ready=ready if managed is None else None,  # else the models' worker says it
        prefix_cache=prefix_cache,
        on_pass=metrics.observe_pass if metrics is not None else None,
        lockstep=leader,
        max_kv_memory=settings.kv_memory_bytes,
        managed=managed is not None,
        cond=managed,
        kv_default_cap=kv_default_cap,
    )
    return engine
