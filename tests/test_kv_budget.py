"""The KV memory budget (docs/operations.md, "KV memory budget"): the estimate against the real
caches, admission in order while reservations fit, a 503 before any stream for a request that
never could fit, and the memory reserved on /health and /metrics."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import pytest

from dflash_server.engine.jobs import Finished
from dflash_server.engine.kv_budget import KVBudgetExceeded, build_ledger, parse_size, positions
from dflash_server.engine.loader import LoadedModels, load_models
from dflash_server.generation.batch import BatchDecoder
from dflash_server.generation.kv_memory import KVGeometry, attention_bytes, kv_bytes
from dflash_server.generation.request import BlockPolicy, GenerationRequest
from dflash_server.generation.sampling import SamplingParams
from dflash_server.generation.speculative import LoneRows
from dflash_server.generation.stream import Generation, generate
from server_fixtures import ScriptedGenerate, drain, make_app, make_job, run_server, start_engine


@pytest.fixture(scope="module")
def models(tiny_hybrid_path: Path, draft_path: Path) -> LoadedModels:
    return load_models(str(tiny_hybrid_path), str(draft_path), suffix_tokens=32)


def _prompt(n: int, first: int = 10) -> tuple[int, ...]:
    return (first, *((i * 7) % 200 + 20 for i in range(n - 1)))


def _arrays(cache: Any) -> list[mx.array]:
    """Every MLX array a cache object holds (buffers at their full capacity, not sliced)."""
    out: list[mx.array] = []
    for value in vars(cache).values():
        if isinstance(value, mx.array):
            out.append(value)
        elif isinstance(value, list | tuple):
            out += [x for x in value if isinstance(x, mx.array)]
    return out


def _held(row: Any, rows: LoneRows | BatchDecoder) -> int:
    """Bytes of one running request's caches: target (its own, or the one-row batch's) and
    drafter context."""
    target = row.cache if not isinstance(rows, BatchDecoder) or rows.cache is None else None
    caches = [*(target if target is not None else rows.cache.layers), *(row.draft_cache or [])]
    return sum(a.nbytes for c in caches for a in _arrays(c))


def test_parse_size() -> None:
    assert parse_size("8GB") == 8 * 10**9
    assert parse_size("8GiB") == parse_size("8g") == 8 * 2**30
    assert parse_size("512MiB") == 512 * 2**20 and parse_size("1.5 KB") == 1500
    assert parse_size("123456") == parse_size(123456) == 123456
    assert parse_size("none") == parse_size("0") == parse_size(0) == 0
    assert parse_size(None) is None and parse_size("auto") is None
    for bad in ("8XB", "-1", -1, "lots"):
        with pytest.raises(ValueError, match="max_kv_memory must be a size"):
            parse_size(bad)


@pytest.mark.parametrize("batching", ["interleave", "batched"])
@pytest.mark.parametrize(("prompt", "new"), [(100, 30), (700, 40), (1300, 60)])
def test_estimate_bounds_the_real_caches(
    models: LoadedModels, batching: str, prompt: int, new: int
) -> None:
    """At every step of a speculative request (prefill in 512-token chunks, then verify blocks),
    its caches' arrays (at their allocated size: buffers grow 256 columns at a time) stay within
    the estimate, and the estimate is within 1.5x of the most they held."""
    ledger = build_ledger(models, 2**40, 0, padded=batching == "batched")
    assert ledger is not None
    request = GenerationRequest(_prompt(prompt), new, SamplingParams(), block=BlockPolicy(8))
    gen = Generation(models.pair, request, prefill_step_size=512)
    rows = BatchDecoder(models.pair.target, None, None) if batching == "batched" else LoneRows()
    rows.add(gen.row, gen.prompt, new, gen.eos_ids)
    estimate = kv_bytes(ledger.geometry, prompt + new)
    assert estimate == ledger.alone(positions(request))
    most, done = 0, False
    while not done:
        for outcome in rows.step().values():
            assert not isinstance(outcome, Exception), outcome
            done = done or outcome.finish is not None
        most = max(most, _held(gen.row, rows))
    rows.remove(gen.row)
    assert 0 < most <= estimate <= 1.5 * most, (most, estimate)


def test_quantized_estimate_bounds_mlx_lm_quantized_cache() -> None:
    """``kv_bits``: bits / 8 bytes per element plus a scale and a bias per group, against
    mlx-lm's ``QuantizedKVCache`` (2 KV heads of 64, float32, filled in chunks)."""
    from mlx_lm.models.cache import QuantizedKVCache

    heads, dim, tokens = 2, 64, 700
    g = KVGeometry(kv_elements=2 * heads * dim, dtype_bytes=4, recurrent_bytes=0)
    for bits, group in ((8, 64), (4, 32)):
        cache = QuantizedKVCache(group_size=group, bits=bits)
        for start in range(0, tokens, 300):
            n = min(300, tokens - start)
            cache.update_and_fetch(mx.ones((1, heads, n, dim)), mx.ones((1, heads, n, dim)))
        real = sum(a.nbytes for part in (cache.keys, cache.values) for a in part)
        estimate = attention_bytes(g, tokens, kv_bits=bits, group_size=group)
        assert real <= estimate <= 1.5 * real, (bits, real, estimate)
        assert estimate < attention_bytes(g, tokens) / 2  # well under the float32 cache


def test_ledger_counts_quantized_kv_from_its_start() -> None:
    """With ``--kv-bits``: positions before ``--quantized-kv-start`` are full precision (counted
    whole, the conversion holds both copies), the rest quantized; the estimate never falls as
    a request grows, and a long request reserves far less than at full precision."""
    from dflash_server.engine.kv_budget import KVLedger
    from dflash_server.generation.kv_quant import KVQuant

    g = KVGeometry(kv_elements=2 * 2 * 64, dtype_bytes=4, recurrent_bytes=1000)
    full = KVLedger(g, 10**12, padded=False)
    quant = KVLedger(g, 10**12, padded=False, kv=KVQuant(bits=4, group_size=64, start=512))
    sizes = [quant.alone(n) for n in range(1, 4000, 37)]
    assert sizes == sorted(sizes)
    assert quant.alone(100) == full.alone(100)  # below the start: full precision
    assert quant.alone(64_000) < full.alone(64_000) / 4


def _record_rows(engine: Any, tokens: dict[int, list[int]], seen: list[tuple[int, int]]) -> None:
    """Record each row's committed tokens (by its prompt's first token), and at every step the
    rows running and the KV memory reserved."""
    step = engine.rows.step

    def observed() -> Any:
        outcomes = step()
        seen.append((len(engine.batch.rows), engine.ledger.in_use))
        for row, outcome in outcomes.items():
            assert not isinstance(outcome, Exception), outcome
            tokens.setdefault(row.prompt[0], []).extend(outcome.tokens)
        return outcomes

    engine.rows.step = observed


def test_requests_that_fit_only_one_at_a_time_run_one_after_the_other(
    models: LoadedModels,
) -> None:
    """Two greedy requests, each fitting the budget alone but not together: both complete, one
    after the other (never two rows, never over budget), each with its lone run's tokens."""
    specs = [(_prompt(300, first=11), 24), (_prompt(260, first=12), 30)]
    requests = [GenerationRequest(p, n, SamplingParams(), block=BlockPolicy(8)) for p, n in specs]
    alone = {r.prompt[0]: [t for x in generate(models.pair, r) for t in x.tokens] for r in requests}
    ledger = build_ledger(models, 2**40, 0, padded=True)
    assert ledger is not None
    sizes = [positions(r) for r in requests]
    budget = ledger.need(sizes) - 1
    assert all(ledger.alone(n) <= budget for n in sizes)
    engine = start_engine(models, None, max_active=4, max_kv_memory=budget)
    tokens: dict[int, list[int]] = {}
    seen: list[tuple[int, int]] = []
    _record_rows(engine, tokens, seen)

    async def main() -> list[list[Any]]:
        jobs = [make_job(list(p), n, block_size=8) for p, n in specs]
        for job in jobs:
            engine.submit(job)
        return [await drain(job) for job in jobs]

    try:
        results = asyncio.run(main())
    finally:
        engine.stop()
    assert all(isinstance(events[-1], Finished) for events in results)
    assert tokens == alone
    assert max(rows for rows, _ in seen) == 1
    assert max(held for _, held in seen) <= budget
    assert engine.kv_memory == {"in_use_bytes": 0, "budget_bytes": budget}


def test_waiting_head_is_not_overtaken_and_a_cancelled_waiter_leaks_nothing(
    models: LoadedModels,
) -> None:
    """In order: a small request behind a waiting big one waits too; a waiting request that is
    cancelled never starts and holds nothing; a request that never fits is refused at once."""
    ledger = build_ledger(models, 2**40, 0, padded=True)
    assert ledger is not None
    budget = ledger.need([400, 400]) - 1  # one 400-position request at a time
    gen = ScriptedGenerate(["t"] * 40, delay=0.01)
    engine = start_engine(models, gen, max_active=4, max_kv_memory=budget)

    async def main() -> tuple[list[Any], ...]:
        running, big, small, cancelled = (
            make_job(list(_prompt(300, 1)), 100),
            make_job(list(_prompt(300, 2)), 100),
            make_job(list(_prompt(10, 3)), 10),
            make_job(list(_prompt(300, 4)), 100),
        )
        engine.submit(running)
        await running.next_events(timeout=10)  # generating now
        for job in (cancelled, big, small):
            engine.submit(job)
        assert engine.kv_memory == {"in_use_bytes": ledger.alone(400), "budget_bytes": budget}
        cancelled.cancel()
        with pytest.raises(KVBudgetExceeded, match="--max-kv-memory"):
            engine.submit(make_job(list(_prompt(2000, 5)), 100))
        return tuple([await drain(job) for job in (running, big, small)])

    try:
        results = asyncio.run(main())
    finally:
        engine.stop()
    assert all(isinstance(events[-1], Finished) for events in results)
    assert [c["prompt"][0] for c in gen.calls] == [1, 2, 3]  # the cancelled one never started
    assert engine.kv_memory == {"in_use_bytes": 0, "budget_bytes": budget}
    assert engine.ledger is not None and not engine.ledger.held


@pytest.fixture(scope="module")
def server(tiny_hybrid_path: Path, draft_path: Path) -> Any:
    gen = ScriptedGenerate(["tok "] * 60, delay=0.02)
    app = make_app(tiny_hybrid_path, draft_path, generate=gen, max_kv_memory="64MiB")
    with run_server(app) as srv:
        yield srv


def _kv_metric(text: str) -> int:
    found = re.search(r"^dflash_kv_memory_bytes (\S+)$", text, re.M)
    assert found is not None, text
    return int(float(found.group(1)))


def test_health_and_metrics_show_the_kv_memory_reserved(server: Any) -> None:
    url = server.base_url
    health = httpx.get(f"{url}/health").json()
    assert health["kv_memory"] == {"in_use_bytes": 0, "budget_bytes": 64 * 2**20}
    assert "dflash_kv_memory_budget_bytes 6.7108864e+07" in httpx.get(f"{url}/metrics").text
    body = {"prompt": "hello world", "max_tokens": 50, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # generating now
        held = httpx.get(f"{url}/health").json()["kv_memory"]["in_use_bytes"]
        assert held > 0 and _kv_metric(httpx.get(f"{url}/metrics").text) == held
        assert "[DONE]" in "".join(lines)
    deadline = time.monotonic() + 10
    while httpx.get(f"{url}/health").json()["kv_memory"]["in_use_bytes"] and (
        time.monotonic() < deadline
    ):
        time.sleep(0.02)
    assert httpx.get(f"{url}/health").json()["kv_memory"]["in_use_bytes"] == 0
    assert _kv_metric(httpx.get(f"{url}/metrics").text) == 0


ENDPOINTS = {
    "/v1/chat/completions": lambda text: {"messages": [{"role": "user", "content": text}]},
    "/v1/completions": lambda text: {"prompt": text},
    "/v1/messages": lambda text: {
        "max_tokens": 10,
        "messages": [{"role": "user", "content": text}],
    },
    "/v1/responses": lambda text: {"input": text},
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_a_request_that_never_fits_gets_503_before_any_stream(
    server: Any, path: str, stream: bool
) -> None:
    """A prompt whose caches exceed the whole budget: 503 with Retry-After, as the endpoint's
    error object, streamed or not (the status, not an event in a started stream)."""
    engine = server.engine
    budget = engine.ledger.budget
    engine.ledger.budget = engine.ledger.alone(300)  # about 300 positions; restored below
    try:
        body = ENDPOINTS[path]("hello world " * 400) | {
            "model": server.app.state.settings.model_id,
            "stream": stream,
        }
        with httpx.stream("POST", f"{server.base_url}{path}", json=body, timeout=30) as r:
            r.read()
        short = httpx.post(
            f"{server.base_url}{path}",
            json=ENDPOINTS[path]("hi") | {"model": body["model"]},
            timeout=30,
        )
    finally:
        engine.ledger.budget = budget
    assert r.status_code == 503, r.text
    assert int(r.headers["retry-after"]) >= 1
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()
    if path == "/v1/messages":
        assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"
        message = error["error"]["message"]
    else:
        assert error["error"]["code"] == "kv_memory_exceeded"
        message = error["error"]["message"]
    assert "--max-kv-memory" in message and "max_tokens" in message
    assert short.status_code == 200, short.text  # a short prompt still fits (capped output)
