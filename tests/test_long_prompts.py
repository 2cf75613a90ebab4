"""Long prompts: a prefill that stops part-way (the client gave up and will retry) is kept."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from dflash_server.engine.jobs import Failed, Finished, TextChunk
from dflash_server.engine.loader import LoadedModels, load_models
from dflash_server.engine.prefix_cache import PrefixCache
from dflash_server.generation.cycle import PREFILL_CHUNK
from dflash_server.generation.request import BlockPolicy, GenerationRequest
from dflash_server.generation.stream import generate
from server_fixtures import drain, make_job, start_engine

CHUNK = 16


@pytest.fixture(scope="module")
def models(tiny_hybrid_path: Path, draft_path: Path) -> LoadedModels:
    return load_models(str(tiny_hybrid_path), str(draft_path))


@pytest.mark.parametrize("batching", ["interleave", "batched"])
def test_a_cancelled_prefill_is_kept_and_the_retry_resumes(
    models: LoadedModels, batching: str
) -> None:
    """Cancel a 400-token prefill after 6 of its chunks; the same request again restores at
    least those chunks and answers as a cold run does."""
    prompt = [(13 * i) % 300 + 5 for i in range(400)]
    cache = PrefixCache(1 << 30)
    engine = start_engine(
        models, None, prefix_cache=cache, prefill_step_size=CHUNK, batching=batching
    )
    chunks, enough = 0, threading.Event()
    step = engine.rows.step

    def counted() -> Any:  # count the long prompt's chunks as the engine steps its rows
        nonlocal chunks
        outcomes = step()
        chunks += sum(1 for o in outcomes.values() if o is PREFILL_CHUNK)
        if chunks >= 6:
            enough.set()
        return outcomes

    engine.rows.step = counted

    async def main() -> tuple[list[Any], list[Any]]:
        first = make_job(prompt, 12, block_size=4)
        engine.submit(first)
        await asyncio.to_thread(enough.wait, 30)
        first.cancel()
        cancelled = await drain(first)
        retry = make_job(prompt, 12, block_size=4)
        engine.submit(retry)
        return cancelled, await drain(retry)

    try:
        cancelled, events = asyncio.run(main())
    finally:
        engine.stop()
    assert not any(isinstance(e, TextChunk) for e in cancelled)
    assert isinstance(cancelled[-1], Failed) or cancelled == []
    done = events[-1]
    assert isinstance(done, Finished), done
    assert done.cached_tokens >= 6 * CHUNK
    request = GenerationRequest(tuple(prompt), 12, block=BlockPolicy(4))
    cold = list(generate(models.pair, request, prefill_step_size=CHUNK))
    text = "".join(e.text for e in events if isinstance(e, TextChunk))
    assert text == "".join(r.text for r in cold)
    assert cache.stats()["entries"] >= 1 and cache.nbytes <= cache.budget
