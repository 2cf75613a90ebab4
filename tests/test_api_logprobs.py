"""Logprobs over HTTP (openai SDK): OpenAI shapes, streaming, values equal to plain decoding."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx_lm
import openai
import pytest

from dflash_server import stream_generate
from dflash_server.chat.logprobs import TokenTexts
from dflash_server.chat.structured import GrammarConstraint, response_format_grammar
from dflash_server.generation.text import encode
from server_fixtures import RunningServer, make_app, run_server

PROMPT = "def fibonacci(n):"
MESSAGES = [{"role": "user", "content": "Count to five."}]
TOL = 1e-4


@pytest.fixture(scope="module")
def server(tiny_hybrid_path: Path, draft_path: Path) -> Iterator[Any]:
    # A fixed block: "auto" picks widths from timings, and other verify widths change logprobs
    # in the 7th digit, while these tests compare streamed and whole answers exactly.
    app = make_app(
        tiny_hybrid_path, draft_path, served_model_name="tiny", temperature=0.0, block_size=8
    )
    with run_server(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def local(tiny_hybrid_path: Path) -> tuple[Any, Any]:
    return mlx_lm.load(str(tiny_hybrid_path))


def _plain(local: tuple[Any, Any], prompt: str, n: int, top: int, **kw: Any) -> list[Any]:
    """(token string, logprob, [(alt string, logprob)]) per token, from plain decoding."""
    model, tokenizer = local
    texts = TokenTexts(tokenizer)
    out = []
    ids = encode(tokenizer, prompt)
    for r in stream_generate(model, None, tokenizer, ids, max_tokens=n, logprobs=top, **kw):
        for token, lp, alts in zip(r.tokens, r.logprobs, r.top_logprobs or [[]] * len(r.tokens)):
            out.append((texts(token)[0], lp, [(texts(t)[0], v) for t, v in alts]))
    return out


def _close(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want)
    for (t1, v1, a1), (t2, v2, a2) in zip(got, want):
        assert t1 == t2 and abs(v1 - v2) < TOL
        assert [t for t, _ in a1] == [t for t, _ in a2]
        assert all(abs(x - y) < TOL for (_, x), (_, y) in zip(a1, a2))


def _chat_entries(content: list[Any]) -> list[Any]:
    return [(e.token, e.logprob, [(a.token, a.logprob) for a in e.top_logprobs]) for e in content]


def test_completions_logprobs_equal_plain_decoding(client: openai.OpenAI, local: Any) -> None:
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, logprobs=3)
    assert r.model_extra["dflash"]["speculative"] is True
    lp = r.choices[0].logprobs
    got = [
        (t, v, sorted(alts.items(), key=lambda kv: -kv[1]))
        for t, v, alts in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)
    ]
    _close(got, _plain(local, PROMPT, 16, 3))
    assert len(lp.tokens) == r.usage.completion_tokens
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # Streamed: the same entries, spread over the chunks that carry their text.
    chunks = list(
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=16, logprobs=3, stream=True
        )
    )
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [v for s in streamed for v in s.token_logprobs] == lp.token_logprobs
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset


def test_chat_logprobs_stream_and_not(client: openai.OpenAI, local: Any) -> None:
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=12, logprobs=True, top_logprobs=20
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(e.top_logprobs) == 20 for e in content)
    named = [e for e in content if not e.token.startswith("bytes:")]
    assert all(bytes(e.bytes).decode() == e.token for e in named)
    _, tokenizer = local
    prompt = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, enable_thinking=True, tokenize=False
    )
    _close(_chat_entries(content), _plain(local, prompt, 12, 20))
    chunks = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=12, logprobs=True, top_logprobs=2, stream=True
    )
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    assert all(len(e.top_logprobs) == 2 for e in streamed)
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12)
    assert plain.choices[0].logprobs is None  # only when asked


def test_logprobs_under_a_schema(client: openai.OpenAI, local: Any) -> None:
    """With response_format, logprobs are those of the masked (grammar) distribution."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    r = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=40,
        logprobs=True,
        top_logprobs=3,
        response_format=fmt,
        extra_body={"enable_thinking": False},
    )
    assert isinstance(json.loads(r.choices[0].message.content)["ok"], bool)
    _, tokenizer = local
    prompt = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, enable_thinking=False, tokenize=False
    )
    constraint = GrammarConstraint(tokenizer, response_format_grammar(fmt))
    want = _plain(local, prompt, 40, 3, constraint=constraint)
    # Tokens the grammar forbids (probability 0) are not listed as alternatives.
    want = [(t, v, [(a, x) for a, x in alts if x > -float("inf")]) for t, v, alts in want]
    _close(_chat_entries(r.choices[0].logprobs.content), want)
    assert any(len(e.top_logprobs) < 3 for e in r.choices[0].logprobs.content)
