"""The server driven by the official ``openai`` SDK, on real (tiny, random) models."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import mlx_lm
import openai
import pytest

from dflash_server import load_draft, stream_generate
from dflash_server.chat.reasoning import split_reasoning
from server_fixtures import RunningServer, make_app, run_server

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def server(tiny_hybrid_path: Path, draft_path: Path) -> Iterator[RunningServer]:
    app = make_app(tiny_hybrid_path, draft_path, served_model_name="tiny", temperature=0.0)
    with run_server(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    # A timeout well under the SDK's 10 minutes: a runaway generation fails the test quickly.
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def python_api(tiny_hybrid_path: Path, draft_path: Path) -> tuple[Any, Any, Any]:
    """A separate copy of the same models, for the in-process Python API."""
    model, tokenizer = mlx_lm.load(str(tiny_hybrid_path))
    draft = load_draft(str(draft_path))
    draft.bind(model)
    return model, tokenizer, draft


def _python_text(api: tuple[Any, Any, Any], prompt: str, **kw: Any) -> tuple[str, int]:
    model, tokenizer, draft = api
    responses = list(stream_generate(model, draft, tokenizer, prompt, **kw))
    return "".join(r.text for r in responses), responses[-1].generation_tokens


def test_models_lists_only_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_chat_non_stream(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == "tiny"
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    stats = r.model_extra["dflash"]
    assert stats["speculative"] is True and stats["block_size"] == 8
    assert stats["cycles"] >= 1 and stats["tau"] >= 1.0 and stats["generation_tps"] > 0


def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_completion_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["dflash"]["speculative"] is True
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 10
    assert len({c.id for c in chunks}) == 1


def test_completions_stream_and_not(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=8)
    assert r.object == "text_completion" and r.usage.completion_tokens <= 8
    parts = list(
        client.completions.create(
            model="tiny", prompt="The quick brown fox", max_tokens=8, stream=True
        )
    )
    assert "".join(p.choices[0].text for p in parts) == r.choices[0].text  # greedy
    assert parts[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_greedy_http_equals_python_api(client: openai.OpenAI, python_api: Any) -> None:
    prompt = "def fibonacci(n: int) -> int:\n"
    want, n = _python_text(python_api, prompt, max_tokens=40, temperature=0.0)
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0)
    assert got.choices[0].text == want and got.usage.completion_tokens == n
    # Plain decoding and a smaller block give the same greedy text (speculation is lossless).
    for extra in ({"speculative": False}, {"block_size": 3}):
        again = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=40, temperature=0, extra_body=extra
        )
        assert again.choices[0].text == want
        assert again.model_extra["dflash"]["speculative"] is ("speculative" not in extra)


@pytest.mark.parametrize("thinking", [True, False])
def test_chat_matches_python_api_and_splits_reasoning(
    client: openai.OpenAI, python_api: Any, thinking: bool
) -> None:
    _, tokenizer, _ = python_api
    prompt = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False, enable_thinking=thinking
    )
    want, _ = _python_text(python_api, prompt, max_tokens=48, temperature=0.0)
    reasoning, content = split_reasoning(want, in_reasoning=thinking)
    r = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=48,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": thinking}},
    )
    msg = r.choices[0].message
    assert msg.content == content
    assert (msg.model_extra.get("reasoning_content") or "") == reasoning
    assert (msg.model_extra.get("reasoning") or "") == reasoning
    assert "<think>" not in msg.content and "</think>" not in msg.content
    if not thinking and "<think>" not in want:
        assert reasoning == "" and msg.model_extra.get("reasoning_content") is None
    # Streaming the same request yields the same split.
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=48,
        temperature=0,
        stream=True,
        extra_body={"enable_thinking": thinking},
    )
    s_reason, s_content = "", ""
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            s_content += delta.content or ""
            s_reason += (delta.model_extra or {}).get("reasoning_content") or ""
    assert (s_reason, s_content) == (reasoning, content)


def test_sampling_params_and_seed_are_reproducible(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(
        model="tiny",
        prompt="Hello, world!",
        max_tokens=16,
        temperature=0.9,
        top_p=0.9,
        seed=1234,
        presence_penalty=0.5,
        frequency_penalty=0.2,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text


def test_stop_strings(client: openai.OpenAI, python_api: Any) -> None:
    prompt = "The weather is nice today"
    full, _ = _python_text(python_api, prompt, max_tokens=30, temperature=0.0)
    stop = full[5:7] if len(full) > 8 else None
    if not stop or not stop.strip():
        pytest.skip("random model produced too little text to cut")
    r = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=30, temperature=0, stop=[stop]
    )
    text = r.choices[0].text
    assert stop not in text and full.startswith(text) and r.choices[0].finish_reason == "stop"
    r2 = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=30, temperature=0, stop=stop
    )
    assert r2.choices[0].text == text


def test_sdk_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="nope", messages=MESSAGES)
    assert nf.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny", messages=MESSAGES, n=2)
    assert bad.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        )
    assert bad.value.body["param"] == "tool_choice"


def test_all_message_kinds_render(server: RunningServer) -> None:
    """system/developer/user/assistant/tool messages, text parts, history with reasoning."""
    messages = [
        {"role": "developer", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Weather "},
                {"type": "text", "text": "in Paris?"},
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "I should call the tool.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "Thanks!"},
    ]
    r = httpx.post(
        f"{server.base_url}/v1/chat/completions", json={"messages": messages, "max_tokens": 2}
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 40
