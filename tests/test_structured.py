"""JSON-schema constrained decoding with llguidance: valid output, lossless under speculation."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import mlx.core as mx
import pytest

from dflash_server import stream_generate
from dflash_server.chat.structured import (
    GrammarConstraint,
    StructuredOutputError,
    check_grammar,
    response_format_grammar,
    tool_call_grammar,
)
from dflash_server.testing import ReplayDrafter, random_drafter

# Bounded (maxLength, maxItems, ranges) so a random model always finishes within max_tokens.
NAME = {"type": "string", "maxLength": 10}
SCHEMAS: list[dict[str, Any]] = [
    {  # nested objects + required
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": NAME,
                    "age": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["name", "age"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    {  # enums + arrays
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "sizes": {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 1, "maxItems": 3},
            "tags": {"type": "array", "items": NAME, "maxItems": 1},
        },
        "required": ["color", "sizes", "tags"],
        "additionalProperties": False,
    },
    {  # array at the top level, objects inside
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}, "label": NAME},
            "required": ["id", "label"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 2,
    },
]
PROMPT = "Answer in JSON:"
N = 256


def _grammar(schema: dict[str, Any]) -> str:
    return response_format_grammar(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    )


def _run(
    model: Any, tokenizer: Any, draft: Any, grammar: str, block: int = 16, **kw: Any
) -> tuple[list[int], str]:
    ids = tokenizer.encode(PROMPT)
    think_end = kw.pop("think_end", None)
    constraint = GrammarConstraint(tokenizer, grammar, think_end)
    out = list(
        stream_generate(
            model, draft, tokenizer, ids, block, max_tokens=N, constraint=constraint, **kw
        )
    )
    assert out[-1].finish_reason == "stop"  # the grammar ended it, not max_tokens
    return [t for r in out for t in r.tokens], "".join(r.text for r in out)


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_schema_output_validates_and_speculation_is_lossless(tiny_hybrid, index: int) -> None:
    model, tokenizer = tiny_hybrid
    schema = SCHEMAS[index]
    grammar = _grammar(schema)
    plain, text = _run(model, tokenizer, None, grammar)
    jsonschema.validate(json.loads(text), schema)
    ids = tokenizer.encode(PROMPT)
    replay = ReplayDrafter(ids + plain, [0, 15, 3, 7], random_drafter(model))
    spec, spec_text = _run(model, tokenizer, replay, grammar)
    assert spec == plain and spec_text == text
    if index == 0:  # a real (random) drafter too: its drafts are mostly outside the grammar
        assert _run(model, tokenizer, random_drafter(model), grammar, 4)[0] == plain


def test_sampled_output_validates(tiny_hybrid) -> None:
    model, tokenizer = tiny_hybrid
    for seed, schema in enumerate(SCHEMAS):
        _, text = _run(
            model, tokenizer, random_drafter(model), _grammar(schema), 4, temperature=0.9, seed=seed
        )
        jsonschema.validate(json.loads(text), schema)


def test_json_object_mode(tiny_attn) -> None:
    model, tokenizer = tiny_attn
    grammar = response_format_grammar({"type": "json_object"})
    ids = tokenizer.encode(PROMPT)
    constraint = GrammarConstraint(tokenizer, grammar)
    out = list(stream_generate(model, None, tokenizer, ids, max_tokens=60, constraint=constraint))
    text = "".join(r.text for r in out)
    # Unbounded free-form JSON may run out of tokens; whatever came must be a JSON prefix.
    if out[-1].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    assert text.lstrip().startswith("{")


def test_grammar_starts_after_reasoning(tiny_hybrid) -> None:
    """With thinking on, reasoning is free text; the schema applies after the think-end token."""
    model, tokenizer = tiny_hybrid
    end = tokenizer.think_end_id
    schema = SCHEMAS[1]
    # Bias the (otherwise never chosen) think-end token so that reasoning ends after a few
    # free tokens; the right bias depends on the random weights, so look for one.
    ids = tokenizer.encode(PROMPT)
    for bias in (1.5, 2.0, 1.0, 2.5, 3.0):
        free = [t for r in stream_generate(model, None, tokenizer, ids, max_tokens=16,
                                           logit_bias={end: bias}) for t in r.tokens]  # fmt: skip
        if end in free[1:]:
            break
    kw = {"think_end": end, "logit_bias": {end: bias}}
    plain, text = _run(model, tokenizer, None, _grammar(schema), **kw)
    assert end in plain and plain.index(end) > 0  # some free reasoning first
    assert plain[: plain.index(end)] == free[: free.index(end)]  # reasoning was not constrained
    _, answer = text.split("</think>")
    jsonschema.validate(json.loads(answer), schema)
    replay = ReplayDrafter(ids + plain, [2, 15, 0], random_drafter(model))
    assert _run(model, tokenizer, replay, _grammar(schema), **kw)[0] == plain


def test_masks_along_a_drafted_path(tiny_hybrid) -> None:
    _, tokenizer = tiny_hybrid
    constraint = GrammarConstraint(tokenizer, _grammar({"type": "boolean"}))
    true = tokenizer.encode("true")
    rows = constraint.allowed([*true, 10_000])  # an id past the vocabulary is simply refused
    assert rows.shape == (len(true) + 2, constraint.width)
    for i, token in enumerate(true):
        assert rows[i, token].item()
    eos = tokenizer.eos_token_ids
    assert all(rows[len(true), e].item() for e in eos)  # after "true": only the end
    assert rows[len(true)].sum().item() == len(eos)
    constraint.commit(true[:1])  # the committed state advanced; drafts left no trace
    assert constraint.allowed([])[0, true[1]].item()
    assert mx.array(constraint.rows) > 0


@pytest.mark.parametrize(
    ("schema", "feature"),
    [
        ({"not": {"type": "string"}}, "not"),
        ({"type": "string", "pattern": "(?<=a)b"}, "look-around"),
        ({"type": "string", "format": "weird"}, "weird"),
        ({"$ref": "#/$defs/missing"}, "missing"),
    ],
)
def test_unsupported_schema_names_the_feature(tiny_hybrid, schema: dict, feature: str) -> None:
    _, tokenizer = tiny_hybrid
    with pytest.raises(StructuredOutputError, match=feature):
        check_grammar(tokenizer, _grammar(schema))


def test_bad_response_formats() -> None:
    assert response_format_grammar({"type": "text"}) is None
    with pytest.raises(StructuredOutputError, match="grammar"):
        response_format_grammar({"type": "grammar"})
    with pytest.raises(StructuredOutputError, match="json_schema"):
        response_format_grammar({"type": "json_schema"})


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["C", "F"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "hourly": {"type": "boolean"},
            },
            "required": ["city", "days"],
        },
    },
}


def test_forced_tool_call_grammar(tiny_hybrid) -> None:
    """tool_choice: the grammar makes even a random model write a complete, typed call."""
    from dflash_server.chat.tool_calls import split_tool_calls

    model, tokenizer = tiny_hybrid
    grammar = tool_call_grammar(tokenizer, [WEATHER], ["get_weather"], parallel=False)
    check_grammar(tokenizer, grammar)
    plain, text = _run(model, tokenizer, None, grammar)
    content, calls = split_tool_calls(text, [WEATHER])
    assert content.strip() == "" and len(calls) == 1 and calls[0].name == "get_weather"
    args = json.loads(calls[0].arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    replay = ReplayDrafter(tokenizer.encode(PROMPT) + plain, [1, 15, 4], random_drafter(model))
    assert _run(model, tokenizer, replay, grammar)[0] == plain
