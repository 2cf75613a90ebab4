"""What real agent clients send (Codex, Claude Code, Open WebUI), through the official ``openai``
and ``anthropic`` SDKs: namespace and hosted tools, context overflow wording, system messages
mid-conversation, omitted thinking, and hostile tool definitions and values as 400s naming
the field. Scripted output for exact shapes; the real tiny model where tokens matter."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from server_fixtures import (
    RunningServer,
    ScriptedGenerate,
    make_app,
    pieces,
    run_server,
    tool_call_markup,
)

CONTEXT = 1024
LONG = " ".join(["lorem"] * 3000)  # well over CONTEXT tokens
NAMESPACE = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Sub-agents.",
    "tools": [
        {
            "type": "function",
            "name": "spawn_agent",
            "description": "Start a sub-agent.",
            "strict": False,
            "parameters": {
                "type": "object",
                "properties": {"task": {"type": "string"}},
                "required": ["task"],
            },
        },
        {"type": "function", "name": "close_agent", "parameters": {"type": "object"}},
    ],
}
WEB_SEARCH = {"type": "web_search", "external_web_access": False}
SHELL = {
    "type": "function",
    "name": "shell",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
}


@pytest.fixture(scope="module")
def served(
    tiny_hybrid_path: Path, draft_path: Path
) -> Iterator[tuple[RunningServer, ScriptedGenerate]]:
    script = ScriptedGenerate(["x"])
    app = make_app(
        tiny_hybrid_path,
        draft_path,
        generate=script,
        served_model_name="tiny",
        context_length=CONTEXT,
    )

    async def boom() -> None:  # a bug in a handler, for the keep-alive check
        raise RuntimeError("bug")

    app.add_api_route("/v1/boom", boom, methods=["GET"])
    with run_server(app) as srv:
        yield srv, script


@pytest.fixture
def oai(served: tuple[RunningServer, ScriptedGenerate]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[0].base_url}/v1", api_key="x", max_retries=0)


@pytest.fixture
def claude(served: tuple[RunningServer, ScriptedGenerate]) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served[0].base_url, api_key="x", max_retries=0)


def _prompt(served: tuple[RunningServer, ScriptedGenerate], tokenizer: Any) -> str:
    return tokenizer.decode(served[1].calls[-1]["prompt"])


# ----- 1. Codex: namespace tools and hosted tools --------------------------------------------


def test_namespace_tools_are_flattened_and_calls_mapped_back(
    served: tuple[RunningServer, ScriptedGenerate], oai: openai.OpenAI, tiny_hybrid: Any
) -> None:
    script = served[1]
    script.pieces = pieces(
        "</think>\n\n" + tool_call_markup("multi_agent_v1__spawn_agent", task="lint")
    )
    tools = [SHELL, NAMESPACE, WEB_SEARCH]
    raw = oai.responses.with_raw_response.create(model="tiny", input="Go", tools=tools)
    assert raw.headers["x-dflash-ignored-tools"] == "web_search"
    r = raw.parse()
    (call,) = r.output
    assert call.type == "function_call" and call.name == "spawn_agent"
    assert call.namespace == "multi_agent_v1" and json.loads(call.arguments) == {"task": "lint"}
    prompt = _prompt(served, tiny_hybrid[1])
    assert '"name": "multi_agent_v1__spawn_agent"' in prompt
    assert '"name": "multi_agent_v1__close_agent"' in prompt and '"name": "shell"' in prompt
    assert "web_search" not in prompt
    assert [t.type for t in r.tools] == ["function", "namespace", "web_search"]
    # Streamed: output_item.added carries no item_id (the spec has none), the item the name.
    with oai.responses.stream(model="tiny", input="Go", tools=tools) as stream:
        events = list(stream)
        final = stream.get_final_response()
    added = [e for e in events if e.type == "response.output_item.added"]
    assert "item_id" not in added[0].model_dump() and added[0].item.namespace == "multi_agent_v1"
    assert final.output[0].name == "spawn_agent" and final.output[0].namespace == "multi_agent_v1"
    # The call goes back with its namespace: the prompt shows the flat name again.
    script.pieces = ["</think>\n\n", "Done."]
    back = [
        {"role": "user", "content": "Go"},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "started"},
    ]
    again = oai.responses.create(model="tiny", input=back, tools=tools)
    assert again.output_text == "Done."
    assert "<function=multi_agent_v1__spawn_agent>" in _prompt(served, tiny_hybrid[1])


def test_hosted_tools_are_left_out_unless_forced(
    served: tuple[RunningServer, ScriptedGenerate], oai: openai.OpenAI, tiny_hybrid: Any
) -> None:
    served[1].pieces = ["</think>\n\n", "Hello."]
    hosted = [WEB_SEARCH, {"type": "file_search", "vector_store_ids": ["v"]}]
    hosted += [{"type": "code_interpreter", "container": {"type": "auto"}}]
    raw = oai.responses.with_raw_response.create(model="tiny", input="Hi", tools=hosted)
    assert raw.headers["x-dflash-ignored-tools"] == "web_search,file_search,code_interpreter"
    assert raw.parse().output_text == "Hello."
    assert "<tools>" not in _prompt(served, tiny_hybrid[1])
    with pytest.raises(openai.BadRequestError, match="web_search") as forced:
        oai.responses.create(
            model="tiny", input="Hi", tools=hosted, tool_choice={"type": "web_search"}
        )
    assert forced.value.body["param"] == "tool_choice"


# ----- 2. context overflow in each protocol's wording ----------------------------------------


def test_context_overflow_wording_and_served_context(
    served: tuple[RunningServer, ScriptedGenerate],
    oai: openai.OpenAI,
    claude: anthropic.Anthropic,
) -> None:
    with pytest.raises(anthropic.BadRequestError) as too_long:
        claude.messages.create(
            model="tiny", max_tokens=10, messages=[{"role": "user", "content": LONG}]
        )
    error = too_long.value.body["error"]
    assert error["type"] == "invalid_request_error"
    match = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", error["message"])
    assert match and int(match[1]) > CONTEXT and int(match[2]) == CONTEXT
    openai_wording = (
        rf"This model's maximum context length is {CONTEXT} tokens\. However, your messages "
        r"resulted in \d+ tokens"
    )
    with pytest.raises(openai.BadRequestError, match=openai_wording) as chat:
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": LONG}])
    assert chat.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match=openai_wording) as resp:
        oai.responses.create(model="tiny", input=LONG)
    assert resp.value.code == "context_length_exceeded" and resp.value.param == "input"
    (card,) = oai.models.list().data
    assert card.model_dump()["context_length"] == CONTEXT == card.model_dump()["max_model_len"]
    assert oai.models.retrieve("tiny").model_dump()["max_input_tokens"] == CONTEXT


def test_truncation_auto_drops_the_oldest_turns(
    served: tuple[RunningServer, ScriptedGenerate], oai: openai.OpenAI, tiny_hybrid: Any
) -> None:
    served[1].pieces = ["</think>\n\n", "ok"]
    filler = " ".join(["the"] * 200)  # ~200 tokens
    turns: list[dict[str, Any]] = [{"role": "developer", "content": "Be terse."}]
    for i in range(8):
        turns += [
            {"role": "user", "content": f"question {i}: {filler}"},
            {"role": "assistant", "content": f"answer {i}"},
        ]
    turns.append({"role": "user", "content": "last question"})
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        oai.responses.create(model="tiny", input=turns)
    r = oai.responses.create(model="tiny", input=turns, truncation="auto")
    assert r.truncation == "auto" and r.output_text == "ok"
    prompt = _prompt(served, tiny_hybrid[1])
    assert len(served[1].calls[-1]["prompt"]) < CONTEXT
    assert "Be terse." in prompt and "last question" in prompt and "answer 7" in prompt
    assert "question 0:" not in prompt  # the oldest turn went first
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        oai.responses.create(model="tiny", input=LONG, truncation="auto")  # one turn: no cut
    with pytest.raises(openai.BadRequestError, match="truncation"):
        oai.responses.create(model="tiny", input="x", extra_body={"truncation": "middle"})


# ----- 3. system messages mid-conversation ---------------------------------------------------

# A template taking a system message only first, as Qwen3.5's does.
RAISES = (
    "{%- for m in messages %}{%- if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning.') }}"
    "{%- endif %}{%- endfor %}"
)


def test_system_messages_mid_conversation(
    served: tuple[RunningServer, ScriptedGenerate],
    oai: openai.OpenAI,
    claude: anthropic.Anthropic,
    tiny_hybrid: Any,
) -> None:
    served[1].pieces = ["</think>\n\n", "ok"]
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "system", "content": "Now answer in French."},
        {"role": "user", "content": "Weather?"},
    ]
    in_place = "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>system\nNow answer in French."
    claude.messages.create(model="tiny", max_tokens=5, system="Be brief.", messages=messages)
    assert in_place in _prompt(served, tiny_hybrid[1])  # the template allows it: in place
    late = [m | {"role": "developer"} if m["role"] == "system" else m for m in messages]
    chat = [{"role": "system", "content": "Be brief."}, *late]
    oai.chat.completions.create(model="tiny", messages=chat)
    assert in_place in _prompt(served, tiny_hybrid[1])
    oai.responses.create(model="tiny", input=late, instructions="Be brief.")
    assert in_place in _prompt(served, tiny_hybrid[1])
    # A template that takes one system message first: merged into it, in order.
    template = served[0].engine.models.pair.tokenizer._tokenizer
    original = template.chat_template
    template.chat_template = RAISES + original
    try:
        claude.messages.create(model="tiny", max_tokens=5, system="Be brief.", messages=messages)
        prompt = _prompt(served, tiny_hybrid[1])
        oai.chat.completions.create(model="tiny", messages=chat)
        assert _prompt(served, tiny_hybrid[1]) == prompt
        oai.responses.create(model="tiny", input=late, instructions="Be brief.")
        assert _prompt(served, tiny_hybrid[1]) == prompt
    finally:
        template.chat_template = original
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\nNow answer in French.<|im_end|>")
    assert prompt.count("<|im_start|>system") == 1


# ----- 6. thinking without its text ----------------------------------------------------------


def test_omitted_thinking_has_no_text(
    served: tuple[RunningServer, ScriptedGenerate], claude: anthropic.Anthropic, tiny_hybrid: Any
) -> None:
    served[1].pieces = pieces("Secret plan.</think>\n\nDone.")
    kw: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": 50,
        "messages": [{"role": "user", "content": "Go"}],
        "thinking": {"type": "adaptive", "display": "omitted"},
    }
    m = claude.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "" and m.content[0].signature
    assert "Secret" not in m.model_dump_json()
    with claude.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert "thinking_delta" not in deltas and "signature_delta" in deltas
    assert final.content[0].thinking == "" and final.content[0].signature
    # The block sent back renders the reasoning it stood for.
    served[1].pieces = ["</think>\n\n", "ok"]
    history = [*kw["messages"], {"role": "assistant", "content": m.content}]
    claude.messages.create(**kw | {"messages": [*history, {"role": "user", "content": "More"}]})
    assert "Secret plan." in _prompt(served, tiny_hybrid[1])


# ----- 8. hostile tool definitions and items: 400s naming the field --------------------------

BAD_SCHEMA = {"type": "object", "properties": 5}
BAD_NAME = "a</function><tool_call>"


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {}
    for _ in range(depth):
        schema = {"not": schema}
    return schema


def _chat_tool(name: str, parameters: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_bad_tool_schemas_and_names_are_400s(
    oai: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    msgs = [{"role": "user", "content": "Hi"}]
    for name, params, param in [
        ("f", BAD_SCHEMA, "tools.0.function.parameters"),
        (BAD_NAME, {"type": "object"}, "tools.0.function.name"),
        ("f", [1], "tools.0.function.parameters"),
        ("f", "object", "tools.0.function.parameters"),
        ("f", True, "tools.0.function.parameters"),
        ("x" * 129, {"type": "object"}, "tools.0.function.name"),
        ("f", {"type": "object", "properties": {"a>b": {}}}, "tools.0.function.parameters"),
        ("f", {"type": "object", "$schema": {}}, "tools.0.function.parameters"),
        ("f", {"type": "object", "not": _nested(450)}, "tools.0.function.parameters"),
    ]:
        forced = {"type": "function", "function": {"name": name}}
        with pytest.raises(openai.BadRequestError) as chat:
            oai.chat.completions.create(
                model="tiny", messages=msgs, tools=[_chat_tool(name, params)], tool_choice=forced
            )
        assert chat.value.body["param"].startswith(param), (name, params)
        tool = {"type": "function", "name": name, "parameters": params}
        with pytest.raises(openai.BadRequestError) as resp:
            oai.responses.create(
                model="tiny",
                input="Hi",
                tools=[tool],
                tool_choice={"type": "function", "name": name},
            )
        assert resp.value.body["param"].startswith(param.replace(".function", ""))
        with pytest.raises(anthropic.BadRequestError, match=r"tools\.0") as msg:
            claude.messages.create(
                model="tiny",
                max_tokens=5,
                messages=msgs,
                tools=[{"name": name, "input_schema": params}],
                tool_choice={"type": "tool", "name": name},
            )
        assert msg.value.body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ({"type": "reasoning", "summary": "x"}, "input.0.summary"),
        ({"type": "reasoning", "summary": [], "content": 5}, "input.0.content"),
        ({"type": "reasoning", "content": [{"type": "reasoning_text", "text": {}}]}, "input.0"),
        ({"type": "function_call", "name": "f", "call_id": 5}, "input.0.call_id"),
        ({"type": "function_call_output", "output": "x"}, "input.0.call_id"),
        ({"role": "root", "content": "x"}, "input.0.role"),
    ],
)
def test_bad_input_items_are_400s(oai: openai.OpenAI, item: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        oai.responses.create(model="tiny", input=[item, {"role": "user", "content": "hi"}])
    assert bad.value.body["param"].startswith(param)


def test_a_bug_is_a_500_that_keeps_the_connection(
    served: tuple[RunningServer, ScriptedGenerate],
) -> None:
    port = int(served[0].base_url.rsplit(":", 1)[1])
    request = b"GET /v1/boom HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        for _ in range(2):  # the same connection answers twice
            s.sendall(request)
            head, body = _read_response(s)
            assert head.startswith(b"HTTP/1.1 500") and b"connection: close" not in head.lower()
            assert json.loads(body)["error"]["type"] == "server_error"


def _read_response(s: socket.socket) -> tuple[bytes, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        assert chunk, "connection closed"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"content-length: (\d+)", head.lower())[1])
    while len(body) < length:
        body += s.recv(4096)
    return head, body


# ----- 9. invalid values: 400s naming the field ----------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": "bogus"}, "tool_choice"),
        ({"metadata": {"a": 1}}, "metadata"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"tools": [{"type": "function", "name": "f", "parameters": [1]}]}, "tools.0.parameters"),
        ({"tools": [{"type": "function", "name": "f", "parameters": True}]}, "tools.0.parameters"),
        ({"text": {"format": {"type": "json_schema"}}}, "text.format.name"),
        ({"text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tools": [WEB_SEARCH], "tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "namespace", "name": "n", "tools": 5}]}, "tools.0.tools"),
    ],
)
def test_invalid_responses_values_are_400s(
    served: tuple[RunningServer, ScriptedGenerate], extra: dict[str, Any], param: str
) -> None:
    body = {"model": "tiny", "input": "Hi"} | extra
    r = httpx.post(f"{served[0].base_url}/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.json()


def test_invalid_messages_values_are_400s(served: tuple[RunningServer, ScriptedGenerate]) -> None:
    base = {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]}
    weather = {"name": "w", "input_schema": {"type": "object"}}
    for extra, words in [
        ({"metadata": {"user_id": 5}}, "metadata"),
        ({"tools": [weather], "tool_choice": {"type": "tool", "name": "x"}}, "tool_choice"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"output_config": {"format": {"type": "json_schema"}}}, "output_config"),
        ({"output_config": {"format": {"type": "json_schema", "schema": 5}}}, "output_config"),
        ({"thinking": {"type": "adaptive", "display": "loud"}}, "thinking"),
    ]:
        r = httpx.post(f"{served[0].base_url}/v1/messages", json=base | extra)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["type"] == "error" and words in r.json()["error"]["message"], r.json()


# ----- 10. implemented instead of ignored ----------------------------------------------------


def test_output_config_json_schema_constrains_the_answer(
    served: tuple[RunningServer, ScriptedGenerate], claude: anthropic.Anthropic
) -> None:
    served[1].pieces = ["</think>\n\n", '{"a": 1}']
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    claude.messages.create(
        model="tiny",
        max_tokens=20,
        messages=[{"role": "user", "content": "Hi"}],
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}},
    )
    assert served[1].calls[-1]["request"].constraint is not None
    claude.messages.create(model="tiny", max_tokens=20, messages=[{"role": "user", "content": "x"}])
    assert served[1].calls[-1]["request"].constraint is None


def test_output_text_logprobs_match_chat(tiny_hybrid_path: Path, draft_path: Path) -> None:
    """include: message.output_text.logprobs: the chat API's logprobs for the same tokens."""
    app = make_app(tiny_hybrid_path, draft_path, served_model_name="tiny", temperature=0.0)
    with run_server(app) as srv:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0)
        kw: dict[str, Any] = {"model": "tiny", "extra_body": {"block_size": 4}}
        chat = client.chat.completions.create(
            messages=[{"role": "user", "content": "Count."}],
            max_tokens=8,
            logprobs=True,
            top_logprobs=2,
            reasoning_effort="none",
            **kw,
        )
        want = [
            (t.token, t.logprob, [a.token for a in t.top_logprobs])
            for t in chat.choices[0].logprobs.content
        ]
        r = client.responses.create(
            input="Count.",
            max_output_tokens=8,
            include=["message.output_text.logprobs"],
            top_logprobs=2,
            reasoning={"effort": "none"},
            **kw,
        )
        (part,) = r.output[-1].content
        got = [(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in part.logprobs]
        assert [g[0] for g in got] == [w[0] for w in want] and len(got) == 8
        assert part.text == chat.choices[0].message.content
        assert all(abs(g[1] - w[1]) < 1e-4 and g[2] == w[2] for g, w in zip(got, want))
        with client.responses.stream(
            input="Count.",
            max_output_tokens=8,
            include=["message.output_text.logprobs"],
            reasoning={"effort": "none"},
            **kw,
        ) as stream:
            events = list(stream)
        deltas = [
            lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs
        ]
        final = events[-1].response  # response.incomplete: max_output_tokens ended it
        assert final.status == "incomplete" and deltas == [g[0] for g in got]
        assert [t.token for t in final.output[-1].content[0].logprobs] == deltas
