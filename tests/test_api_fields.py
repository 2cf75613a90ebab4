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

import anthropic
import httpx
import openai
import pytest

from dflash_server.api.anthropic import CountTokensRequest, MessagesRequest
from dflash_server.api.fields import (
    CHAT_SPEC,
    COMPLETION_SPEC,
    MESSAGES_SPEC,
    RESPONSES_SPEC,
    near_miss,
)
from dflash_server.api.openai_responses import PASSED_ON, ResponsesRequest
from dflash_server.api.types import ChatCompletionRequest, CompletionRequest, extensions
from server_fixtures import RunningServer, ScriptedGenerate, make_app, run_server

HEADER = "x-dflash-ignored-fields"
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
def served(tiny_hybrid_path: Path, draft_path: Path) -> Iterator[RunningServer]:
    script = ScriptedGenerate(["</think>\n\n", "Hi."])
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
    served: RunningServer, path: str, body: dict[str, Any], field: str, meant: str
) -> None:
    r = httpx.post(served.base_url + path, json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"] == f"unknown field {field!r}; did you mean {meant!r}?"
    if path != "/v1/messages":  # Anthropic's errors have no param
        assert error["param"] == field and error["code"] == "unknown_parameter"
