"""Bodies checked against OpenAI's own OpenAPI schema, and the chat API's conformance fixes.

``tests/openapi/openai_subset.json`` holds the spec's schemas for these objects (extracted by
``tests/openapi/extract.py`` from github.com/openai/openai-openapi, MIT): chat completions and
their chunks, text completions, models, errors, Responses and their stream events. Every body
below, streamed or not, with tool calls and logprobs, must validate, so a change cannot drift.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import referencing
import referencing.jsonschema

from server_fixtures import (
    RunningServer,
    ScriptedGenerate,
    make_app,
    run_server,
    tool_call_markup,
)

SPEC = json.loads((Path(__file__).parent / "openapi" / "openai_subset.json").read_text())
_REGISTRY = referencing.Registry().with_resource(
    "spec", referencing.Resource(SPEC, referencing.jsonschema.DRAFT202012)
)
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]


def conforms(name: str, body: Any) -> None:
    """Raise unless ``body`` validates against the spec's schema ``name``."""
    schema = {"$ref": f"spec#/components/schemas/{name}"}
    validator = jsonschema.Draft202012Validator(schema, registry=_REGISTRY)
    errors = sorted(validator.iter_errors(body), key=lambda e: list(e.path))
    assert not errors, f"{name}: {errors[0].message} at {list(errors[0].path)}\n{body}"


def _event_schemas() -> dict[str, str]:
    """Responses stream event type -> the name of its schema in the spec."""
    schemas = SPEC["components"]["schemas"]
    out = {}
    for option in schemas["ResponseStreamEvent"]["anyOf"]:
        name = option["$ref"].rsplit("/", 1)[-1]
        out[schemas[name]["properties"]["type"]["enum"][0]] = name
    return out


EVENT_SCHEMAS = _event_schemas()


def _sse(r: httpx.Response) -> list[dict[str, Any]]:
    data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.fixture(scope="module")
def server(tiny_hybrid_path: Path, draft_path: Path) -> Iterator[RunningServer]:
    app = make_app(tiny_hybrid_path, draft_path, served_model_name="tiny", temperature=0.0)
    with run_server(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def scripted(tiny_hybrid_path: Path, draft_path: Path) -> Iterator[tuple[str, ScriptedGenerate]]:
    script = ScriptedGenerate(["x"])
    app = make_app(tiny_hybrid_path, draft_path, generate=script, served_model_name="tiny")
    with run_server(app) as srv:
        yield srv.base_url, script


# ----- the spec's schemas ------------------------------------------------------------------


def test_chat_and_completions_conform(server: RunningServer) -> None:
    url = server.base_url
    body = {**CHAT, "logprobs": True, "top_logprobs": 2}
    chat = httpx.post(f"{url}/v1/chat/completions", json=body).json()
    conforms("CreateChatCompletionResponse", chat)
    assert chat["choices"][0]["message"]["refusal"] is None  # required, nullable
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=stream) as r:
        chunks = _sse(r)
    for chunk in chunks:
        conforms("CreateChatCompletionStreamResponse", chunk)
    # With include_usage every chunk has "usage": null but the last, which has the usage.
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["usage"]["total_tokens"]
    usage = chunks[-1]["usage"]  # cached: prompt tokens the prefix cache restored (when on)
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"]
    text = {"prompt": "The", "max_tokens": 5, "logprobs": 2}
    conforms("CreateCompletionResponse", httpx.post(f"{url}/v1/completions", json=text).json())
    with httpx.stream("POST", f"{url}/v1/completions", json={**text, "stream": True}) as r:
        chunks = _sse(r)
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    for chunk in chunks:
        # The spec reuses the whole response for stream chunks, but OpenAI (and every client)
        # sends finish_reason null until the last: check the rest of each chunk.
        (choice,) = chunk["choices"]
        choice = choice | {"finish_reason": choice["finish_reason"] or "length"}
        conforms("CreateCompletionResponse", chunk | {"choices": [choice]})


def test_models_and_errors_conform(server: RunningServer) -> None:
    url = server.base_url
    conforms("ListModelsResponse", httpx.get(f"{url}/v1/models").json())
    conforms("Model", httpx.get(f"{url}/v1/models/tiny").json())
    for r in (
        httpx.get(f"{url}/v1/models/gpt-4"),
        httpx.post(f"{url}/v1/chat/completions", json={"messages": []}),
        httpx.post(f"{url}/v1/chat/completions", content=b"x", headers={"content-type": "text"}),
    ):
        assert r.status_code >= 400
        conforms("ErrorResponse", r.json())


def test_tool_calls_conform(scripted: tuple[str, ScriptedGenerate]) -> None:
    url, script = scripted
    script.pieces = [
        "</think>\n\n",
        tool_call_markup("search", q="a"),
        "\n",
        tool_call_markup("search", q="b"),
    ]
    body = {**CHAT, "tools": TOOLS, "max_tokens": 50}
    r = httpx.post(f"{url}/v1/chat/completions", json=body).json()
    conforms("CreateChatCompletionResponse", r)
    assert len(r["choices"][0]["message"]["tool_calls"]) == 2
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}) as s:
        chunks = _sse(s)
    for chunk in chunks:
        conforms("CreateChatCompletionStreamResponse", chunk)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_responses_conform(server: RunningServer) -> None:
    url = server.base_url
    body = {"input": "Hello", "max_output_tokens": 6, "reasoning": {"effort": "low"}}
    conforms("Response", httpx.post(f"{url}/v1/responses", json=body).json())
    with httpx.stream("POST", f"{url}/v1/responses", json={**body, "stream": True}) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        conforms(EVENT_SCHEMAS[event["type"]], event)


# ----- conformance fixes -------------------------------------------------------------------


def test_nulls_and_bounds_the_spec_allows(server: RunningServer) -> None:
    url = f"{server.base_url}/v1/chat/completions"
    for extra in ({"stream": None}, {"top_p": 0}, {"stream_options": None, "n": None}):
        r = httpx.post(url, json={**CHAT, **extra})
        assert r.status_code == 200, (extra, r.text)
    # top_p 0 keeps only the most likely token: the greedy answer, also when sampling.
    greedy = httpx.post(url, json={**CHAT, "temperature": 0}).json()
    hot = httpx.post(url, json={**CHAT, "temperature": 1.5, "top_p": 0, "seed": 3}).json()
    assert hot["choices"][0]["message"] == greedy["choices"][0]["message"]


def test_refusal_parts_in_history(server: RunningServer) -> None:
    refusal = {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]}
    messages = [{"role": "user", "content": "x"}, refusal, {"role": "user", "content": "y"}]
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json={**CHAT, "messages": messages})
    assert r.status_code == 200, r.text


def test_405_allow_and_request_id(server: RunningServer) -> None:
    r = httpx.get(f"{server.base_url}/v1/chat/completions")
    assert r.status_code == 405 and "POST" in r.headers["allow"]
    conforms("ErrorResponse", r.json())
    ids = {httpx.get(f"{server.base_url}/v1/models").headers["x-request-id"] for _ in range(2)}
    assert len(ids) == 2  # a fresh one per request...
    mine = {"x-request-id": "trace-42"}
    assert (
        httpx.get(f"{server.base_url}/health", headers=mine).headers["x-request-id"] == "trace-42"
    )
    bad = {"x-request-id": "a b\tc"}  # ...and the client's own only when it is a plain token
    assert httpx.get(f"{server.base_url}/health", headers=bad).headers["x-request-id"] != "a b\tc"


def test_max_queue_default_queues_a_fan_out() -> None:
    from dflash_server.settings import Settings

    assert Settings.load(target="t", draft="d").max_queue >= 256


# ----- tool-call markup never leaks --------------------------------------------------------


def _chat(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], str, list[Any], str]:
    """(non-streamed message, streamed content, streamed calls, streamed finish_reason)."""
    whole = httpx.post(f"{url}/v1/chat/completions", json=body).json()
    content, calls, finish = "", [], None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}) as r:
        for chunk in _sse(r):
            for choice in chunk["choices"]:
                content += choice["delta"].get("content") or ""
                calls += choice["delta"].get("tool_calls") or []
                finish = choice["finish_reason"] or finish
    return whole, content, calls, finish


@pytest.mark.parametrize("forced", [None, "required"])
def test_call_cut_by_max_tokens_is_dropped(
    scripted: tuple[str, ScriptedGenerate], forced: str | None
) -> None:
    """A complete call, then another that max_tokens cuts: the partial markup never shows,
    and the cut call is dropped from a whole answer (finish_reason tool_calls, not length)."""
    url, script = scripted
    first, second = tool_call_markup("search", q="a"), tool_call_markup("search", q="b")
    script.pieces = ["</think>\n\n", first, "\n", *second[:30]]  # 30 pieces of 1 character
    body = {**CHAT, "tools": TOOLS, "max_tokens": len(script.pieces) - 5, "tool_choice": forced}
    whole, content, calls, finish = _chat(url, body)
    message = whole["choices"][0]["message"]
    assert message["content"] is None and content == ""
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == ['{"q": "a"}']
    assert len(calls) == 1 and finish == whole["choices"][0]["finish_reason"] == "tool_calls"
    assert whole["dflash"]["dropped_tool_calls"] == 1


def test_only_call_cut_leaves_no_markup(scripted: tuple[str, ScriptedGenerate]) -> None:
    url, script = scripted
    script.pieces = ["</think>\n\n", *tool_call_markup("search", q="abc")]
    body = {**CHAT, "tools": TOOLS, "max_tokens": 20, "tool_choice": "required"}
    whole, content, calls, finish = _chat(url, body)
    message = whole["choices"][0]["message"]
    assert message["content"] == "" == content and calls == [] and "tool_calls" not in message
    assert finish == whole["choices"][0]["finish_reason"] == "length"
