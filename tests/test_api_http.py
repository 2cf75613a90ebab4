"""Raw HTTP: SSE framing, keepalive, errors, auth, CORS, queueing and client disconnects."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from server_fixtures import (
    RunningServer,
    ScriptedGenerate,
    make_app,
    real_generate,
    run_server,
)

CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}


@pytest.fixture(scope="module")
def server(tiny_hybrid_path: Path, draft_path: Path) -> Iterator[RunningServer]:
    app = make_app(
        tiny_hybrid_path,
        draft_path,
        served_model_name="tiny",
        context_length=96,
        allowed_origins="http://ui.example",
    )
    with run_server(app) as srv:
        yield srv


def _sse(lines: Iterator[str]) -> list[str]:
    """Check the framing line by line and return the data payloads."""
    payloads: list[str] = []
    expect_blank = False
    for line in lines:
        if expect_blank:
            assert line == "", f"event not terminated by a blank line: {line!r}"
            expect_blank = False
        elif line.startswith(":"):
            continue  # keepalive comment
        elif line:
            assert line.startswith("data: "), line
            payloads.append(line[len("data: ") :])
            expect_blank = True
    return payloads


def _error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


# ----- SSE ---------------------------------------------------------------------------------


def test_chat_sse_framing(server: RunningServer) -> None:
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        payloads = _sse(r.iter_lines())
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:] if c["choices"])
    with_reason = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert with_reason == [chunks[-2]] and "dflash" in chunks[-2]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 8


def test_completion_sse_framing(server: RunningServer) -> None:
    body = {"prompt": "Hello", "max_tokens": 6, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body) as r:
        payloads = _sse(r.iter_lines())
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert "usage" not in chunks[-1]  # only with stream_options.include_usage


# ----- errors ------------------------------------------------------------------------------

INVALID = [
    ({"messages": []}, "messages"),
    ({"max_tokens": 4}, "messages"),
    ({**CHAT, "temperature": -1}, "temperature"),
    ({**CHAT, "top_p": 2}, "top_p"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "stop": ""}, "stop"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({**CHAT, "n": 3}, "n"),
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    (
        {
            **CHAT,
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"not": {}}}},
        },
        "response_format",
    ),
    ({**CHAT, "response_format": {"type": "grammar"}}, "response_format"),
    ({**CHAT, "tools": [{"type": "function"}]}, "tools.0"),
    (
        {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "g"},
        "tool_choice",
    ),
    ({**CHAT, "guided_json": {"type": "object"}}, "guided_json"),
    ({**CHAT, "block_size": 99}, "block_size"),
    ({**CHAT, "block_size": 1}, "block_size"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages.0.content",
    ),
]


@pytest.mark.parametrize(("body", "param"), INVALID)
def test_invalid_chat_requests(server: RunningServer, body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body)
    err = _error(r, 400, param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": "a", "echo": True}, "echo"),
        ({"prompt": "a", "best_of": 2}, "best_of"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [1, 10**9]}, "prompt"),
    ],
)
def test_invalid_completion_requests(
    server: RunningServer, body: dict[str, Any], param: str
) -> None:
    _error(httpx.post(f"{server.base_url}/v1/completions", json=body), 400, param)


def test_bad_json_unknown_model_and_routes(server: RunningServer) -> None:
    r = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    _error(r, 400)
    err = _error(
        httpx.post(f"{server.base_url}/v1/chat/completions", json={**CHAT, "model": "gpt-4"}),
        404,
        "model",
    )
    assert err["code"] == "model_not_found"
    _error(httpx.get(f"{server.base_url}/v1/nothing"), 404)


def test_prompt_longer_than_context(server: RunningServer) -> None:
    long = {"messages": [{"role": "user", "content": "word " * 200}], "stream": True}
    err = _error(httpx.post(f"{server.base_url}/v1/chat/completions", json=long), 400, "messages")
    assert err["code"] == "context_length_exceeded"
    # Output is capped to what fits: max_tokens beyond the context is clamped, not refused.
    r = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 10**6})
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] <= 96


def test_default_max_tokens_runs_to_context_limit(server: RunningServer) -> None:
    body = {"prompt": "The", "temperature": 0}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    usage = r.json()["usage"]
    assert r.json()["choices"][0]["finish_reason"] == "stop" or usage["total_tokens"] == 96


def test_health(server: RunningServer) -> None:
    body = httpx.get(f"{server.base_url}/health").json()
    assert body["status"] == "ready" and body["models"] == ["tiny"]
    assert body["queue_depth"] == 0 and body["block_size"] == 8 and body["context_length"] == 96
    assert body["batching"] == "batched" and body["active_rows"] == 0
    # What a request gets for the fields it leaves out (the chat page shows them).
    defaults = body["defaults"]
    assert defaults["temperature"] == 1.0 and defaults["enable_thinking"] is True
    assert defaults["max_tokens"] is None and defaults["block_size"] == "auto"
    assert defaults["speculative"] is True and {"top_p", "top_k", "min_p"} <= set(defaults)


def test_head_of_the_chat_page(server: RunningServer) -> None:
    """HEAD / answers as GET / does (uptime checks use it), without the body."""
    get, head = httpx.get(f"{server.base_url}/"), httpx.head(f"{server.base_url}/")
    assert head.status_code == get.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]
    assert head.headers["content-length"] == str(len(get.content))


def test_cors(server: RunningServer) -> None:
    pre = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type",
    }
    ok = httpx.options(
        f"{server.base_url}/v1/chat/completions", headers={"Origin": "http://ui.example", **pre}
    )
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "http://ui.example"
    bad = httpx.options(
        f"{server.base_url}/v1/chat/completions", headers={"Origin": "http://evil.example", **pre}
    )
    assert "access-control-allow-origin" not in bad.headers


# ----- auth --------------------------------------------------------------------------------


def test_api_key(tiny_hybrid_path: Path, draft_path: Path) -> None:
    app = make_app(tiny_hybrid_path, draft_path, api_key="sekret", served_model_name="tiny")
    with run_server(app) as srv:
        url = f"{srv.base_url}/v1/chat/completions"
        err = _error(httpx.post(url, json=CHAT), 401)
        assert err["code"] == "invalid_api_key"
        _error(httpx.post(url, json=CHAT, headers={"Authorization": "Bearer nope"}), 401)
        _error(httpx.get(f"{srv.base_url}/v1/models"), 401)
        # Auth is checked before the body: a bad body without a key is still a 401.
        _error(httpx.post(url, json={"messages": []}), 401)
        ok = httpx.post(url, json=CHAT, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        assert httpx.get(f"{srv.base_url}/health").status_code == 200  # probes need no key
        good = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="sekret", max_retries=0)
        assert good.models.list().data[0].id == "tiny"
        wrong = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()


# ----- scripted generation: reasoning split, keepalive, queueing, disconnects ---------------


def _stream_deltas(base: str, body: dict[str, Any]) -> tuple[str, str, list[str]]:
    reasoning, content = "", ""
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=30) as r:
        lines = list(r.iter_lines())
    for p in _sse(iter(lines)):
        if p == "[DONE]":
            break
        for choice in json.loads(p)["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning_content") or ""
            assert delta.get("reasoning") == delta.get("reasoning_content")
    return reasoning, content, lines


@pytest.mark.parametrize(
    ("thinking", "pieces", "reasoning", "content"),
    [
        (True, ["Let me th", "ink.\n</th", "ink>\n", "\nParis", "."], "Let me think.\n", "Paris."),
        # Thinking off: a <think> the model writes anyway is answer text, never reasoning.
        (False, ["<thi", "nk>\nhmm</think>", "\n\nParis."], "", "<think>\nhmm</think>\n\nParis."),
        (False, ["Par", "is", "."], "", "Paris."),
    ],
)
def test_reasoning_split_over_http(
    tiny_hybrid_path: Path,
    draft_path: Path,
    thinking: bool,
    pieces: list[str],
    reasoning: str,
    content: str,
) -> None:
    gen = ScriptedGenerate(pieces)
    app = make_app(tiny_hybrid_path, draft_path, generate=gen, enable_thinking=not thinking)
    with run_server(app) as srv:
        # The request's own setting beats the server default (set to the opposite here).
        body = {**CHAT, "stream": True, "chat_template_kwargs": {"enable_thinking": thinking}}
        got_r, got_c, _ = _stream_deltas(srv.base_url, body)
        assert (got_r, got_c) == (reasoning, content)
        body = {**CHAT, "enable_thinking": thinking}
        msg = httpx.post(f"{srv.base_url}/v1/chat/completions", json=body).json()
        message = msg["choices"][0]["message"]
        assert message["content"] == content
        assert message.get("reasoning_content", "") == reasoning
        assert message.get("reasoning", "") == reasoning


def test_keepalive_during_long_prefill(tiny_hybrid_path: Path, draft_path: Path) -> None:
    gen = ScriptedGenerate(["done"], first_delay=1.0)
    app = make_app(tiny_hybrid_path, draft_path, generate=gen, keepalive=0.2)
    with run_server(app) as srv:
        body = {**CHAT, "stream": True, "enable_thinking": False}
        _, content, lines = _stream_deltas(srv.base_url, body)
    assert content == "done"
    assert sum(line.startswith(": ping") for line in lines) >= 2


def test_fast_tokens_are_batched_into_fewer_events(
    tiny_hybrid_path: Path, draft_path: Path
) -> None:
    gen = ScriptedGenerate(["a"] * 200, delay=0.002)
    app = make_app(tiny_hybrid_path, draft_path, generate=gen, stream_interval=0.05)
    with run_server(app) as srv:
        body = {**CHAT, "stream": True, "max_tokens": 200, "enable_thinking": False}
        _, content, lines = _stream_deltas(srv.base_url, body)
    assert content == "a" * 200
    assert sum(line.startswith("data: ") for line in lines) < 40  # ~0.4 s / 0.05 s, not 200


def _open_stream(client: httpx.Client, base: str, body: dict[str, Any]) -> Any:
    ctx = client.stream("POST", f"{base}/v1/chat/completions", json=body)
    response = ctx.__enter__()
    assert response.status_code == 200
    return ctx, response.iter_lines()


def _wait(cond: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_queue_full_is_429_and_disconnect_frees_the_worker(
    tiny_hybrid_path: Path, draft_path: Path
) -> None:
    gen = ScriptedGenerate(["tok "] * 400, delay=0.02)
    app = make_app(
        tiny_hybrid_path, draft_path, generate=gen, max_queue=1, max_active=1, enable_thinking=False
    )
    with run_server(app) as srv:
        engine = srv.engine
        body = {**CHAT, "max_tokens": 400, "stream": True}
        with httpx.Client(timeout=30) as c1, httpx.Client(timeout=30) as c2:
            ctx1, lines1 = _open_stream(c1, srv.base_url, body)
            next(lines1), next(lines1), next(lines1)  # role chunk, blank, first text
            ctx2, _ = _open_stream(c2, srv.base_url, body)  # waits in the queue
            _wait(lambda: engine.queue_depth == 2)
            full = httpx.post(f"{srv.base_url}/v1/chat/completions", json=body)
            err = _error(full, 429)
            assert err["code"] == "queue_full" and int(full.headers["retry-after"]) >= 1
            assert httpx.get(f"{srv.base_url}/health").json()["queue_depth"] == 2
            ctx1.__exit__(None, None, None)  # running client disconnects
            ctx2.__exit__(None, None, None)  # queued client disconnects
        _wait(lambda: engine.queue_depth == 0)
        assert gen.finished == 0 and gen.closed_early >= 1
        # The worker is free: the next request is served to the end.
        r = httpx.post(f"{srv.base_url}/v1/chat/completions", json={**CHAT, "max_tokens": 3})
        assert (
            r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "tok tok tok "
        )


def test_non_stream_disconnect_cancels(tiny_hybrid_path: Path, draft_path: Path) -> None:
    gen = ScriptedGenerate(["x"] * 400, delay=0.02)
    app = make_app(tiny_hybrid_path, draft_path, generate=gen)
    with run_server(app) as srv:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{srv.base_url}/v1/chat/completions",
                json={**CHAT, "max_tokens": 400},
                timeout=httpx.Timeout(30, read=0.5),
            )
        _wait(lambda: srv.engine.queue_depth == 0)
        assert gen.closed_early == 1 and gen.finished == 0


def test_real_generation_disconnect_frees_worker(tiny_hybrid_path: Path, draft_path: Path) -> None:
    """Same, through the real DFlash loop (slowed down so the client can leave mid-way)."""
    produced: list[int] = []

    def slow_real(*args: Any, **kwargs: Any) -> Iterator[Any]:
        for response in real_generate(*args, **kwargs):
            produced.append(len(response.tokens))
            time.sleep(0.05)
            yield response

    app = make_app(tiny_hybrid_path, draft_path, generate=slow_real, temperature=0.0)
    with run_server(app) as srv:
        with httpx.Client(timeout=30) as c:
            ctx, lines = _open_stream(c, srv.base_url, {**CHAT, "max_tokens": 2000, "stream": True})
            next(lines), next(lines), next(lines)
            ctx.__exit__(None, None, None)
        _wait(lambda: srv.engine.queue_depth == 0)
        stopped_at = sum(produced)
        assert stopped_at < 2000
        r = httpx.post(f"{srv.base_url}/v1/chat/completions", json={**CHAT, "max_tokens": 4})
        assert r.status_code == 200
        time.sleep(0.2)
        assert sum(produced) <= stopped_at + 4  # the abandoned request did not resume


def test_loading_state_is_503(tiny_hybrid_path: Path, draft_path: Path) -> None:
    from dflash_server.api.app import create_app
    from dflash_server.engine.worker import Engine
    from dflash_server.settings import Settings

    release = threading.Event()

    def loader() -> Any:
        release.wait(30)
        raise RuntimeError("never loads")

    settings = Settings.load(target=str(tiny_hybrid_path), draft=str(draft_path))
    app = create_app(settings, Engine(loader))
    import uvicorn

    from server_fixtures import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: _reachable(base))
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        err = _error(httpx.post(f"{base}/v1/chat/completions", json=CHAT), 503)
        assert err["code"] == "model_not_ready"
        release.set()
        _wait(lambda: httpx.get(f"{base}/health").json()["status"] == "error")
        assert "never loads" in httpx.get(f"{base}/health").json()["error"]
    finally:
        release.set()
        server.should_exit = True
        thread.join(10)


def _reachable(base: str) -> bool:
    try:
        httpx.get(f"{base}/health", timeout=1)
        return True
    except httpx.TransportError:
        return False


@pytest.mark.parametrize("batching", ["batched", "interleave"])
def test_dflash_tokens_stream_extension(
    tiny_hybrid_path: Path, draft_path: Path, batching: str
) -> None:
    """Opt-in per-token sources: together the raw output, drafts only where a cycle accepted."""
    import json

    app = make_app(tiny_hybrid_path, draft_path, temperature=0.0, batching=batching)
    body = {**CHAT, "stream": True, "max_tokens": 24, "dflash_tokens": True}
    body["stream_options"] = {"include_usage": True}
    with run_server(app) as srv:
        runs = []
        for _ in range(2):  # the second answer can copy the first (the shared suffix index)
            with httpx.stream("POST", f"{srv.base_url}/v1/chat/completions", json=body) as r:
                runs.append(
                    [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
                )
        plain = httpx.post(
            f"{srv.base_url}/v1/completions",
            json={
                "prompt": "hello",
                "max_tokens": 8,
                "stream": True,
                "speculative": False,
                "dflash_tokens": True,
            },
        )
    for chunks in runs:
        tokens = [t for c in chunks for t in c.get("dflash_tokens", [])]
        assert len(tokens) == chunks[-1]["usage"]["completion_tokens"]
        assert {t["source"] for t in tokens} <= {"draft", "suffix", "target"}
        stats = next(c["dflash"] for c in chunks if "dflash" in c)
        assert sum(t["source"] != "target" for t in tokens) == stats["accepted"]
        copied = sum(t["source"] == "suffix" for t in tokens)
        assert copied <= stats["sources"]["suffix"]["tokens"]
    assert copied > 0  # the second answer copied the first
    lines = [json.loads(ln[6:]) for ln in plain.text.splitlines() if ln.startswith("data: {")]
    plain_tokens = [t for c in lines for t in c.get("dflash_tokens", [])]
    assert plain_tokens and all(t["source"] == "target" for t in plain_tokens)
    without = {**body, "dflash_tokens": False}
    with run_server(make_app(tiny_hybrid_path, draft_path, temperature=0.0)) as srv:
        r = httpx.post(f"{srv.base_url}/v1/chat/completions", json=without)
    assert "dflash_tokens" not in r.text
