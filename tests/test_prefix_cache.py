"""Prefix cache: a hit is token-identical to a cold run, never changes the cached entry, and is
bounded, evicted and persisted as promised."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import pytest

from dflash_server.chat.prompts import render_chat
from dflash_server.chat.structured import Grammar, response_format_grammar
from dflash_server.engine.loader import load_models
from dflash_server.engine.prefix_cache import PrefixCache
from dflash_server.engine.prefix_disk import PrefixDisk
from dflash_server.generation.pair import ModelPair
from dflash_server.generation.request import BlockPolicy, GenerationRequest
from dflash_server.generation.sampling import SamplingParams
from dflash_server.generation.stream import generate
from dflash_server.testing import random_drafter
from server_fixtures import drain, make_app, run_server

BIG = 1 << 30
SYSTEM = {"role": "system", "content": "You are a helpful assistant. " * 8}
TURN1 = [SYSTEM, {"role": "user", "content": "What is the capital of France?"}]
TURN2 = [
    *TURN1,
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Italy? Let me think about this step by step."},
]


def run(model, draft, tokenizer, prompt, cache, **kw) -> tuple[list[int], Any]:
    """Greedy tokens of one request and its last response (with stats)."""
    block = BlockPolicy(kw.pop("block_size", 1))
    request = GenerationRequest(
        tuple(prompt.tokens),
        kw.pop("max_tokens", 12),
        checkpoints=prompt.checkpoints,
        block=block,
        **kw,
    )
    pair = ModelPair.of(model, tokenizer, draft)
    out = list(generate(pair, request, prefill_step_size=16, prefix=cache))
    return [t for r in out for t in r.tokens], out


@pytest.fixture(params=["hybrid", "attn", "hybrid+draft", "attn+sliding draft"])
def pair(request, tiny_hybrid, tiny_attn) -> tuple[Any, Any, Any]:
    model, tokenizer = tiny_hybrid if request.param.startswith("hybrid") else tiny_attn
    draft = None
    if request.param.endswith("draft"):
        window = 16 if "sliding" in request.param else None  # shorter than the prompts
        draft = random_drafter(model, block_size=4, sliding_window=window)
    return model, draft, tokenizer


def test_second_turn_hits_the_first_turns_checkpoint_and_matches_a_cold_run(pair) -> None:
    model, draft, tokenizer = pair
    first = render_chat(tokenizer, TURN1, enable_thinking=True)
    second = render_chat(tokenizer, TURN2, enable_thinking=True)
    block = {"block_size": 4} if draft else {}
    cache = PrefixCache(BIG)
    run(model, draft, tokenizer, first, cache, **block)
    warm, out = run(model, draft, tokenizer, second, cache, **block)
    cold, cold_out = run(model, draft, tokenizer, second, PrefixCache(BIG), **block)
    assert warm == cold
    # Shared: everything before turn 1's generation prompt, i.e. its last <|im_start|> (an
    # attention-only target restores any prefix: the whole common one).
    cached = out[-1].stats.cached_tokens
    exact = any(hasattr(layer, "linear_attn") for layer in model.layers) or draft_windowed(draft)
    assert cached == first.checkpoints[-1] if exact else cached >= first.checkpoints[-1]
    assert cold_out[-1].stats.cached_tokens == 0
    assert first.tokens[: first.checkpoints[-1]] == second.tokens[: first.checkpoints[-1]]


def draft_windowed(draft: Any) -> bool:
    return draft is not None and draft.config.sliding_window is not None


@pytest.mark.parametrize("boundary", ["system", "message", "generation prompt", "repeat"])
def test_hits_at_every_kind_of_boundary(tiny_hybrid, boundary: str) -> None:
    model, tokenizer = tiny_hybrid
    draft = random_drafter(model, block_size=4)
    base = render_chat(tokenizer, TURN2, enable_thinking=True)
    variants = {
        "system": [SYSTEM, {"role": "user", "content": "Something else entirely."}],
        "message": [*TURN2[:3], {"role": "user", "content": "Other question."}],
        "generation prompt": [*TURN2, {"role": "assistant", "content": "Rome."}, TURN1[1]],
        "repeat": TURN2,
    }
    other = render_chat(tokenizer, variants[boundary], enable_thinking=True)
    cache = PrefixCache(BIG)
    run(model, draft, tokenizer, base, cache, block_size=4)
    warm, out = run(model, draft, tokenizer, other, cache, block_size=4)
    cold, _ = run(model, draft, tokenizer, other, PrefixCache(BIG), block_size=4)
    assert warm == cold
    cached = out[-1].stats.cached_tokens
    expected = {
        "system": base.checkpoints[0],
        "message": base.checkpoints[-2],
        "generation prompt": base.checkpoints[-1],
        "repeat": len(base.tokens) - 1,
    }[boundary]
    assert cached == expected


def test_logprobs_and_grammar_on_a_hit(tiny_hybrid) -> None:
    model, tokenizer = tiny_hybrid
    draft = random_drafter(model, block_size=4)
    first = render_chat(tokenizer, TURN1, enable_thinking=False)
    second = render_chat(tokenizer, TURN2, enable_thinking=False)
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    grammar = Grammar(response_format_grammar(schema))
    kw = {"block_size": 4, "logprobs": 2, "constraint": grammar, "max_tokens": 10}
    cache = PrefixCache(BIG)
    run(model, draft, tokenizer, first, cache, **kw)
    warm, out = run(model, draft, tokenizer, second, cache, **kw)
    cold, cold_out = run(model, draft, tokenizer, second, PrefixCache(BIG), **kw)
    assert out[-1].stats.cached_tokens > 0 and warm == cold
    got = [lp for r in out for lp in r.logprobs]
    want = [lp for r in cold_out for lp in r.logprobs]
    assert got == pytest.approx(want, abs=1e-4)


def test_restoring_never_changes_the_entry(tiny_hybrid) -> None:
    """Two requests from one entry, generating far past it: the entry's arrays stay equal."""
    model, tokenizer = tiny_hybrid
    prompt = render_chat(tokenizer, TURN1, enable_thinking=True)
    cache = PrefixCache(BIG)
    run(model, None, tokenizer, prompt, cache)
    (entry,) = cache._entries.values()
    before = [mx.array(a) for a in entry.snapshot.arrays()]
    a, _ = run(model, None, tokenizer, prompt, cache, max_tokens=40)
    b, _ = run(model, None, tokenizer, prompt, cache, max_tokens=40)
    assert a == b
    after = entry.snapshot.arrays()
    assert all(mx.array_equal(x, y).item() for x, y in zip(before, after[: len(before)]))


def test_interleaved_requests_sharing_an_entry(
    tiny_hybrid_path: Path, draft4_path: Path, calibration_cache: Path
) -> None:
    """Engine with two active requests restored from the same entry, cycle by cycle."""
    models = load_models(
        str(tiny_hybrid_path), str(draft4_path), calibration_cache=calibration_cache
    )
    first = render_chat(models.pair.tokenizer, TURN1, enable_thinking=True)
    second = render_chat(models.pair.tokenizer, TURN2, enable_thinking=True)
    cache = PrefixCache(BIG)

    def request(prompt) -> GenerationRequest:
        return GenerationRequest(
            tuple(prompt.tokens),
            30,
            SamplingParams(),
            block=BlockPolicy(4),
            checkpoints=prompt.checkpoints,
        )

    def text(prompt, cache) -> str:
        out = generate(models.pair, request(prompt), prefix=cache)
        return "".join(r.text for r in out)

    warmed = PrefixCache(BIG)
    text(first, warmed)
    lone = [text(second, warmed), text(first, warmed)]  # each restored from a warm cache
    from dflash_server.engine.jobs import Job, TextChunk
    from dflash_server.engine.worker import Engine

    engine = Engine(lambda: models, max_active=2, prefix_cache=cache)
    engine.start()
    assert engine.wait_ready(30)

    async def main() -> list[list[Any]]:
        warmup = Job(request(first))
        engine.submit(warmup)
        await drain(warmup)
        jobs = [Job(request(second)), Job(request(first))]
        for job in jobs:
            engine.submit(job)
        return [await drain(job) for job in jobs]

    try:
        results = asyncio.run(main())
    finally:
        engine.stop()
    for events, want in zip(results, lone):
        assert events[-1].cached_tokens > 0
        assert "".join(e.text for e in events if isinstance(e, TextChunk)) == want
    assert cache.hits >= 2


def test_eviction_under_a_tiny_budget(tiny_hybrid) -> None:
    model, tokenizer = tiny_hybrid
    first = render_chat(tokenizer, TURN1, enable_thinking=True)
    probe = PrefixCache(BIG)
    run(model, None, tokenizer, first, probe)
    one = probe.nbytes
    cache = PrefixCache(int(one * 1.3))  # room for one entry, not two
    system = {"role": "system", "content": "Answer briefly and be kind. " * 8}
    other = render_chat(tokenizer, [system, TURN1[1]], enable_thinking=True)  # shares no checkpoint
    run(model, None, tokenizer, first, cache)
    run(model, None, tokenizer, other, cache)
    assert cache.stats()["entries"] == 1 and cache.nbytes <= cache.budget
    _, out = run(model, None, tokenizer, first, cache)
    assert out[-1].stats.cached_tokens == 0  # the first was evicted (least recently used)
    assert PrefixCache(one // 2).stats()["entries"] == 0


def test_a_longer_entry_covers_the_older_ones_checkpoints(tiny_hybrid) -> None:
    model, tokenizer = tiny_hybrid
    cache = PrefixCache(BIG)
    run(model, None, tokenizer, render_chat(tokenizer, TURN1, enable_thinking=True), cache)
    run(model, None, tokenizer, render_chat(tokenizer, TURN2, enable_thinking=True), cache)
    older, newer = (e.snapshot for e in cache._entries.values())
    assert not set(older.checkpoints) & set(p for p in newer.checkpoints if p < len(older.tokens))


def test_a_hit_stays_restorable_after_a_longer_entry_lands(tiny_hybrid) -> None:
    """A request looks its prefix up, another stores a longer entry covering that checkpoint
    before the first restores (batched rows prefill in later steps): the first still restores
    the checkpoint it was promised, and decodes as a cold run."""
    model, tokenizer = tiny_hybrid
    cache = PrefixCache(BIG)
    first = render_chat(tokenizer, TURN1, enable_thinking=True)
    second = render_chat(tokenizer, TURN2, enable_thinking=True)
    run(model, None, tokenizer, first, cache)
    hit = cache.lookup((), second.tokens)
    assert hit is not None
    snapshot, length = hit
    run(model, None, tokenizer, second, cache)  # covers the first entry's checkpoints
    assert length in snapshot.checkpoints
    fresh = model.make_cache() if hasattr(model, "make_cache") else None
    snapshot.restore(length, fresh, None)
    cold, _ = run(model, None, tokenizer, second, None)
    warm, out = run(model, None, tokenizer, second, cache)
    assert warm == cold and out[-1].stats.cached_tokens > 0


@pytest.mark.parametrize("window", [None, 16], ids=["full drafter", "sliding drafter"])
def test_disk_tier_round_trip_and_bad_files(tiny_hybrid, tmp_path: Path, caplog, window) -> None:
    model, tokenizer = tiny_hybrid
    draft = random_drafter(model, block_size=4, sliding_window=window)
    first = render_chat(tokenizer, TURN1, enable_thinking=True)
    second = render_chat(tokenizer, TURN2, enable_thinking=True)
    cache = PrefixCache(BIG, PrefixDisk(tmp_path, BIG, "models-a"))
    run(model, draft, tokenizer, first, cache, block_size=4)
    cache.close()  # shutdown writes RAM entries to disk
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with caplog.at_level(logging.WARNING, logger="dflash_server"):
        foreign = PrefixDisk(tmp_path, BIG, "models-b")
        assert foreign.stats()["entries"] == 0
        restarted = PrefixCache(BIG, PrefixDisk(tmp_path, BIG, "models-a"))
    assert "unreadable" in caplog.text and "other models" in caplog.text
    warm, out = run(model, draft, tokenizer, second, restarted, block_size=4)
    cold, _ = run(model, draft, tokenizer, second, PrefixCache(BIG), block_size=4)
    assert warm == cold and out[-1].stats.cached_tokens == first.checkpoints[-1]
    assert restarted.disk is not None and restarted.disk.stats()["reads"] == 1
    restarted.close()
    foreign.close()


def test_disk_tier_budget(tiny_hybrid, tmp_path: Path) -> None:
    model, tokenizer = tiny_hybrid
    probe = PrefixCache(BIG)
    run(model, None, tokenizer, render_chat(tokenizer, TURN1, enable_thinking=True), probe)
    one = probe.nbytes
    cache = PrefixCache(1, PrefixDisk(tmp_path, int(one * 1.8), "m"))  # RAM holds nothing
    for text in ("one", "two", "three"):
        chat = [{"role": "user", "content": text}]
        run(model, None, tokenizer, render_chat(tokenizer, chat, enable_thinking=True), cache)
    cache.store((), probe._entries[0].snapshot)  # too big for RAM: nothing is kept
    cache.close()
    sizes = [p.stat().st_size for p in tmp_path.glob("*.safetensors")]
    assert len(sizes) >= 1 and sum(sizes) <= one * 1.8


def test_multi_turn_over_http_reports_cached_tokens(
    tiny_hybrid_path: Path, draft4_path: Path
) -> None:
    """A conversation through the API: turn k reuses turn k-1's prompt up to its generation
    prompt, although the answer the client sends back differs from what was generated."""
    app = make_app(tiny_hybrid_path, draft4_path, temperature=0.0, max_tokens=8)
    messages: list[dict[str, Any]] = [SYSTEM]
    with run_server(app) as srv:
        cached = []
        for turn in range(3):
            messages.append({"role": "user", "content": f"Question number {turn}?"})
            body = {
                "messages": messages,
                "stream": turn == 2,
                "stream_options": {"include_usage": True},
            }
            if body["stream"]:
                with httpx.stream("POST", f"{srv.base_url}/v1/chat/completions", json=body) as r:
                    lines = [ln for ln in r.iter_lines() if ln.startswith("data: {")]
                usage = json.loads(lines[-1][6:])["usage"]
                content = "streamed answer"
            else:
                r = httpx.post(f"{srv.base_url}/v1/chat/completions", json=body).json()
                usage = r["usage"]
                content = r["choices"][0]["message"]["content"] or "answer"
                assert (
                    r["dflash"]["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
                )
            cached.append(usage["prompt_tokens_details"]["cached_tokens"])
            messages.append({"role": "assistant", "content": content})
        health = httpx.get(f"{srv.base_url}/health").json()
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > cached[1]
    assert health["prefix_cache"]["hits"] == 2 and health["prefix_cache"]["entries"] >= 1


def test_no_prefix_cache_setting(tiny_hybrid_path: Path, draft_path: Path) -> None:
    app = make_app(tiny_hybrid_path, draft_path, prefix_cache=False)
    assert app.state.engine.prefix_cache is None
