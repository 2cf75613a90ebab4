"""Forced tool calls and schemas with thinking on, on the three endpoints through the SDKs.

The tiny random model reasons in noise: it writes end tokens, stray ``<tool_call>`` tags and
control tokens while reasoning. A forced call must still come back as one parsed, complete call
(or the answer says max_tokens cut it), markup never in the text, control tokens never in it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from server_fixtures import ScriptedGenerate, make_app, run_server

CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": CITY}]
MESSAGES_TOOLS = [{"name": "get_weather", "input_schema": CITY}]
QUESTION = "What is the weather in Paris?"
MARKUP = ("<tool_call>", "</tool_call>", "<function", "<parameter", "</think>")
CONTROL = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
SEEDS = range(12)


@pytest.fixture(scope="module")
def base_url(tiny_hybrid_path: Path, draft_path: Path) -> Iterator[str]:
    app = make_app(tiny_hybrid_path, draft_path, served_model_name="tiny")
    with run_server(app) as srv:
        yield srv.base_url


def faults_of(*answers: Callable[[int], str | None]) -> dict[str, str]:
    """What each answer got wrong (``answer(seed)``: None when right) for every seed, by
    ``answer seed``. The requests are sent at once: the server runs them as rows of batched
    passes, each answer the one it has alone, in a fraction of the time of one at a time."""
    runs = [(answer, seed) for answer in answers for seed in SEEDS]
    with ThreadPoolExecutor(len(runs)) as pool:
        found = list(pool.map(lambda run: run[0](run[1]), runs))
    return {f"{a.__name__} {seed}": f for (a, seed), f in zip(runs, found) if f is not None}


@pytest.fixture(scope="module")
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def claude(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="x", max_retries=0)


def _chat_fault(r: Any) -> str | None:
    """Why a forced chat answer is bad (None: a complete call, finish_reason tool_calls)."""
    choice = r.choices[0]
    message = choice.message
    text = (message.content or "") + (message.model_extra.get("reasoning_content") or "")
    if choice.finish_reason != "tool_calls" or not message.tool_calls:
        return f"finish_reason {choice.finish_reason}, calls {message.tool_calls}"
    if any(m in (message.content or "") for m in MARKUP) or any(c in text for c in CONTROL):
        return f"markup in the text: {text[-80:]!r}"
    jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), CITY)
    return None


@pytest.mark.slow
def test_required_call_on_chat_for_every_seed(oai: openai.OpenAI) -> None:
    def chat(seed: int) -> str | None:
        r = oai.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": QUESTION}],
            tools=CHAT_TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=200,
            seed=seed,
        )
        return _chat_fault(r)

    faults = faults_of(chat)
    assert faults == {}, f"{len(faults)} of {len(SEEDS)} seeds bad: {faults}"


@pytest.mark.slow
def test_required_call_on_responses_for_every_seed(oai: openai.OpenAI) -> None:
    def responses(seed: int) -> str | None:
        r = oai.responses.create(
            model="tiny",
            input=QUESTION,
            tools=RESPONSES_TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=200,
            reasoning={"effort": "low"},
            extra_body={"seed": seed},
        )
        calls = [item for item in r.output if item.type == "function_call"]
        text = r.output_text + "".join(
            part.text
            for item in r.output
            if item.type == "reasoning"
            for part in item.content or []
        )
        if r.status != "completed" or len(calls) != 1:
            return f"status {r.status}, {len(calls)} calls"
        if any(m in r.output_text for m in MARKUP) or any(c in text for c in CONTROL):
            return f"markup in the text: {text[-80:]!r}"
        jsonschema.validate(json.loads(calls[0].arguments), CITY)
        return None

    faults = faults_of(responses)
    assert faults == {}, f"{len(faults)} of {len(SEEDS)} seeds bad: {faults}"


@pytest.mark.slow
def test_any_tool_on_messages_for_every_seed(claude: anthropic.Anthropic) -> None:
    def messages(seed: int) -> str | None:
        r = claude.messages.create(
            model="tiny",
            max_tokens=200,
            messages=[{"role": "user", "content": QUESTION}],
            tools=MESSAGES_TOOLS,
            tool_choice={"type": "any"},
            thinking={"type": "enabled", "budget_tokens": 64},
            extra_body={"seed": seed},
        )
        uses = [b for b in r.content if b.type == "tool_use"]
        texts = "".join(b.text for b in r.content if b.type == "text")
        thinking = "".join(b.thinking for b in r.content if b.type == "thinking")
        if r.stop_reason != "tool_use" or not uses:
            return f"stop_reason {r.stop_reason}, blocks {[b.type for b in r.content]}"
        if any(m in texts for m in MARKUP) or any(c in texts + thinking for c in CONTROL):
            return f"markup in the text: {(texts + thinking)[-80:]!r}"
        jsonschema.validate(uses[0].input, CITY)
        return None

    faults = faults_of(messages)
    assert faults == {}, f"{len(faults)} of {len(SEEDS)} seeds bad: {faults}"


@pytest.mark.slow
def test_named_call_sampled_with_low_effort(
    oai: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    """An end token sampled while reasoning does not end a forced answer: a complete call
    comes back, else max_tokens cut it (finish_reason length, never stop)."""

    def chat(seed: int) -> str | None:
        r = oai.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": QUESTION}],
            tools=CHAT_TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=300,
            temperature=1.0,
            seed=seed,
            reasoning_effort="low",
        )
        return None if r.choices[0].finish_reason == "length" else _chat_fault(r)

    def messages(seed: int) -> str | None:
        m = claude.messages.create(
            model="tiny",
            max_tokens=300,
            messages=[{"role": "user", "content": QUESTION}],
            tools=MESSAGES_TOOLS,
            tool_choice={"type": "tool", "name": "get_weather"},
            thinking={"type": "enabled", "budget_tokens": 64},
            extra_body={"seed": seed, "temperature": 1.0},
        )
        called = any(b.type == "tool_use" for b in m.content)
        if m.stop_reason != "max_tokens" and not (m.stop_reason == "tool_use" and called):
            return f"stop_reason {m.stop_reason}"
        return None

    faults = faults_of(chat, messages)
    assert faults == {}, f"{len(faults)} of {2 * len(SEEDS)} answers bad: {faults}"


@pytest.mark.slow
def test_schema_with_thinking_is_always_reached(oai: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}

    def chat(seed: int) -> str | None:
        r = oai.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": QUESTION}],
            response_format=fmt,
            max_tokens=300,
            temperature=1.0,
            seed=seed,
            reasoning_effort="low",
        )
        choice = r.choices[0]
        if choice.finish_reason == "stop":
            try:
                jsonschema.validate(json.loads(choice.message.content), schema)
            except ValueError as exc:
                return f"{exc}: {choice.message.content!r}"
        elif choice.finish_reason != "length":
            return f"finish_reason {choice.finish_reason}"
        return None

    faults = faults_of(chat)
    assert faults == {}, f"{len(faults)} of {len(SEEDS)} seeds bad: {faults}"


def test_control_tokens_left_out_of_text(oai: openai.OpenAI) -> None:
    """The random model writes control tokens now and then: never in the text, still in the
    logprobs; ``skip_special_tokens: false`` keeps them in the text."""
    kw: dict[str, Any] = {"max_tokens": 200, "logprobs": True}
    messages = [{"role": "user", "content": QUESTION}]
    for seed in SEEDS:  # the first answer with a control token
        r = oai.chat.completions.create(model="tiny", messages=messages, seed=seed, **kw)
        tokens = [e.token for e in r.choices[0].logprobs.content]
        if set(CONTROL) & set(tokens):
            break
    else:
        pytest.fail("no seed made the tiny model write a control token")
    message = r.choices[0].message
    text = (message.content or "") + message.model_extra.get("reasoning_content", "")
    assert not any(c in text for c in CONTROL)
    body = {"skip_special_tokens": False}
    raw = oai.chat.completions.create(
        model="tiny", messages=messages, seed=seed, extra_body=body, **kw
    )
    assert [e.token for e in raw.choices[0].logprobs.content] == tokens
    message = raw.choices[0].message
    raw_text = (message.content or "") + message.model_extra.get("reasoning_content", "")
    assert any(c in raw_text for c in CONTROL)


# ----- a complete call, then one that max_tokens cuts: scripted output -----------------------


def _call(city: str) -> str:
    return f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n</function>\n</tool_call>"


@pytest.fixture(scope="module")
def scripted(tiny_hybrid_path: Path, draft_path: Path) -> Iterator[tuple[str, ScriptedGenerate]]:
    script = ScriptedGenerate([])
    app = make_app(tiny_hybrid_path, draft_path, generate=script, served_model_name="tiny")
    with run_server(app) as srv:
        yield srv.base_url, script


@pytest.mark.parametrize("after", ["\n" + _call("Rome")[:30], "\nAnd then I will"])
def test_cut_extra_call_leaves_a_whole_answer(
    scripted: tuple[str, ScriptedGenerate], after: str
) -> None:
    """Only an extra call cut: the answer is whole on each endpoint (the cut call dropped);
    text cut after the call: the answer says max_tokens cut it."""
    url, script = scripted
    script.pieces = ["done</think>\n\n", _call("Paris"), *after]  # the rest 1 character a piece
    cut_call = after.startswith("\n<tool_call>")
    n = len(script.pieces)
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    r = oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": QUESTION}],
        tools=CHAT_TOOLS,
        tool_choice="required",
        max_tokens=n,
    )
    assert r.choices[0].finish_reason == ("tool_calls" if cut_call else "length")
    assert [c.function.arguments for c in r.choices[0].message.tool_calls] == ['{"city": "Paris"}']
    resp = oai.responses.create(
        model="tiny", input=QUESTION, tools=RESPONSES_TOOLS, tool_choice="required",
        max_output_tokens=n,
    )  # fmt: skip
    assert resp.status == ("completed" if cut_call else "incomplete")
    assert [i.arguments for i in resp.output if i.type == "function_call"] == ['{"city": "Paris"}']
    if cut_call:
        assert resp.model_extra["dflash"]["dropped_tool_calls"] == 1
    claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    m = claude.messages.create(
        model="tiny",
        max_tokens=n,
        messages=[{"role": "user", "content": QUESTION}],
        tools=MESSAGES_TOOLS,
        tool_choice={"type": "any"},
    )
    assert m.stop_reason == ("tool_use" if cut_call else "max_tokens")
    assert [b.input for b in m.content if b.type == "tool_use"] == [{"city": "Paris"}]


def test_forced_answer_counts_only_the_answers_call(
    scripted: tuple[str, ScriptedGenerate],
) -> None:
    """Under a forced call the grammar writes the answer: a call the model wrote while still
    reasoning stays reasoning text, the answer's call is the one returned."""
    url, script = scripted
    script.pieces = [*f"musing {_call('Rome')} and <tool_call> more</think>\n\n", _call("Paris")]
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    for stream in (False, True):
        r = oai.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": QUESTION}],
            tools=CHAT_TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            parallel_tool_calls=False,
            stream=stream,
        )
        if stream:
            chunks = [c.choices[0] for c in r if c.choices]
            reasoning = "".join(
                (c.delta.model_extra or {}).get("reasoning_content") or "" for c in chunks
            )
            content = "".join(c.delta.content or "" for c in chunks)
            calls = [tc.function.arguments for c in chunks for tc in c.delta.tool_calls or []]
            finish = chunks[-1].finish_reason
        else:
            message = r.choices[0].message
            reasoning, content = message.model_extra["reasoning_content"], message.content or ""
            calls = [tc.function.arguments for tc in message.tool_calls]
            finish = r.choices[0].finish_reason
        assert finish == "tool_calls" and calls == ['{"city": "Paris"}'] and content == ""
        assert reasoning == f"musing {_call('Rome')} and <tool_call> more"
