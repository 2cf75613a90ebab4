"""The Qwen3.5 XML tool-call parser: token-split input, several calls, typing, malformed calls."""

from __future__ import annotations

import json
import logging

import pytest

from dflash_server.chat.tool_calls import (
    ToolCall,
    ToolCallParser,
    coerce_value,
    split_tool_calls,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "ratio": {"type": "number"},
                    "hours": {"type": "array", "items": {"type": "integer"}},
                    "opts": {"type": "object"},
                    "note": {"type": ["string", "null"]},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}},
]

CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
    "<parameter=ratio>\n0.5\n</parameter>\n<parameter=hours>\n[1, 2]\n</parameter>\n"
    '<parameter=opts>\n{"a": {"b": null}}\n</parameter>\n<parameter=note>\nnull\n</parameter>\n'
    "</function>\n</tool_call>"
)
WANT = {
    "city": "New York",
    "days": 3,
    "metric": True,
    "ratio": 0.5,
    "hours": [1, 2],
    "opts": {"a": {"b": None}},
    "note": None,
}


def _run(pieces: list[str], parallel: bool = True) -> tuple[str, list[ToolCall]]:
    parser = ToolCallParser(TOOLS, parallel)
    out = []
    for piece in pieces:
        out += parser.feed(piece)
    out += parser.finish()
    text = "".join(p for p in out if isinstance(p, str))
    calls = [p for p in out if isinstance(p, ToolCall)]
    assert calls == parser.calls
    return text, calls


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_split_at_every_position(step: int) -> None:
    text = "Let me check.\n\n" + CALL + "\n" + CALL.replace("New York", "Paris") + "\n"
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    content, calls = _run(pieces)
    assert content == "Let me check.\n\n"
    assert [c.name for c in calls] == ["get_weather", "get_weather"]
    assert json.loads(calls[0].arguments) == WANT
    assert json.loads(calls[1].arguments)["city"] == "Paris"
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")


def test_streamed_text_never_contains_markup() -> None:
    parser = ToolCallParser(TOOLS)
    text = "ok <tool_" + "call>\n<function=noop>\n</function>\n</tool_call> done <tool"
    seen = []
    for ch in text:
        seen += [p for p in parser.feed(ch) if isinstance(p, str)]
        assert "<tool" not in "".join(seen)
    seen += [p for p in parser.finish() if isinstance(p, str)]
    assert "".join(seen) == "ok  done <tool"  # an unfinished tag prefix is released at the end
    assert parser.calls[0].arguments == "{}"


def test_values_typed_by_schema() -> None:
    assert coerce_value("42", {"type": "integer"}) == 42
    assert coerce_value("42", {"type": "string"}) == "42"
    assert coerce_value("4.0", {"type": "number"}) == 4.0
    assert coerce_value("False", {"type": "boolean"}) is False
    assert coerce_value("{'a': True}", {"type": "object"}) == {"a": True}  # Python literal
    assert coerce_value("x", {"anyOf": [{"type": "integer"}, {"type": "string"}]}) == "x"
    assert coerce_value("7", {"anyOf": [{"type": "integer"}, {"type": "string"}]}) == 7
    assert coerce_value("[1]", None) == [1] and coerce_value("hi there", None) == "hi there"
    assert coerce_value("abc", {"type": "integer"}) == "abc"  # left for the client to reject
    assert coerce_value("  two\nlines ", {"type": "string"}) == "  two\nlines "


def test_malformed_call_is_text_with_warning(caplog: pytest.LogCaptureFixture) -> None:
    bad = "<tool_call>\n<function=noop>\nstray words\n</function>\n</tool_call>"
    with caplog.at_level(logging.WARNING, logger="dflash_server"):
        content, calls = _run(["a ", bad, " b"])
    assert calls == [] and content == "a " + bad + " b"
    assert "malformed tool call" in caplog.text
    # Cut off by max_tokens: the unfinished call is dropped, never returned as markup.
    parser = ToolCallParser(TOOLS)
    pieces = parser.feed("x <tool_call>\n<function=noop>\n<parameter=a>\n1") + parser.finish(True)
    assert pieces == ["x "] and parser.calls == [] and parser.dropped == 1
    parser = ToolCallParser(TOOLS)
    assert parser.feed("y <tool_") + parser.finish(cut=True) == ["y "]  # a cut tag prefix too


def test_missing_close_tags_are_tolerated() -> None:
    # Stopped right after </function> (EOS instead of </tool_call>), and no </parameter>.
    text = "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</function>"
    content, calls = _run([text])
    assert content == "" and json.loads(calls[0].arguments) == {"days": 2}


def test_parallel_false_keeps_first_call() -> None:
    content, calls = _run([CALL, "\n", CALL], parallel=False)
    assert content == "" and len(calls) == 1


def test_whole_text_helper_and_unknown_tool() -> None:
    text, calls = split_tool_calls(
        "<tool_call>\n<function=other>\n<parameter=q>\nhi\n</parameter>\n</function>\n</tool_call>",
        TOOLS,
    )
    assert text == "" and calls[0].name == "other" and json.loads(calls[0].arguments) == {"q": "hi"}
    assert calls[0].as_openai(0)["function"]["name"] == "other"


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_stray_open_tag_stays_text_and_the_call_after_it_parses(step: int) -> None:
    """Reasoning that mentions ``<tool_call>`` (a model musing about the format) does not
    swallow the answer: the think-end marker or a second open tag shows the first was text."""
    small = CALL.replace("New York", "Oslo")
    cases = [
        # (model text, text pieces that must come out, calls)
        ("maybe <tool_call> now</think>\n\n" + small, "maybe <tool_call> now</think>\n\n", 1),
        ("a <tool_call> b " + small + " c", "a <tool_call> b  c", 1),
        ("x <tool_call> y</think>\n\nThe answer.", "x <tool_call> y</think>\n\nThe answer.", 0),
    ]
    for text, want, n in cases:
        content, calls = _run([text[i : i + step] for i in range(0, len(text), step)])
        assert content == want and len(calls) == n
        assert all(json.loads(c.arguments)["city"] == "Oslo" for c in calls)


def test_text_after_a_call_is_tracked() -> None:
    """``text_after_call``: whether anything but whitespace (or a cut call) followed the last
    complete call: a cut extra call alone leaves the answer whole (see ChatText.outcome)."""
    parser = ToolCallParser(TOOLS)
    parser.feed(CALL + "\n<tool_call>\n<function=get_weather>\n<parameter=ci")
    parser.finish(cut=True)
    assert len(parser.calls) == 1 and parser.dropped == 1 and not parser.text_after_call
    parser = ToolCallParser(TOOLS)
    parser.feed(CALL + "\nand then")
    parser.finish(cut=True)
    assert parser.text_after_call
