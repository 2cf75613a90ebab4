"""The Anthropic Messages API through the official ``anthropic`` SDK: scripted output for exact
shapes (blocks, events, tools round trip, stop sequences, errors, count_tokens) and the real
tiny model for a forced tool call after a thinking budget."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from server_fixtures import (
    ScriptedGenerate,
    make_app,
    pieces,
    run_server,
    tool_call_markup,
)

WEATHER = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
        "required": ["city", "days"],
    },
}
HELLO = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def scripted(
    tiny_hybrid_path: Path, draft_path: Path
) -> Iterator[tuple[anthropic.Anthropic, ScriptedGenerate, str]]:
    script = ScriptedGenerate(["x"])
    app = make_app(
        tiny_hybrid_path, draft_path, generate=script, served_model_name="tiny", api_key="k"
    )
    with run_server(app) as srv:
        client = anthropic.Anthropic(base_url=srv.base_url, api_key="k", max_retries=0)
        yield client, script, srv.base_url


def test_thinking_and_text_blocks(scripted: tuple[Any, ScriptedGenerate, str]) -> None:
    client, script, _ = scripted
    script.pieces = pieces("Let me think.</think>\n\nIt is sunny.")
    m = client.messages.create(model="tiny", max_tokens=100, messages=HELLO)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "Let me think." and m.content[1].text == "It is sunny."
    assert m.stop_reason == "end_turn" and m.stop_sequence is None and m.role == "assistant"
    prompt = len(script.calls[-1]["prompt"])
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == prompt
    assert m.usage.output_tokens == len(script.pieces)
    # Streamed: the real event sequence, and the same message at the end.
    with client.messages.stream(model="tiny", max_tokens=100, messages=HELLO) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[-2] == "message_delta"
    assert kinds.count("content_block_start") == 2 == kinds.count("content_block_stop")
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in m.content]
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == m.usage.output_tokens


def test_raw_stream_has_event_names_and_ping(scripted: tuple[Any, ScriptedGenerate, str]) -> None:
    _, script, url = scripted
    script.pieces = ["</think>\n\n", "Hi", "."]
    body = {"model": "tiny", "max_tokens": 10, "messages": HELLO, "stream": True}
    with httpx.stream("POST", f"{url}/v1/messages", json=body, headers={"x-api-key": "k"}) as r:
        lines = [line for line in r.iter_lines() if line]
    events = [line[7:] for line in lines if line.startswith("event: ")]
    datas = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert events[:2] == ["message_start", "ping"] and events == [d["type"] for d in datas]
    assert "[DONE]" not in "".join(lines)  # Anthropic streams end with message_stop


def test_tool_use_round_trip(
    scripted: tuple[Any, ScriptedGenerate, str], tiny_hybrid: tuple[Any, Any]
) -> None:
    client, script, _ = scripted
    script.pieces = pieces(
        "</think>\n\nChecking.\n" + tool_call_markup("get_weather", city="Paris", days="2")
    )
    m = client.messages.create(model="tiny", max_tokens=200, messages=HELLO, tools=[WEATHER])
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["text", "tool_use"]
    use = m.content[1]
    assert use.name == "get_weather" and use.input == {"city": "Paris", "days": 2}
    assert use.id.startswith("toolu_")
    with client.messages.stream(
        model="tiny", max_tokens=200, messages=HELLO, tools=[WEATHER]
    ) as stream:
        final = stream.get_final_message()
    assert final.content[1].input == use.input and final.stop_reason == "tool_use"
    # The result goes back as a tool_result block: rendered as the template's tool response.
    script.pieces = ["</think>\n\n", "Sunny."]
    history = [
        *HELLO,
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": '{"temp": 21}'},
                {"type": "text", "text": "Thanks"},
            ],
        },
    ]
    again = client.messages.create(model="tiny", max_tokens=50, messages=history, tools=[WEATHER])
    assert again.content[-1].text == "Sunny."
    prompt = tiny_hybrid[1].decode(script.calls[-1]["prompt"])
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in prompt
    assert "<function=get_weather>" in prompt and "Thanks" in prompt


def test_stop_sequences_and_max_tokens(scripted: tuple[Any, ScriptedGenerate, str]) -> None:
    client, script, _ = scripted
    script.pieces = pieces("</think>\n\nOne, two, STOP three and more and more", 3)
    script.delay, finished = 0.03, script.finished
    kw = {"model": "tiny", "max_tokens": 100, "messages": HELLO, "stop_sequences": ["STOP", "x"]}
    m = client.messages.create(**kw)
    assert m.content[0].text == "One, two, " and m.stop_reason == "stop_sequence"
    assert m.stop_sequence == "STOP"
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == "One, two, " and final.stop_sequence == "STOP"
    script.delay = 0.0
    # Generation itself ends at the match (the request's stop strings), nothing runs past it.
    assert script.finished == finished + 2
    m = client.messages.create(model="tiny", max_tokens=5, messages=HELLO)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 5


def test_errors_are_anthropic_shaped(scripted: tuple[Any, ScriptedGenerate, str]) -> None:
    client, _, url = scripted
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="tiny", max_tokens=0, messages=HELLO)
    assert bad.value.body["type"] == "error"
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-x", max_tokens=5, messages=HELLO)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(
            model="tiny", max_tokens=5, messages=[{"role": "user", "content": [image]}]
        )
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=5, messages=HELLO
        )
    r = httpx.post(f"{url}/v1/messages", json={}, headers={"x-api-key": "k"})
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_count_tokens(scripted: tuple[Any, ScriptedGenerate, str]) -> None:
    client, script, _ = scripted
    script.pieces = ["</think>\n\n", "ok"]
    kw = {"model": "tiny", "messages": HELLO, "tools": [WEATHER], "system": "Be brief."}
    counted = client.messages.count_tokens(**kw).input_tokens
    client.messages.create(max_tokens=5, **kw)
    assert counted == len(script.calls[-1]["prompt"]) > 10


def test_thinking_disabled_and_budget(scripted: tuple[Any, ScriptedGenerate, str]) -> None:
    client, script, _ = scripted
    script.pieces = ["Plain answer."]
    m = client.messages.create(
        model="tiny", max_tokens=20, messages=HELLO, thinking={"type": "disabled"}
    )
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == "Plain answer."
    assert not script.calls[-1]["request"].reasoning.opens
    client.messages.create(
        model="tiny",
        max_tokens=64,
        messages=HELLO,
        thinking={"type": "enabled", "budget_tokens": 16},
    )
    constraint = script.calls[-1]["request"].constraint
    assert constraint is not None and constraint.budget == 16


def test_real_model_forced_tool_after_thinking_budget(
    tiny_hybrid_path: Path, draft_path: Path
) -> None:
    """The random model never closes its reasoning by itself: the budget makes it, then the
    forced call follows, valid for its schema (speculative and plain decoding agree)."""
    app = make_app(tiny_hybrid_path, draft_path, served_model_name="tiny", temperature=0.0)
    with run_server(app) as srv:
        client = anthropic.Anthropic(base_url=srv.base_url, api_key="x", max_retries=0)
        kw: dict[str, Any] = {
            "model": "tiny",
            "max_tokens": 120,
            "messages": HELLO,
            "tools": [WEATHER],
            "tool_choice": {"type": "tool", "name": "get_weather"},
            "thinking": {"type": "enabled", "budget_tokens": 12},
            "extra_body": {"block_size": 3},
        }
        m = client.messages.create(**kw)
        assert m.stop_reason == "tool_use" and [b.type for b in m.content] == [
            "thinking",
            "tool_use",
        ]
        jsonschema.validate(m.content[1].input, WEATHER["input_schema"])
        with client.messages.stream(**kw | {"extra_body": {"speculative": False}}) as stream:
            plain = stream.get_final_message()
        assert plain.content[1].input == m.content[1].input
        assert plain.content[0].thinking == m.content[0].thinking


def test_pings_during_a_long_prefill(tiny_hybrid_path: Path, draft_path: Path) -> None:
    script = ScriptedGenerate(["</think>\n\n", "ok"], first_delay=0.5)
    app = make_app(
        tiny_hybrid_path, draft_path, generate=script, keepalive=0.1, served_model_name="tiny"
    )
    body = {"model": "tiny", "max_tokens": 5, "messages": HELLO, "stream": True}
    with (
        run_server(app) as srv,
        httpx.stream("POST", f"{srv.base_url}/v1/messages", json=body) as r,
    ):
        events = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert events.count("ping") >= 3 and events[-1] == "message_stop"
