"""A small, bounded run of tests/load/loadgen.py: concurrency invariants and memory steadiness.

The full run (N = 1, 8, 32 clients; 200 sequential requests) is ``tests/load/loadgen.py``.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from server_fixtures import RunningServer, make_app, run_server

sys.path.insert(0, str(Path(__file__).parent / "load"))
from loadgen import memory_run, memory_summary, run_load


@pytest.fixture(scope="module")
def server(tiny_hybrid_path: Path, draft_path: Path) -> Iterator[Any]:
    # No prefix cache: it holds memory on purpose, and this checks per-request buffers.
    app = make_app(
        tiny_hybrid_path,
        draft_path,
        max_active=3,
        max_queue=16,
        context_length=512,
        stream_interval=0,
        prefix_cache=False,
    )
    with run_server(app) as srv:
        yield srv


def test_concurrent_clients_keep_outputs_and_terminate(server: RunningServer) -> None:
    report = asyncio.run(run_load(server.base_url, 6, 2, 16, {}))
    row = report.row()
    assert row["requests"] == 12 and row["failed"] == 0, row
    assert row["greedy_checked"] >= 4 and row["greedy_mismatch"] == 0, report.mismatches
    assert row["unterminated"] == 0 and row["healthy"], row
    assert row["cancelled"] >= 1 and server.engine.queue_depth == 0


def test_memory_is_steady_and_buffers_are_released(server: RunningServer) -> None:
    import mlx.core as mx

    samples = memory_run_sync(server.base_url, 24)
    mem = memory_summary(samples)
    # MLX memory of finished and cancelled requests is released: back to the same level.
    assert mem["active_mb_max_drift"] < 0.5, mem
    assert mem["cache_mb_max_drift"] < 8, mem
    assert mem["rss_mb_max_drift"] < 40, mem
    assert mx.get_active_memory() / 2**20 <= mem["active_mb_after_5"] + 0.5


def memory_run_sync(base: str, n: int) -> list[dict[str, float]]:
    return asyncio.run(memory_run(base, n, 16))
