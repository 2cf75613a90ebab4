"""The ranks of a server launched over several machines (``mlx.launch ... dflash-serve``).

Every rank runs ``dflash-serve`` with the same flags. Before loading anything the ranks compare
their model files, settings and versions, and refuse to start on a difference, naming it. Rank 0
then serves HTTP (``cli.serve``) and decides every round; each other rank loads its shard of the
target and the whole drafter and follows rank 0's rounds (``engine/lockstep.py``) until rank 0
shuts down (docs/design.md, "Several machines").
"""

from __future__ import annotations

import logging
import os
import signal
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from dflash_server.engine.distributed import Channel, RankLost, check_same, file_digests
from dflash_server.engine.loader import ModelLoadError, make_batch
from dflash_server.engine.lockstep import Follower
from dflash_server.serve.engine import build_loader, prefix_cache_of
from dflash_server.settings import Settings

log = logging.getLogger("dflash_server")

# Settings that say where things are on each machine (compared by content or as on/off
# instead) or only how rank 0 logs: they may differ between ranks.
PER_MACHINE = frozenset(
    {"target", "draft", "config", "calibration_cache", "prefix_cache_dir", "log_level"}
)


def shared_items(settings: Settings, target: str, draft: str | None) -> dict[str, str]:
    """What every rank must have alike: versions, the model files' contents (``draft``: a
    folder, "mtp" or None), the settings."""
    items = {f"{name} version": _version(name) for name in ("dflash-server", "mlx", "mlx-lm")}
    items |= file_digests("target", Path(target))
    items["the drafter"] = "none" if draft is None else "mtp" if draft == "mtp" else "a folder"
    if draft is not None and draft != "mtp":
        items |= file_digests("drafter", Path(draft))
    for name, value in settings.model_dump().items():
        if name not in PER_MACHINE and name != "prefix_cache_bytes":
            items[f"--{name.replace('_', '-')}"] = repr(value)
    # Resolved: by default 1/8 of each machine's memory, so machines of different sizes differ.
    items["the prefix cache's RAM (--prefix-cache-bytes)"] = str(settings.prefix_cache_budget)
    items["the prefix cache's disk tier (--prefix-cache-dir)"] = (
        "on" if settings.prefix_cache_dir else "off"
    )
    return items


def refusal(settings: Settings, group: Any, target: str, draft: str | None) -> str | None:
    """Why these ranks cannot run together (a collective: every rank calls it), or None."""
    if settings.batching != "batched":
        return (
            "--batching interleave queues each request's next cycle before the round that runs "
            "it, so rank 0's decisions would reach the other ranks a round late: use "
            "--batching batched (the default) over several machines"
        )
    from dflash_server.engine.distributed import Mismatch

    try:
        check_same(group, shared_items(settings, target, draft))
    except Mismatch as exc:
        return str(exc)
    return None


def follow(settings: Settings, target_path: str, draft_path: str | None, group: Any) -> int:
    """A rank other than 0: load this rank's shard, follow rank 0's rounds until it shuts
    down; the exit status (1 when another rank was lost)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every rank; rank 0 decides
    size = group.size()
    prefix_cache = prefix_cache_of(settings)
    loader = build_loader(
        settings, prefix_cache, target_path=target_path, draft_path=draft_path, group=group
    )
    try:
        models = loader()
    except ModelLoadError as exc:
        log.error("%s", exc)
        return 1
    follower = Follower(
        models.pair,
        make_batch(models, settings.max_verify, settings.kv_quant),
        Channel(group),
        timeout_s=settings.rank_timeout,
        on_hang=_exit_now,
        prefill_step_size=settings.prefill_step_size,
        prefix_cache=prefix_cache,
    )
    log.info("following rank 0 (pid %d, %d ranks)", os.getpid(), size)
    try:
        with models.pair.wired.held():
            follower.run()
    except RankLost as exc:
        log.error("%s", exc)
        return 1
    except Exception:  # a round that failed here cannot be skipped: the ranks would diverge
        log.exception("following rank 0 failed: restart every rank")
        return 1
    finally:
        if prefix_cache is not None:
            prefix_cache.close()
    log.info("rank 0 shut down: exiting")
    return 0


def _exit_now(message: str) -> None:
    """A hung round: the main thread is stuck inside MLX, so the process ends from here."""
    log.error("%s", message)
    logging.shutdown()
    os._exit(1)


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:  # pragma: no cover - run from a source tree, not installed
        return "unknown"
