"""Hostile input: >= 1,000 generated malformed requests, each a 4xx OpenAI error, never 500/hang.

Every generated request is invalid by construction (a seeded generator, so failures replay);
the server behind it is a real uvicorn on loopback serving the tiny fixture models.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server_fixtures import RunningServer, make_app, run_server

LIMIT = 64 * 1024  # --max-request-bytes for this server
N_REQUESTS = 1100
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
OK_MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_hybrid_path: Path, draft_path: Path) -> Iterator[Any]:
    app = make_app(
        tiny_hybrid_path,
        draft_path,
        max_request_bytes=LIMIT,
        context_length=256,
        enable_thinking=False,
    )
    with run_server(app) as srv:
        yield srv


# Values of the wrong type or out of range for each field (every one is refused). Strings that
# pydantic's lax mode would coerce ("5", "yes") are left out: those requests are valid.
WRONG = {
    "messages": [None, "hi", 5, {}, [], [None], ["hi"], [{"content": "x"}], [{"role": 5}]],
    "max_tokens": ["five", 1.5, -1, 0, [], {}, 2**31, 10**40, -(10**40)],
    "temperature": ["hot", -0.1, 2.5, 1e308, -1e308, [], {}],
    "top_p": [-0.1, -1, 1.5, "one", [], 1e300],  # 0 is valid (the OpenAI spec's minimum)
    "top_k": [-2, "k", 1.5, 10**20],
    "min_p": [-0.5, 2, "x"],
    "presence_penalty": [5, -5, "x", 1e10],
    "frequency_penalty": [3, -3, "x"],
    "repetition_penalty": [0, -1, "x"],
    "stop": [5, [1, 2], [""], "", {}, [None]],
    "seed": ["s", 1.5, -2, 2**64, -(10**30)],
    "stream": ["maybe", 5, [], {}],
    "n": [0, -1, 2, 100, "one"],
    "stream_options": [5, "x", [], {"include_usage": "maybe"}],
    "logit_bias": [{"1": 5}, "x", 5],
    "block_size": [0, -3, 1000, "eight", 10**12],
    "speculative": ["perhaps", 5, []],
    "top_logprobs": [-1, 21, 10**9, "3"],
    "logprobs": ["x", -1, [], {}],
    "model": ["../../etc/passwd", "/etc/passwd", "org/other-model", "", "x" * 300, 5, []],
    "tools": [5, "x", [5], [{"type": "function"}], [{"type": "retrieval"}]],
    "tool_choice": [5, "sometimes", {"type": "function", "function": {"name": "nope"}}],
    "response_format": [5, "json", {"type": "xml"}, {"type": "json_schema"}],
    "max_completion_tokens": [0, -1, "x", 10**50],
    "chat_template_kwargs": [5, "x", []],
    "enable_thinking": ["x", 5, []],
}
FOREIGN = ["guided_json", "guided_regex", "guided_choice", "functions", "prediction", "audio"]


def _json(obj: Any) -> bytes:
    return json.dumps(obj, allow_nan=True).encode()


def _case(rng: random.Random, i: int) -> tuple[str, dict[str, str], bytes | Iterator[bytes]]:
    """(path, headers, body) of one invalid request; the kind cycles so every kind is hit."""
    js = {"content-type": "application/json"}
    base = {"messages": OK_MSG, "max_tokens": 2}
    kind = i % 14
    if kind == 0:  # not JSON at all, or JSON cut short / with garbage after it
        text = _json(base)
        cut = rng.randrange(1, len(text) - 1)
        body = rng.choice(
            [text[:cut], text + b"}", text[cut:], bytes(rng.randrange(256) for _ in range(40))]
        )
        return CHAT, js, body
    if kind == 1:  # the wrong top-level type
        return rng.choice([CHAT, TEXT]), js, _json(rng.choice([[], "x", 5, None, True, [base]]))
    if kind == 2:  # one field of the wrong type or out of range
        field = rng.choice(sorted(WRONG))
        return CHAT, js, _json(base | {field: rng.choice(WRONG[field])})
    if kind == 3:  # NaN / Infinity literals in sampling values
        field = rng.choice(["temperature", "top_p", "min_p", "presence_penalty", "max_tokens"])
        lit = rng.choice(["NaN", "Infinity", "-Infinity"])
        return CHAT, js, _json(base)[:-1] + f', "{field}": {lit}}}'.encode()
    if kind == 4:  # unknown or missing roles, bad content parts
        msg = rng.choice(
            [
                {
                    "role": rng.choice(["root", "admin", "", "USER", "function", None]),
                    "content": "x",
                },
                {"content": "no role"},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                {"role": "user", "content": [{"text": "no type"}]},
                {"role": "user", "content": 5},
            ]
        )
        return CHAT, js, _json(base | {"messages": [msg]})
    if kind == 5:  # empty messages / prompts, token ids outside the vocabulary
        if rng.random() < 0.5:
            return CHAT, js, _json(base | {"messages": rng.choice([[], None, {}])})
        prompt = rng.choice([[], "", [-1], [10**9], [1, -5], [1.5], [[1, 2]], ["a", "b"], None])
        return TEXT, js, _json({"prompt": prompt, "max_tokens": 2})
    if kind == 6:  # bad UTF-8 bytes, lone surrogate escapes
        raw = _json(base | {"messages": [{"role": "user", "content": "@@"}]})
        junk = rng.choice([b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80", b"\\ud800", b"\\udfff"])
        return CHAT, js, raw.replace(b"@@", junk)
    if kind == 7:  # not sent as JSON
        ctype = rng.choice(["text/plain", "multipart/form-data", "application/xml", "", "json"])
        return CHAT, {"content-type": ctype} if ctype else {}, _json(base)
    if kind == 8:  # bigger than the limit, with Content-Length or chunked
        big = _json(base | {"messages": [{"role": "user", "content": "x" * (LIMIT + 10)}]})
        if rng.random() < 0.5:
            return CHAT, js, big
        return CHAT, js, iter([big[j : j + 8192] for j in range(0, len(big), 8192)])
    if kind == 9:  # a prompt longer than the context (an enormous message under the limit)
        words = " ".join(rng.choice(["alpha", "β", "42", "def"]) for _ in range(9000))
        return CHAT, js, _json(base | {"messages": [{"role": "user", "content": words}]})
    if kind == 10:  # features this server refuses rather than ignores
        field = rng.choice(FOREIGN)
        return CHAT, js, _json(base | {field: {"x": 1}})
    if kind == 11:  # deeply nested JSON
        depth = rng.choice([2000, 10000, 50000])
        return CHAT, js, b'{"messages":' + b"[" * depth + b"]" * depth + b"}"
    if kind == 12:  # completions-only nonsense
        extra = rng.choice(
            [{"echo": True}, {"suffix": "x"}, {"best_of": 3}, {"prompt": ["a", "b"]}]
        )
        return TEXT, js, _json({"prompt": "hi", "max_tokens": 2} | extra)
    # Unknown model names (never looked up anywhere) and unknown routes/methods.
    name = rng.choice(["../x", "/etc/passwd", "hf-org/model", "~/.cache/x", "C:\\m", "a" * 500])
    return CHAT, js, _json(base | {"model": name})


def _check(response: httpx.Response, what: str) -> None:
    assert 400 <= response.status_code < 500, (what, response.status_code, response.text[:300])
    err = response.json()["error"]
    assert isinstance(err["message"], str) and err["message"], what
    assert {"type", "param", "code"} <= set(err), what


@pytest.mark.slow
def test_fuzzed_requests_are_all_4xx_errors(server: RunningServer) -> None:
    rng = random.Random(20240604)
    counts: dict[int, int] = {}
    with httpx.Client(base_url=server.base_url, timeout=20) as client:
        for i in range(N_REQUESTS):
            path, headers, body = _case(rng, i)
            what = (
                f"case {i} ({i % 14}): {str(body)[:200] if isinstance(body, bytes) else 'chunked'}"
            )
            r = client.post(path, headers=headers, content=body)
            _check(r, what)
            counts[r.status_code] = counts.get(r.status_code, 0) + 1
        # Other methods and paths are error objects as well.
        for method, path in [("GET", CHAT), ("DELETE", "/v1/models"), ("GET", "/v1/nope")]:
            _check(client.request(method, path), f"{method} {path}")
        assert set(counts) >= {400, 404, 413, 415}, counts
        # The server is unharmed: health is fine and a normal request succeeds.
        assert client.get("/health").json()["status"] == "ready"
        ok = client.post(CHAT, json={"messages": OK_MSG, "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"]
    assert server.engine.queue_depth == 0
