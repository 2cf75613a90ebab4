"""Top-level fields the server does not act on: named in ``x-dflash-ignored-fields`` and the
log, never silently dropped; a near miss of an implemented field (a typo) is a 400 saying
which field was meant. Every field the official SDKs define, and what other servers' clients
send, is accepted."""

from __future__ import annotations

import logging
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import anthropic
import httpx
import openai
import pytest

from dflash_server.api.anthropic import CountTokensRequest, MessagesRequest
from dflash_server.api.fields import (
    CHAT_SPEC,
    COMPLETION_SPEC,
    MAX_HEADER_CHARS,
    MESSAGES_SPEC,
    RESPONSES_SPEC,
    header_names,
    near_miss,
)
from dflash_server.api.openai_responses import PASSED_ON, ResponsesRequest
from dflash_server.api.types import ChatCompletionRequest, CompletionRequest, extensions
from server_fixtures import RunningServer, ScriptedGenerate, make_app, run_server

HEADER = "x-dflash-ignored-fields"
OMITTED = "x-dflash-ignored-fields-omitted"
HI = [{"role": "user", "content": "Hi"}]


def _implemented(model: type[Any], *passed_on: str) -> set[str]:
    return {*model.model_fields, *passed_on}


PROTOCOLS = {
    "chat": (_implemented(ChatCompletionRequest), CHAT_SPEC),
    "completions": (_implemented(CompletionRequest), COMPLETION_SPEC),
    "messages": (_implemented(MessagesRequest, *extensions(MessagesRequest)), MESSAGES_SPEC),
    "count_tokens": (
        _implemented(CountTokensRequest, *extensions(CountTokensRequest)),
        MESSAGES_SPEC,
    ),
    "responses": (_implemented(ResponsesRequest, *PASSED_ON), RESPONSES_SPEC),
}


@pytest.mark.parametrize(
    ("name", "protocol", "meant"),
    [
        ("max_token", "chat", "max_tokens"),
        ("maxTokens", "chat", "max_tokens"),
        ("temprature", "chat", "temperature"),
        ("temperatrue", "completions", "temperature"),
        ("topK", "chat", "top_k"),
        ("stop_sequence", "messages", "stop_sequences"),
        ("max_output_token", "responses", "max_output_tokens"),
        ("block-size", "responses", "block_size"),
        ("skip_special_token", "chat", "skip_special_tokens"),
    ],
)
def test_typos_name_the_field_meant(name: str, protocol: str, meant: str) -> None:
    assert near_miss(name, PROTOCOLS[protocol][0]) == meant


# What other servers and clients send to an OpenAI-compatible server on purpose: vLLM,
# llama.cpp, Ollama options (Open WebUI passes them on), OpenRouter, TGI, Anthropic's betas.
OTHERS = [
    *("min_tokens", "use_beam_search", "length_penalty", "stop_token_ids", "ignore_eos"),
    *("include_stop_str_in_output", "add_generation_prompt", "chat_template", "priority"),
    *("continue_final_message", "truncate_prompt_tokens", "prompt_logprobs", "top_n_sigma"),
    *("n_predict", "typical_p", "tfs_z", "mirostat", "mirostat_eta", "mirostat_tau"),
    *("repeat_penalty", "repeat_last_n", "penalize_nl", "n_probs", "cache_prompt", "samplers"),
    *("num_ctx", "num_predict", "num_keep", "num_batch", "keep_alive", "think", "use_mmap"),
    *("top_a", "models", "route", "provider", "transforms", "reasoning", "include_reasoning"),
    *("usage", "max_new_tokens", "do_sample", "watermark", "return_full_text", "foo_bar"),
]


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_sdk_fields_and_other_servers_fields_are_never_typos(protocol: str) -> None:
    from anthropic.types import message_count_tokens_params, message_create_params
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_params
    from openai.types.responses import response_create_params

    sdk = {
        "chat": chat_params.CompletionCreateParamsBase,
        "completions": completion_create_params.CompletionCreateParamsBase,
        "messages": message_create_params.MessageCreateParamsBase,
        "count_tokens": message_count_tokens_params.MessageCountTokensParams,
        "responses": response_create_params.ResponseCreateParamsBase,
    }[protocol]
    implemented, spec = PROTOCOLS[protocol]
    for name in set(typing.get_type_hints(sdk)) - implemented:
        assert name in spec, f"{protocol}: the SDK's {name!r} is not listed"
    for name in OTHERS:
        assert name in implemented or near_miss(name, implemented) is None, (protocol, name)


# ----- over HTTP ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def script() -> ScriptedGenerate:
    return ScriptedGenerate(["</think>\n\n", "Hi."])


@pytest.fixture(scope="module")
def served(
    tiny_hybrid_path: Path, draft_path: Path, script: ScriptedGenerate
) -> Iterator[RunningServer]:
    app = make_app(tiny_hybrid_path, draft_path, generate=script, served_model_name="tiny")
    with run_server(app) as srv:
        yield srv


def test_unknown_fields_are_named_in_the_header_and_the_log(
    served: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    oai = openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="x", max_retries=0)
    with caplog.at_level(logging.INFO, logger="dflash_server"):
        raw = oai.chat.completions.with_raw_response.create(
            model="tiny", messages=HI, max_tokens=4, user="u1", extra_body={"foo_bar": 1}
        )
    assert raw.headers[HEADER] == "user,foo_bar"
    assert raw.parse().choices[0].message.content == "Hi."
    assert any(r.levelno == logging.WARNING and "foo_bar" in r.getMessage() for r in caplog.records)
    # Streams carry it too; a request with nothing ignored has no header.
    with oai.chat.completions.with_streaming_response.create(
        model="tiny", messages=HI, stream=True, extra_body={"num_ctx": 4096}
    ) as stream:
        assert stream.headers[HEADER] == "num_ctx"
    plain = oai.chat.completions.with_raw_response.create(model="tiny", messages=HI)
    assert HEADER not in plain.headers
    # The protocol's own bookkeeping (Codex's prompt_cache_key) is logged at info only.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dflash_server"):
        r = oai.responses.with_raw_response.create(
            model="tiny", input="Hi", extra_body={"prompt_cache_key": "k", "block_size": 3}
        )
    assert r.headers[HEADER] == "prompt_cache_key"  # block_size is passed on, not ignored
    ignored = [rec for rec in caplog.records if "ignored" in rec.getMessage()]
    assert [rec.levelno for rec in ignored] == [logging.INFO]
    claude = anthropic.Anthropic(base_url=served.base_url, api_key="x", max_retries=0)
    m = claude.messages.with_raw_response.create(
        model="tiny", max_tokens=5, messages=HI, extra_body={"context_management": {}, "x": 1}
    )
    assert m.headers[HEADER] == "context_management,x"
    count = httpx.post(
        f"{served.base_url}/v1/messages/count_tokens",
        json={"model": "tiny", "messages": HI, "max_tokens": 5},
    )
    assert count.status_code == 200 and count.headers[HEADER] == "max_tokens"


@pytest.mark.parametrize(
    ("path", "body", "field", "meant"),
    [
        ("/v1/chat/completions", {"messages": HI, "max_token": 4}, "max_token", "max_tokens"),
        ("/v1/completions", {"prompt": "a", "temprature": 0}, "temprature", "temperature"),
        (
            "/v1/responses",
            {"input": "Hi", "maxOutputTokens": 4},
            "maxOutputTokens",
            "max_output_tokens",
        ),
        (
            "/v1/messages",
            {"max_tokens": 4, "messages": HI, "stop_sequence": ["x"]},
            "stop_sequence",
            "stop_sequences",
        ),
    ],
)
def test_typos_are_400s_naming_the_field_meant(
    served: RunningServer,
    script: ScriptedGenerate,
    path: str,
    body: dict[str, Any],
    field: str,
    meant: str,
) -> None:
    calls = len(script.calls)
    r = httpx.post(served.base_url + path, json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    assert len(script.calls) == calls  # refused before any generation ran
    error = r.json()["error"]
    assert error["message"] == f"unknown field {field!r}; did you mean {meant!r}?"
    if path != "/v1/messages":  # Anthropic's errors have no param
        assert error["param"] == field and error["code"] == "unknown_parameter"


# ----- names a header cannot hold as they are -----------------------------------------------

# Not latin-1, CR, LF, NUL, a tab, the list's own separator and escape, a space, and one name
# longer than the whole header may be.
ODD: dict[str, Any] = {"温度": 1, "a\rb": 1, "a\nb": 1, "a\x00b": 1, "t\tab": 1, "a,b%": 1}
ODD |= {"sp ace": 1, "é": 1, "x" * 5000: 1}
LISTED = [name for name in ODD if len(name) < MAX_HEADER_CHARS]


def _well_formed(value: str) -> list[str]:
    """The names in a header value that holds only visible ASCII (what every HTTP stack, proxy
    and log takes), decoded as docs/api.md says: split on commas, percent-decode each."""
    assert value.isascii() and value.isprintable() and " " not in value, value
    return [unquote(name) for name in value.split(",")]


def test_header_names_encode_what_a_header_cannot_hold() -> None:
    plain = ["foo_bar", "maxTokens", "num-ctx.v2~"]  # ordinary names go in as they are
    listed, omitted = header_names([*plain, *ODD])
    assert listed.startswith("foo_bar,maxTokens,num-ctx.v2~,%E6%B8%A9%E5%BA%A6,a%0Db,a%0Ab,a%00b")
    assert _well_formed(listed) == [*plain, *LISTED] and omitted == 1
    assert header_names([""]) == ("", 0)  # the empty name: an empty item


def test_many_names_are_bounded_and_counted() -> None:
    names = [f"field_{i}" for i in range(5000)]
    listed, omitted = header_names(names)
    kept = _well_formed(listed)
    assert len(listed) <= MAX_HEADER_CHARS and kept == names[: len(kept)]
    assert omitted == len(names) - len(kept) > 0


BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": HI, "max_tokens": 4},
    "/v1/completions": {"prompt": "Hi", "max_tokens": 4},
    "/v1/messages": {"messages": HI, "max_tokens": 4},
    "/v1/responses": {"input": "Hi", "max_output_tokens": 4},
}
LAST_EVENT = {  # what a stream that ran to its end ends with
    "/v1/chat/completions": "data: [DONE]",
    "/v1/completions": "data: [DONE]",
    "/v1/messages": "message_stop",
    "/v1/responses": "response.completed",
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path", list(BODIES))
def test_any_field_name_gets_a_200_and_a_well_formed_header(
    served: RunningServer,
    script: ScriptedGenerate,
    caplog: pytest.LogCaptureFixture,
    path: str,
    stream: bool,
) -> None:
    """Names outside latin-1 were a 500 after the whole generation, CR or LF a dropped
    connection: each is now percent-encoded, the overlong one counted, the answer whole, and
    the log line holds no line break a name brought."""
    body = {"model": "tiny", **BODIES[path], "stream": stream, **ODD}
    calls = len(script.calls)
    with (
        caplog.at_level(logging.INFO, logger="dflash_server"),
        httpx.stream("POST", served.base_url + path, json=body, timeout=60) as r,
    ):
        text = r.read().decode()
    assert r.status_code == 200, text
    assert _well_formed(r.headers[HEADER]) == LISTED and r.headers[OMITTED] == "1"
    assert len(script.calls) == calls + 1
    assert LAST_EVENT[path] in text if stream else r.json().get("error") is None
    logged = [rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage()]
    assert len(logged) == 1 and "(and 1 more)" in logged[0]
    assert not any(c in logged[0] for c in "\r\n\x00温")


def test_thousands_of_fields_and_count_tokens(served: RunningServer) -> None:
    many = {f"field_{i}": i for i in range(3000)}
    for path, body in [*BODIES.items(), ("/v1/messages/count_tokens", {"messages": HI})]:
        r = httpx.post(served.base_url + path, json={"model": "tiny", **body, **many}, timeout=60)
        assert r.status_code == 200, (path, r.text)
        kept = _well_formed(r.headers[HEADER])
        assert kept == list(many)[: len(kept)] and int(r.headers[OMITTED]) == 3000 - len(kept)
    odd = {"model": "tiny", "messages": HI, **ODD}
    r = httpx.post(served.base_url + "/v1/messages/count_tokens", json=odd)
    assert r.status_code == 200 and _well_formed(r.headers[HEADER]) == LISTED


def test_a_name_that_is_not_text_is_a_400(served: RunningServer) -> None:
    """A lone surrogate (valid JSON, not UTF-8) in a key: a 400 naming it escaped."""
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "a\\ud800": 1}'
    r = httpx.post(
        served.base_url + "/v1/chat/completions",
        content=raw,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "a\\ud800" in r.json()["error"]["message"], r.text
