"""Tool calls through the openai SDK: scripted model output (exact splits) and the real tiny model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import mlx_lm
import openai
import pytest

from server_fixtures import (
    RunningServer,
    ScriptedGenerate,
    make_app,
    run_server,
    tool_call_markup,
)

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["C", "F"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "hourly": {"type": "boolean"},
    },
    "required": ["city", "days"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}},
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    },
]
MESSAGES = [{"role": "user", "content": "Weather in Paris and Rome?"}]
MARKUP = ("<tool_call>", "</tool_call>", "<function", "<parameter", "</think>")


# Reasoning, then two calls; cut into 5-character pieces so every tag is split somewhere.
SCRIPT = (
    "I need the weather for two cities.</think>\n\n"
    + tool_call_markup("get_weather", city="Paris", days="3", hourly="true")
    + "\n"
    + tool_call_markup("get_weather", city="Rome", unit="C", days="1")
)


def _pieces(text: str, n: int = 5) -> list[str]:
    return [text[i : i + n] for i in range(0, len(text), n)]


@pytest.fixture(scope="module")
def scripted(tiny_hybrid_path: Path, draft_path: Path) -> Iterator[tuple[Any, ScriptedGenerate]]:
    script = ScriptedGenerate(_pieces(SCRIPT))
    app = make_app(tiny_hybrid_path, draft_path, generate=script, served_model_name="tiny")
    with run_server(app) as srv:
        yield openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0), script


@pytest.fixture(scope="module")
def server(tiny_hybrid_path: Path, draft_path: Path) -> Iterator[RunningServer]:
    app = make_app(tiny_hybrid_path, draft_path, served_model_name="tiny", temperature=0.0)
    with run_server(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


def _collect(stream: Any) -> tuple[str, str, dict[int, dict[str, Any]], str | None]:
    """(reasoning, content, tool calls by index, finish_reason) accumulated like a client."""
    reasoning = content = ""
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            slot["id"] = tc.id or slot["id"]
            slot["name"] += tc.function.name or ""
            slot["arguments"] += tc.function.arguments or ""
        finish = choice.finish_reason or finish
    return reasoning, content, calls, finish


def test_reasoning_then_two_calls_streamed(scripted: tuple[Any, ScriptedGenerate]) -> None:
    client, script = scripted
    script.pieces = _pieces(SCRIPT)
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, stream=True
    )
    reasoning, content, calls, finish = _collect(stream)
    assert reasoning == "I need the weather for two cities." and content == ""
    assert finish == "tool_calls" and sorted(calls) == [0, 1]
    args = [json.loads(calls[i]["arguments"]) for i in (0, 1)]
    assert args == [
        {"city": "Paris", "days": 3, "hourly": True},
        {"city": "Rome", "unit": "C", "days": 1},
    ]
    assert all(c["name"] == "get_weather" and c["id"].startswith("call_") for c in calls.values())
    assert not any(m in reasoning + content for m in MARKUP)


@pytest.mark.parametrize("size", [1, 7, 10_000])
def test_calls_not_streamed(scripted: tuple[Any, ScriptedGenerate], size: int) -> None:
    client, script = scripted
    script.pieces = _pieces(
        "Checking." + "</think>\n\nSure.\n" + tool_call_markup("search", q="a <b> c"), size
    )
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert message.content == "Sure." and message.model_extra["reasoning_content"] == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("search", {"q": "a <b> c"})
    ]


def test_malformed_call_comes_back_as_text(scripted: tuple[Any, ScriptedGenerate]) -> None:
    client, script = scripted
    bad = "<tool_call>\n<function=search>\noops\n</function>\n</tool_call>"
    script.pieces = _pieces("</think>\n\n" + bad)
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == bad
    # Without tools in the request, the same text is just text (nothing is parsed).
    script.pieces = _pieces("</think>\n\n" + tool_call_markup("search", q="x"))
    r = client.chat.completions.create(model="tiny", messages=MESSAGES)
    assert r.choices[0].message.content == tool_call_markup("search", q="x")


def test_parallel_tool_calls_false(scripted: tuple[Any, ScriptedGenerate]) -> None:
    client, script = scripted
    script.pieces = _pieces(SCRIPT)
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, parallel_tool_calls=False
    )
    assert len(r.choices[0].message.tool_calls) == 1


def _forced(client: openai.OpenAI, **kw: Any) -> Any:
    return client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        max_tokens=200,
        # A small block: the random drafter accepts ~nothing, so big blocks only cost time.
        extra_body={"enable_thinking": False, "block_size": 3, **kw.pop("extra_body", {})},
        **kw,
    )


def test_real_model_forced_call_round_trip(
    client: openai.OpenAI, server: RunningServer, tiny_hybrid_path: Path
) -> None:
    """A random model, forced by tool_choice, writes a valid call; the result is fed back."""
    r = _forced(client)
    assert r.choices[0].finish_reason == "tool_calls" and r.model_extra["dflash"]["speculative"]
    (call,) = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER_PARAMS)
    # Streamed, and without speculation: the same call (greedy decoding is exact).
    _, content, calls, finish = _collect(_forced(client, stream=True))
    assert finish == "tool_calls" and content == ""
    assert json.loads(calls[0]["arguments"]) == args
    plain = _forced(client, extra_body={"speculative": False})
    assert plain.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    # Feed the result back: the template renders the call and the tool message.
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    again = client.chat.completions.create(
        model="tiny", messages=history, tools=TOOLS, max_tokens=5
    )
    assert again.choices[0].finish_reason in ("length", "stop")
    _, tokenizer = mlx_lm.load(str(tiny_hybrid_path))
    rendered = tokenizer.apply_chat_template(
        [*history[:1], {**history[1], "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": args}}
        ]}, history[2]],
        tools=TOOLS,
        add_generation_prompt=True,
        enable_thinking=True,
        tokenize=False,
    )  # fmt: skip
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in rendered
    assert again.usage.prompt_tokens == len(tokenizer.encode(rendered))


def test_tool_choice_none_and_required(client: openai.OpenAI) -> None:
    base = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
    none = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=1
    )
    assert none.usage.prompt_tokens == base.usage.prompt_tokens  # tools left out of the prompt
    required = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        extra_body={"enable_thinking": False, "speculative": False},
    )
    (call,) = required.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "search")
