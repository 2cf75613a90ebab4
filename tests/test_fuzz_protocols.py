"""Hostile input on /v1/messages and /v1/responses: >= 1,000 mutated bodies each.

Each body is a valid request (tools, tool history, thinking, structured output...) after one
to three seeded mutations: a value of the wrong type, huge or negative numbers, a missing
field, bad nesting, a bad tool schema or name. Some mutants stay valid (a 200 is fine); none
may be a 5xx, every error must be in the protocol's own shape, and the server must be healthy
after. Scripted generation keeps the valid ones instant: this is about the request path.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server_fixtures import RunningServer, ScriptedGenerate, make_app, run_server

N_BODIES = 1100
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
MESSAGES_BASES: list[dict[str, Any]] = [
    {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    {
        "model": "tiny",
        "max_tokens": 4,
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sun"}],
            },
            {"role": "system", "content": "Answer in French."},
        ],
        "tools": [{"name": "w", "description": "weather", "input_schema": SCHEMA}],
        "tool_choice": {"type": "tool", "name": "w"},
        "thinking": {"type": "adaptive", "display": "omitted"},
        "stop_sequences": ["END"],
        "metadata": {"user_id": "u"},
        "temperature": 0.5,
    },
    {
        "model": "tiny",
        "max_tokens": 4,
        "stream": True,
        "messages": [{"role": "user", "content": "json please"}],
        "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
        "thinking": {"type": "enabled", "budget_tokens": 2},
    },
]
RESPONSES_BASES: list[dict[str, Any]] = [
    {"model": "tiny", "input": "hi", "max_output_tokens": 4},
    {
        "model": "tiny",
        "instructions": "Be brief.",
        "max_output_tokens": 4,
        "input": [
            {"type": "message", "role": "developer", "content": "Rules."},
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "x"}],
            },
            {"type": "function_call", "name": "w", "call_id": "c1", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sun"},
        ],
        "tools": [
            {"type": "function", "name": "w", "parameters": SCHEMA, "strict": False},
            {
                "type": "namespace",
                "name": "ns",
                "description": "d",
                "tools": [{"type": "function", "name": "f", "parameters": SCHEMA}],
            },
            {"type": "web_search", "external_web_access": False},
        ],
        "tool_choice": {"type": "function", "name": "w"},
        "include": ["reasoning.encrypted_content"],
        "metadata": {"k": "v"},
        "truncation": "auto",
        "store": False,
    },
    {
        "model": "tiny",
        "input": "json please",
        "stream": True,
        "max_output_tokens": 4,
        "text": {"format": {"type": "json_schema", "name": "o", "schema": SCHEMA}},
        "reasoning": {"effort": "low"},
        "include": ["message.output_text.logprobs"],
    },
]
# Replacement values: wrong types, extremes, markup, nesting.
VALUES: list[Any] = [
    None,
    "",
    "x",
    "<tool_call>",
    "a</function><tool_call>",
    " ",
    0,
    -1,
    1.5,
    2**70,
    -(2**70),
    1e308,
    -1e308,
    True,
    False,
    [],
    [None],
    [5],
    ["x"],
    {},
    {"type": 5},
    {"type": "object", "properties": 5},
    [[[[[]]]]],
    {"a": {"b": {"c": {}}}},
    "\u0000",
    "é" * 50,
]
BAD_TOOLS: list[Any] = [
    {"type": "object", "properties": 5},
    {"type": "object", "required": "city"},
    {"type": "nonsense"},
    [],
    "object",
    True,
    {"type": "object", "properties": {"a<b": {}}},
]
BAD_NAMES = ["", "a b", "a</function><tool_call>", "x" * 200, "é", 5, None, "a\nb"]


def _paths(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*path, i))


def _set(body: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    parent = body
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return body


def _delete(body: Any, path: tuple[Any, ...]) -> Any:
    parent = body
    for key in path[:-1]:
        parent = parent[key]
    del parent[path[-1]]
    return body


def _mutate(rng: random.Random, body: Any) -> Any:
    paths = list(_paths(body))
    path = rng.choice(paths)
    kind = rng.randrange(8)
    at = body
    for key in path:
        at = at[key]
    if kind <= 2:  # a wrong value
        return _set(body, path, copy.deepcopy(rng.choice(VALUES)))
    if kind == 3 and path:  # a missing field / item
        return _delete(body, path)
    if kind == 4:  # bad nesting: the value wrapped in a list or an object
        return _set(body, path, rng.choice([[at], {"value": at}]))
    if kind == 5 and isinstance(at, dict):  # an unknown field next to the real ones
        at[rng.choice(["type", "extra", "tools", "content", "name"])] = rng.choice(VALUES)
        return body
    if kind == 6:  # a bad tool schema anywhere a schema lives
        for p in paths:
            if p and p[-1] in ("parameters", "input_schema", "schema"):
                return _set(body, p, copy.deepcopy(rng.choice(BAD_TOOLS)))
    # a bad name anywhere a name lives
    for p in paths:
        if p and p[-1] == "name":
            return _set(body, p, rng.choice(BAD_NAMES))
    return _set(body, path, rng.choice(VALUES))


def _bodies(seed: int, bases: list[dict[str, Any]]) -> Iterator[bytes]:
    rng = random.Random(seed)
    for i in range(N_BODIES):
        body: Any = copy.deepcopy(bases[i % len(bases)])
        for _ in range(rng.randint(1, 3)):
            body = _mutate(rng, body)
        yield json.dumps(body).encode()


def _anthropic_shaped(r: httpx.Response) -> bool:
    body = r.json()
    err = body.get("error") if isinstance(body, dict) else None
    return body.get("type") == "error" and isinstance(err, dict) and bool(err.get("message"))


def _openai_shaped(r: httpx.Response) -> bool:
    err = r.json().get("error")
    return (
        isinstance(err, dict) and bool(err.get("message")) and {"type", "param", "code"} <= set(err)
    )


@pytest.fixture(scope="module")
def server(tiny_hybrid_path: Path, draft_path: Path) -> Iterator[Any]:
    script = ScriptedGenerate(["</think>\n\n", '{"city": "Oslo"}'])
    app = make_app(tiny_hybrid_path, draft_path, generate=script, served_model_name="tiny")
    with run_server(app) as srv:
        yield srv


@pytest.mark.slow
@pytest.mark.parametrize(
    ("path", "bases", "shaped", "seed"),
    [
        ("/v1/messages", MESSAGES_BASES, _anthropic_shaped, 19),
        ("/v1/responses", RESPONSES_BASES, _openai_shaped, 20),
    ],
    ids=["messages", "responses"],
)
def test_mutated_bodies_are_never_5xx(
    server: RunningServer, path: str, bases: list[dict[str, Any]], shaped: Any, seed: int
) -> None:
    for base in bases:  # the bases themselves are valid
        assert httpx.post(server.base_url + path, json=base, timeout=20).status_code == 200
    counts: dict[int, int] = {}
    js = {"content-type": "application/json"}
    with httpx.Client(base_url=server.base_url, timeout=20) as client:
        for i, body in enumerate(_bodies(seed, bases)):
            r = client.post(path, content=body, headers=js)
            counts[r.status_code] = counts.get(r.status_code, 0) + 1
            assert r.status_code < 500, (i, r.status_code, r.text[:300], body[:400])
            if r.status_code >= 400:
                assert shaped(r), (i, r.text[:300])
        assert counts.get(400, 0) >= N_BODIES // 3, counts  # most mutants are refused
        assert client.get("/health").json()["status"] == "ready"
        assert client.post(path, json=bases[0]).status_code == 200
    assert server.engine.queue_depth == 0
