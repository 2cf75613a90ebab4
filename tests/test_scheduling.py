"""Fair scheduling: active requests interleave one cycle each; outputs stay those of a lone run."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from typing import Any

import pytest

from dflash_server.engine.jobs import Failed, Finished, QueueFull, TextChunk
from dflash_server.engine.loader import LoadedModels, load_models
from dflash_server.engine.worker import Engine
from server_fixtures import (
    ScriptedGenerate,
    build_draft,
    drain,
    make_job,
    real_generate,
    start_engine,
)


@pytest.fixture(scope="module")
def models(tiny_hybrid_path: Path, tmp_path_factory: pytest.TempPathFactory) -> LoadedModels:
    draft = build_draft(tmp_path_factory.mktemp("draft") / "d", tiny_hybrid_path)
    return load_models(str(tiny_hybrid_path), str(draft))


def _engine(models: LoadedModels, gen: Any, **kw: Any) -> Engine:
    return start_engine(models, gen, **kw)


def observe_rows(engine: Engine, seen: Any) -> None:
    """Call ``seen(row, outcome)`` for every outcome of the engine's steps of its rows."""
    step = engine.rows.step

    def observed() -> Any:
        outcomes = step()
        for row, outcome in outcomes.items():
            assert not isinstance(outcome, Exception), outcome
            seen(row, outcome)
        return outcomes

    engine.rows.step = observed


def test_short_request_finishes_while_long_one_runs(models: LoadedModels) -> None:
    gen = ScriptedGenerate(["t"] * 1000, delay=0.005)
    engine = _engine(models, gen, max_active=2, max_queue=0)

    async def main() -> list[Any]:
        long = make_job([1], 1000)
        engine.submit(long)
        await long.next_events(timeout=10)  # generating now
        short = make_job([2], 3)
        engine.submit(short)
        with pytest.raises(QueueFull):  # two active, no waiting room
            engine.submit(make_job([3], 3))
        events = await drain(short)
        assert engine.queue_depth == 1  # the long one is still going
        long.cancel()
        return events

    try:
        events = asyncio.run(main())
    finally:
        engine.stop()
    assert "".join(e.text for e in events if isinstance(e, TextChunk)) == "ttt"
    assert isinstance(events[-1], Finished) and events[-1].completion_tokens == 3
    assert gen.closed_early == 1 and engine.queue_depth == 0


def test_waiting_requests_are_admitted_in_order(models: LoadedModels) -> None:
    gen = ScriptedGenerate(["a", "b"], delay=0.005)
    engine = _engine(models, gen, max_active=2, max_queue=8)

    async def main() -> list[list[Any]]:
        jobs = [make_job([i], 2) for i in range(6)]
        for job in jobs:
            engine.submit(job)
        return [await drain(job) for job in jobs]

    try:
        results = asyncio.run(main())
    finally:
        engine.stop()
    assert [c["prompt"] for c in gen.calls] == [[i] for i in range(6)]  # FIFO admission
    assert all(isinstance(r[-1], Finished) for r in results)


@pytest.mark.parametrize("batching", ["interleave", "batched"])
def test_interleaved_greedy_outputs_equal_lone_runs(models: LoadedModels, batching: str) -> None:
    """Four greedy requests (speculative, plain, two block sizes) plus a sampled one, interleaved
    cycle by cycle or batched, each produce exactly the tokens they produce alone."""
    runs: dict[int, list[int]] = {}

    def recording(row: Any, outcome: Any) -> None:
        key = row.prompt[0]  # each test prompt starts with a distinct token
        runs.setdefault(key, []).extend(outcome.tokens)

    specs = [
        ([5, 17, 40, 9], 60, {"block_size": 8}),
        ([6, 99, 3], 25, {"block_size": 4}),
        ([7, 12], 40, {}),  # plain decoding
        ([8, 31, 31, 31, 2], 50, {"repetition_penalty": 1.1, "block_size": 8}),
        ([9, 1, 2], 50, {"temperature": 1.0, "seed": 3, "block_size": 8}),
    ]
    engine = _engine(models, None, max_active=5, batching=batching)
    observe_rows(engine, recording)

    async def main() -> tuple[list[Any], list[list[Any]]]:
        jobs = [make_job(prompt, n, **kw) for prompt, n, kw in specs]
        for job in jobs:
            engine.submit(job)
        return jobs, [await drain(job) for job in jobs]

    try:
        jobs, results = asyncio.run(main())
    finally:
        engine.stop()
    if batching == "batched":
        assert max(engine.batch.histogram) >= 4 and engine.active_rows == 0
        sizes = [results[0][-1].stats.batch_histogram, results[2][-1].stats.batch_histogram]
        assert all(max(h) >= 4 for h in sizes), sizes  # the stats say the batches it ran in
    for job, events in zip(jobs, results):
        assert isinstance(events[-1], Finished), events[-1]
        request = job.request
        if request.sampling.temperature:
            continue  # sampled: only checked to finish
        lone = list(real_generate(models, request))
        assert runs[request.prompt[0]] == [t for r in lone for t in r.tokens], request.prompt
        text = "".join(e.text for e in events if isinstance(e, TextChunk))
        assert text == "".join(r.text for r in lone)  # per-request detokenizer state


def test_stop_gives_every_active_and_waiting_job_a_final_event(models: LoadedModels) -> None:
    gen = ScriptedGenerate(["t"] * 1000, delay=0.005)
    engine = _engine(models, gen, max_active=2, max_queue=4)

    async def main() -> list[list[Any]]:
        jobs = [make_job([i], 1000) for i in range(4)]
        for job in jobs:
            engine.submit(job)
        await jobs[1].next_events(timeout=10)
        drains = [asyncio.create_task(drain(job)) for job in jobs]
        t0 = time.monotonic()
        await asyncio.to_thread(engine.stop)
        assert time.monotonic() - t0 < 5
        return await asyncio.gather(*drains)

    results = asyncio.run(main())
    for events in results:
        assert isinstance(events[-1], Failed) and events[-1].status == 503
        assert events[-1].code == "server_shutdown"
    assert gen.finished == 0


@pytest.mark.parametrize("batching", ["interleave", "batched"])
def test_long_prefill_yields_to_running_streams(models: LoadedModels, batching: str) -> None:
    """A long prompt prefills one chunk per engine round: the running streams get tokens
    between its chunks, and every output equals its lone run (same chunking)."""
    order: list[tuple[int, str]] = []
    outputs: dict[int, list[int]] = {}

    def tagged(row: Any, outcome: Any) -> None:
        key = row.prompt[0]
        chunk = not outcome.tokens and outcome.finish is None
        order.append((key, "chunk" if chunk else "tokens"))
        outputs.setdefault(key, []).extend(outcome.tokens)

    engine = _engine(models, None, max_active=3, prefill_step_size=8, batching=batching)
    observe_rows(engine, tagged)
    jobs: list[Any] = []

    async def main() -> None:
        running = [make_job([5, 17, 40, 9], 120, block_size=4), make_job([6, 12], 120)]
        long = make_job([7] + [(11 * i) % 50 + 3 for i in range(95)], 10, block_size=8)
        jobs.extend([*running, long])
        for job in running:
            engine.submit(job)
        for job in running:
            await job.next_events(timeout=10)  # both are generating now
        engine.submit(long)
        await asyncio.gather(*(drain(job) for job in [*running, long]))

    try:
        asyncio.run(main())
    finally:
        engine.stop()
    chunks = [i for i, (key, kind) in enumerate(order) if key == 7 and kind == "chunk"]
    assert len(chunks) == 12  # 96 tokens: 11 chunks of 8, 7 and the last token: 12 yields
    for a, b in itertools.pairwise(chunks):
        between = {key for key, kind in order[a:b] if kind == "tokens"}
        assert between == {5, 6}, order[a:b]
    from dflash_server.generation.stream import generate

    for job in jobs:
        lone = generate(models.pair, job.request, prefill_step_size=8)
        assert outputs[job.request.prompt[0]] == [t for r in lone for t in r.tokens]
