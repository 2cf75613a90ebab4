"""The OpenAI Responses API through the official ``openai`` SDK (``responses.create`` and
``.stream``): scripted output for exact shapes (items, events, function calls, the store) and
the real tiny model for ``text.format`` json_schema after a thinking budget."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from server_fixtures import (
    ScriptedGenerate,
    make_app,
    pieces,
    run_server,
    tool_call_markup,
)

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    }
]


@pytest.fixture(scope="module")
def scripted(
    tiny_hybrid_path: Path, draft_path: Path
) -> Iterator[tuple[openai.OpenAI, ScriptedGenerate]]:
    script = ScriptedGenerate(["x"])
    app = make_app(
        tiny_hybrid_path, draft_path, generate=script, served_model_name="tiny", responses_store=3
    )
    with run_server(app) as srv:
        yield openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0), script


def test_reasoning_and_message_items(scripted: tuple[openai.OpenAI, ScriptedGenerate]) -> None:
    client, script = scripted
    script.pieces = pieces("Thinking it over.</think>\n\nHello there.")
    r = client.responses.create(model="tiny", input="Hi", instructions="Be kind.")
    assert r.status == "completed" and r.object == "response" and r.instructions == "Be kind."
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Thinking it over." and r.output_text == "Hello there."
    assert r.usage.output_tokens == len(script.pieces) and r.usage.output_tokens_details
    assert r.usage.input_tokens == len(script.calls[-1]["prompt"])
    with client.responses.stream(model="tiny", input="Hi") as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert "response.reasoning_text.delta" in kinds and "response.output_text.delta" in kinds
    assert kinds[-1] == "response.completed" and final.output_text == "Hello there."
    assert final.output[0].content[0].text == "Thinking it over."


def test_max_output_tokens_is_incomplete(scripted: tuple[openai.OpenAI, ScriptedGenerate]) -> None:
    client, script = scripted
    script.pieces = ["</think>\n\n", "a", "b", "c", "d"]
    r = client.responses.create(model="tiny", input="Hi", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    with client.responses.stream(model="tiny", input="Hi", max_output_tokens=3) as stream:
        kinds = [e.type for e in stream]
    assert kinds[-1] == "response.incomplete"


def test_function_call_round_trip(
    scripted: tuple[openai.OpenAI, ScriptedGenerate], tiny_hybrid: tuple[Any, Any]
) -> None:
    client, script = scripted
    script.pieces = pieces(
        "Need data.</think>\n\n" + tool_call_markup("get_weather", city="Rome", days="2")
    )
    r = client.responses.create(model="tiny", input="Weather in Rome?", tools=TOOLS)
    (reasoning, call) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Rome", "days": 2}
    with client.responses.stream(model="tiny", input="Weather in Rome?", tools=TOOLS) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_response().output[1]
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    assert streamed.arguments == call.arguments
    # Round trip, spelled out: the items go back with the function's output...
    script.pieces = ["</think>\n\n", "Sunny in Rome."]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 25}'}
    items = [
        {"role": "user", "content": "Weather in Rome?"},
        reasoning.model_dump(exclude_none=True),
        call.model_dump(exclude_none=True),
        output,
    ]
    again = client.responses.create(model="tiny", input=items, tools=TOOLS)
    assert again.output_text == "Sunny in Rome."
    explicit = script.calls[-1]["prompt"]
    text = tiny_hybrid[1].decode(explicit)
    assert '<tool_response>\n{"temp": 25}\n</tool_response>' in text
    assert "<function=get_weather>" in text and "Need data." in text
    # ... or by previous_response_id: the same prompt.
    client.responses.create(model="tiny", previous_response_id=r.id, input=[output], tools=TOOLS)
    assert script.calls[-1]["prompt"] == explicit


def test_previous_response_id_and_the_store(
    scripted: tuple[openai.OpenAI, ScriptedGenerate],
) -> None:
    client, script = scripted
    script.pieces = ["</think>\n\n", "First."]
    first = client.responses.create(model="tiny", input="One", instructions="Old rules.")
    assert client.responses.retrieve(first.id).output_text == "First."
    script.pieces = ["</think>\n\n", "Second."]
    second = client.responses.create(
        model="tiny", input="Two", previous_response_id=first.id, instructions="New rules."
    )
    assert second.previous_response_id == first.id
    prompt = script.calls[-1]["prompt"]
    assert len(prompt) > len(script.calls[-2]["prompt"])  # the first turn is in it
    unstored = client.responses.create(model="tiny", input="x", store=False)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.create(model="tiny", input="y", previous_response_id=unstored.id)
    for i in range(3):  # the store keeps 3: the first response falls out
        client.responses.create(model="tiny", input=f"n{i}")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_instructions_are_not_carried_over(
    scripted: tuple[openai.OpenAI, ScriptedGenerate], tiny_hybrid: tuple[Any, Any]
) -> None:
    client, script = scripted
    script.pieces = ["</think>\n\n", "ok"]
    first = client.responses.create(model="tiny", input="One", instructions="Speak French.")
    client.responses.create(model="tiny", input="Two", previous_response_id=first.id)
    text = tiny_hybrid[1].decode(script.calls[-1]["prompt"])
    assert "Speak French." not in text and "One" in text and "Two" in text


def test_effort_and_refusals(scripted: tuple[openai.OpenAI, ScriptedGenerate]) -> None:
    client, script = scripted
    script.pieces = ["Plain."]
    r = client.responses.create(model="tiny", input="Hi", reasoning={"effort": "none"})
    assert r.output_text == "Plain." and not script.calls[-1]["request"].reasoning.opens
    script.pieces = ["</think>\n\n", "ok"]
    client.responses.create(
        model="tiny", input="Hi", reasoning={"effort": "low"}, max_output_tokens=5000
    )
    assert script.calls[-1]["request"].constraint.budget == 1024
    with pytest.raises(openai.BadRequestError, match="web_search"):  # forced: cannot run it
        client.responses.create(
            model="tiny",
            input="Hi",
            tools=[{"type": "web_search"}],
            tool_choice={"type": "web_search"},
        )
    with pytest.raises(openai.BadRequestError, match="item_reference"):
        client.responses.create(model="tiny", input=[{"type": "item_reference", "id": "x"}])
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        client.responses.create(model="tiny", input="Hi", reasoning={"effort": "max"})


def test_real_model_json_schema_after_thinking(tiny_hybrid_path: Path, draft_path: Path) -> None:
    """Thinking on and a schema: the default budget closes the reasoning, then the JSON."""
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
        "additionalProperties": False,
    }
    fmt = {"format": {"type": "json_schema", "name": "w", "schema": schema, "strict": True}}
    app = make_app(tiny_hybrid_path, draft_path, served_model_name="tiny", temperature=0.0)
    with run_server(app) as srv:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0)
        kw: dict[str, Any] = {"model": "tiny", "input": "Weather?", "max_output_tokens": 160}
        r = client.responses.create(**kw, text=fmt, extra_body={"block_size": 3})
        assert r.status == "completed", r.output
        assert [i.type for i in r.output] == ["reasoning", "message"]
        jsonschema.validate(json.loads(r.output_text), schema)
        assert r.usage.output_tokens_details.reasoning_tokens <= 80 + 3  # default: half
        with client.responses.stream(**kw, text=fmt) as stream:
            final = stream.get_final_response()
        assert final.output_text == r.output_text
        body = {**kw, "input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}]}]}
        assert httpx.post(f"{srv.base_url}/v1/responses", json=body).status_code == 200
