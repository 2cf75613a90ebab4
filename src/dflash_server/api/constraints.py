"""What may constrain an answer: the tool-choice policy, structured output, logprobs."""

from __future__ import annotations

import dataclasses
from typing import Any

from dflash_server.api.errors import APIError
from dflash_server.api.tool_checks import check_function
from dflash_server.api.types import ChatCompletionRequest, SamplingFields
from dflash_server.chat.budget import Budgeted
from dflash_server.chat.logprobs import MAX_TOP_LOGPROBS
from dflash_server.chat.structured import (
    StructuredOutputError,
    check_grammar,
    response_format_grammar,
    tool_call_grammar,
)
from dflash_server.generation.request import GenerationRequest

# With thinking on, a forced tool call or response_format must be reached: reasoning then gets
# this many tokens unless the request or the server set a budget, and never over half of
# max_tokens, so the call or the JSON has room.
CONSTRAINED_THINKING_TOKENS = 2048


def tool_policy(req: ChatCompletionRequest) -> tuple[list[dict[str, Any]] | None, list[str] | None]:
    """(tools to render and parse, function names a grammar must force, if any)."""
    tools = req.tools or None
    names: list[str] = []
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if tool.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(
                400,
                "only function tools are supported: {'type': 'function', 'function': {'name': ...}}",
                param=f"tools.{i}",
                code="invalid_value",
            )
        where = f"tools.{i}.function"
        check_function(fn["name"], fn.get("parameters"), f"{where}.name", f"{where}.parameters")
        names.append(fn["name"])
    choice = req.tool_choice
    if choice in (None, "auto"):
        return tools, None
    if choice == "none":
        return None, None  # no tools in the prompt: the model answers in text
    if choice == "required":
        if not tools:
            raise APIError(400, "tool_choice 'required' needs tools", param="tool_choice")
        return tools, names
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str) or name not in names:
        raise APIError(
            400,
            "tool_choice must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': <one of tools>}}",
            param="tool_choice",
            code="invalid_value",
        )
    return tools, [name]


def requested_logprobs(req: SamplingFields) -> int | None:
    """How many alternatives per token to report; None: no logprobs."""
    if isinstance(req, ChatCompletionRequest):
        top = req.logprobs
        if not isinstance(top, bool | None):
            raise APIError(400, "logprobs must be true or false", param="logprobs")
        top = req.top_logprobs
        if not req.logprobs:
            if top:
                raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            return None
        param = "top_logprobs"
    else:
        if req.logprobs is None or req.logprobs is False:
            return None
        top, param = req.logprobs, "logprobs"
    if top is None:
        return 0
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise APIError(
            400,
            f"{param} must be an integer between 0 and {MAX_TOP_LOGPROBS}",
            param=param,
            code="invalid_value",
        )
    return top


def answer_grammar(
    tokenizer: Any,
    response_format: dict[str, Any] | None,
    tools: list[dict[str, Any]] | None,
    tool_names: list[str] | None,
    parallel: bool,
) -> str | None:
    """The grammar for response_format or a forced tool call (400 if it cannot be enforced)."""
    try:
        grammar = response_format_grammar(response_format)
    except StructuredOutputError as exc:
        raise APIError(400, str(exc), param="response_format", code="invalid_value") from exc
    if tool_names is not None:
        if grammar is not None:
            raise APIError(
                400,
                "response_format and a forced tool_choice cannot both constrain one answer",
                param="response_format",
            )
        try:
            grammar = tool_call_grammar(tokenizer, tools or [], tool_names, parallel)
            check_grammar(tokenizer, grammar)
        except StructuredOutputError as exc:
            raise APIError(400, str(exc), param="tool_choice", code="invalid_value") from exc
        return grammar
    if grammar is not None:
        try:
            check_grammar(tokenizer, grammar)
        except StructuredOutputError as exc:
            raise APIError(
                400, str(exc), param="response_format", code="unsupported_schema"
            ) from exc
    return grammar


def with_thinking_budget(
    request: GenerationRequest, budget: int | None, width: int | None
) -> GenerationRequest:
    """``request`` with its reasoning capped at ``budget`` tokens (None: no cap), enforced by a
    constraint that allows only the think-end token once the budget is spent.

    Applies only while the prompt leaves a think block open that one token closes. A grammar
    (forced call, response_format) gets a default budget, see CONSTRAINED_THINKING_TOKENS.
    """
    reasoning = request.reasoning
    if not reasoning.opens or reasoning.think_end is None:
        return request
    if request.constraint is not None:
        cap = request.max_tokens // 2
        budget = min(CONSTRAINED_THINKING_TOKENS if budget is None else budget, cap)
    if budget is None or budget >= request.max_tokens:
        return request  # nothing to enforce: max_tokens ends the answer first
    spec = Budgeted(budget, reasoning.think_end, width, request.constraint)
    return dataclasses.replace(request, constraint=spec)
