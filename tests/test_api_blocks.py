"""Every API's answer is the same blocks in the model's order, streamed or not, however its text
is chunked; with thinking off a ``<think>`` the model writes stays answer text.

The shapers are fed the same text cut every possible way (fast, exact), then the real server
replays the same token ids through the real detokenizer, an incomplete UTF-8 character just
before ``<think>`` included, to each SDK streamed and not.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anthropic
import openai
import pytest

from dflash_server.api.anthropic_events import MessageShaper
from dflash_server.api.openai_events import ChatShaper
from dflash_server.api.openai_responses import ResponsesRequest, ResponseStore
from dflash_server.api.openai_responses_events import ResponseShaper
from dflash_server.api.openai_responses_tools import ResponseTools
from dflash_server.api.prepare import Prepared
from dflash_server.engine.jobs import Finished, TextChunk
from dflash_server.generation.request import GenerationRequest, Reasoning
from server_fixtures import RunningServer, ScriptedTokens, make_app, run_server, tool_call_markup

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CALL = tool_call_markup("f", x="1")
# Reasoning, an answer, more reasoning mid-answer, the rest of the answer, a call, more text.
THINKING = f"Plan it.</think>\n\nAnswer \ufffd<think>more</think>end. {CALL} after."
NO_THINKING = f"Answer \ufffd<think>more</think>end. {CALL} after."

Blocks = list[tuple[str, Any]]


def _prepared(thinking: bool) -> Prepared:
    request = GenerationRequest((1,), 100, reasoning=Reasoning(opens=thinking))
    return Prepared("chat", request, "m", False, False, tools=TOOLS, thinking=thinking)


def _shapers(thinking: bool) -> dict[str, Any]:
    prepared, tokenizer = _prepared(thinking), SimpleNamespace()
    responses = ResponseShaper(
        prepared, tokenizer, ResponsesRequest(input="x"), ResponseTools(), ResponseStore(0), []
    )
    return {
        "chat": ChatShaper(prepared, tokenizer),
        "messages": MessageShaper(prepared, tokenizer),
        "responses": responses,
    }


def _chat_blocks(events: list[dict[str, Any]]) -> Blocks:
    """A chat stream's deltas as runs of one kind, in order."""
    out: Blocks = []
    for event in events:
        for choice in event["choices"]:
            delta = choice.get("delta", {})
            for kind in ("reasoning_content", "content", "tool_calls"):
                value = delta.get(kind)
                if not value:
                    continue
                if kind == "tool_calls":
                    out += [("tool_calls", c["function"]["name"]) for c in value]
                elif out and out[-1][0] == kind:
                    out[-1] = (kind, out[-1][1] + value)
                else:
                    out.append((kind, value))
    return out


def _chat_whole(body: dict[str, Any]) -> Blocks:
    message = body["choices"][0]["message"]
    calls = [("tool_calls", c["function"]["name"]) for c in message.get("tool_calls") or []]
    texts = [(k, message.get(k)) for k in ("reasoning_content", "content")]
    return [(k, v) for k, v in texts if v] + calls


def _message_blocks(content: list[dict[str, Any]]) -> Blocks:
    return [(b["type"], b.get("thinking", b.get("text", b.get("input")))) for b in content]


def _messages_stream(events: list[dict[str, Any]]) -> Blocks:
    blocks: list[dict[str, Any]] = []
    for event in events:
        if event["type"] == "content_block_start":
            blocks.append(dict(event["content_block"]))
        elif event["type"] == "content_block_delta":
            block, delta = blocks[event["index"]], event["delta"]
            if delta["type"] == "input_json_delta":
                block["input"] = json.loads(delta["partial_json"])
            else:
                key = delta["type"].removesuffix("_delta")
                block[key] += delta[key]
    return _message_blocks(blocks)


def _item_blocks(items: list[dict[str, Any]]) -> Blocks:
    return [
        (i["type"], i["content"][0]["text"] if i.get("content") else i.get("arguments"))
        for i in items
    ]


def _run(thinking: bool, chunks: list[str]) -> dict[str, tuple[Blocks, Blocks]]:
    """Each API's (streamed, whole) blocks for ``chunks``."""
    out = {}
    for api, shaper in _shapers(thinking).items():
        events = shaper.start()
        for chunk in chunks:
            events += shaper.feed(TextChunk(chunk, 1))
        events += shaper.finish(Finished("stop", 1, len(chunks)))
        whole = shaper.whole()
        if api == "chat":
            out[api] = (_chat_blocks(events), _chat_whole(whole))
        elif api == "messages":
            out[api] = (_messages_stream(events), _message_blocks(whole["content"]))
        else:
            done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
            out[api] = (_item_blocks(done), _item_blocks(whole["output"]))
    return out


EXPECTED = {
    True: {
        "messages": [
            ("thinking", "Plan it."),
            ("text", "Answer \ufffd"),
            ("thinking", "more"),
            ("text", "end. "),
            ("tool_use", {"x": 1}),
            ("text", " after."),
        ],
        "chat": [
            ("reasoning_content", "Plan it."),
            ("content", "Answer \ufffd"),
            ("reasoning_content", "more"),
            ("content", "end. "),
            ("tool_calls", "f"),
            ("content", " after."),
        ],
        "responses": ["reasoning", "message", "reasoning", "message", "function_call", "message"],
    },
    False: {  # thinking off: the markers are answer text like any other
        "messages": [
            ("text", "Answer \ufffd<think>more</think>end. "),
            ("tool_use", {"x": 1}),
            ("text", " after."),
        ],
        "chat": [
            ("content", "Answer \ufffd<think>more</think>end. "),
            ("tool_calls", "f"),
            ("content", " after."),
        ],
        "responses": ["message", "function_call", "message"],
    },
}


@pytest.mark.parametrize("thinking", [True, False])
def test_blocks_do_not_depend_on_chunking(thinking: bool) -> None:
    text = THINKING if thinking else NO_THINKING
    cuts = [[text[:i], text[i:]] for i in range(1, len(text))]
    want = _run(thinking, [text])
    for api, (streamed, whole) in want.items():
        expected = EXPECTED[thinking][api]
        kinds = [kind for kind, _ in streamed] if api == "responses" else streamed
        assert kinds == expected, (api, streamed)
        if api != "chat":  # a chat message keeps no order between its fields
            assert whole == streamed, api
    assert sorted(want["chat"][1]) == sorted(_merged(want["chat"][0]))
    for chunks in [*cuts, list(text)]:
        assert _run(thinking, chunks) == want, chunks


def _merged(blocks: Blocks) -> Blocks:
    """A chat stream's runs as the whole message holds them: one text per field."""
    texts: dict[str, str] = {}
    calls = []
    for kind, value in blocks:
        if kind == "tool_calls":
            calls.append((kind, value))
        else:
            texts[kind] = texts.get(kind, "") + value
    return list(texts.items()) + calls


# ----- the real server: token ids through the real detokenizer ------------------------------


@pytest.fixture(scope="module")
def served(tiny_hybrid_path: Path, draft_path: Path) -> Iterator[tuple[RunningServer, Any]]:
    script = ScriptedTokens([])
    app = make_app(
        tiny_hybrid_path, draft_path, generate=script, served_model_name="tiny", stream_interval=0
    )
    with run_server(app) as srv:
        yield srv, script


def _tokens(tokenizer: Any, *parts: str) -> list[int]:
    """Token ids: text parts encoded, ``<think>``/``</think>`` and the lone byte 0xC3 (the
    first half of "é", which no text around it completes) as single tokens."""
    specials = {"<think>", "</think>", "Ã"}  # "Ã": the byte-level alphabet's name for 0xC3
    ids: list[int] = []
    for part in parts:
        if part in specials:
            ids.append(tokenizer.convert_tokens_to_ids(part))
        else:
            ids += tokenizer.encode(part, add_special_tokens=False)
    return ids


@pytest.mark.parametrize("thinking", [True, False])
def test_streamed_and_whole_answers_match_on_every_api(
    served: tuple[RunningServer, Any], tiny_hybrid: Any, thinking: bool
) -> None:
    srv, script = served
    answer = ("Answer ", "Ã", "<think>", "more", "</think>", "end.")
    parts = ("Plan.", "</think>", "\n\n", *answer) if thinking else answer
    script.tokens = _tokens(tiny_hybrid[1], *parts)
    oai = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0)
    claude = anthropic.Anthropic(base_url=srv.base_url, api_key="x", max_retries=0)
    hello = [{"role": "user", "content": "Hi"}]
    kw: dict[str, Any] = {"model": "tiny", "max_tokens": 100, "messages": hello}
    effort = {"effort": "low" if thinking else "none"}
    budget = {"type": "enabled", "budget_tokens": 64} if thinking else {"type": "disabled"}

    # Streamed: one token per event. Whole: all of them in one commit.
    script.step, script.delay = 1, 0.005
    with claude.messages.stream(**kw, thinking=budget) as stream:
        streamed = stream.get_final_message()
    with oai.responses.stream(model="tiny", input="Hi", reasoning=effort) as stream:
        r_streamed = stream.get_final_response()
    chunks = oai.chat.completions.create(
        **kw, stream=True, extra_body={"enable_thinking": thinking}
    )
    c_streamed = _chat_blocks([c.model_dump() for c in chunks])
    script.step, script.delay = len(script.tokens), 0.0
    whole = claude.messages.create(**kw, thinking=budget)
    r_whole = oai.responses.create(model="tiny", input="Hi", reasoning=effort)
    c_whole = oai.chat.completions.create(**kw, extra_body={"enable_thinking": thinking})

    blocks = _message_blocks([b.model_dump() for b in whole.content])
    assert _message_blocks([b.model_dump() for b in streamed.content]) == blocks
    if thinking:  # the lone byte stays before the reasoning that follows it
        assert blocks == [
            ("thinking", "Plan."),
            ("text", "Answer \ufffd"),
            ("thinking", "more"),
            ("text", "end."),
        ]
    else:
        assert blocks == [("text", "Answer \ufffd<think>more</think>end.")]
    items = _item_blocks([i.model_dump() for i in r_whole.output])
    assert _item_blocks([i.model_dump() for i in r_streamed.output]) == items
    assert items == [("reasoning" if k == "thinking" else "message", v) for k, v in blocks]
    chat = [("reasoning_content" if k == "thinking" else "content", v) for k, v in blocks]
    assert c_streamed == chat
    assert sorted(_chat_whole(c_whole.model_dump())) == sorted(_merged(chat))
