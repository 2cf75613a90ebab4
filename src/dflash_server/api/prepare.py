"""Check a request and turn it into a prompt plus generation parameters.

Everything that can reject a request happens here, before any response starts, so a client
always gets a proper status code instead of an error inside an already-open stream.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal

from starlette.concurrency import run_in_threadpool

from dflash_server.api.errors import APIError
from dflash_server.api.types import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
    unsupported_features,
)
from dflash_server.engine.logprobs import MAX_TOP_LOGPROBS
from dflash_server.engine.prompts import Prompt, PromptError, render_chat, render_completion
from dflash_server.engine.structured import (
    StructuredOutputError,
    check_grammar,
    response_format_grammar,
    tool_call_grammar,
)
from dflash_server.engine.worker import Engine, GenerationParams
from dflash_server.settings import Settings


@dataclass(frozen=True)
class Prepared:
    """A validated request, ready to become an engine job."""

    kind: Literal["chat", "completion"]
    prompt: Prompt
    params: GenerationParams
    model: str
    stream: bool
    include_usage: bool
    tools: list[dict[str, Any]] | None = None  # parse tool calls against these (None: don't)
    parallel_tool_calls: bool = True


def check_model(requested: str | None, settings: Settings) -> None:
    """404 unless the request names the served model (or its target id); None means default."""
    if requested is None or requested in {settings.model_id, settings.target}:
        return
    raise APIError(
        404,
        f"model {requested!r} is not served here; available: {settings.model_id!r}",
        param="model",
        code="model_not_found",
    )


def _check_request(req: SamplingFields, settings: Settings, engine: Engine) -> None:
    check_model(req.model, settings)
    problem = unsupported_features(req)
    if problem is not None:
        param, message = problem
        raise APIError(400, message, param=param, code="unsupported_parameter")
    if engine.state != "ready" or engine.models is None:
        message = engine.error or "models are still loading; retry shortly (see GET /health)"
        raise APIError(503, message, code="model_not_ready", headers={"Retry-After": "5"})


def _message_dict(msg: ChatMessage, index: int) -> dict[str, Any]:
    """A template-ready message: text parts joined, 'developer' read as 'system'."""
    content = msg.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise APIError(
                    400,
                    f"content part type {part.type!r} is not supported; only text parts are",
                    param=f"messages.{index}.content",
                    code="unsupported_content",
                )
            texts.append(part.text)
        content = "".join(texts)
    out: dict[str, Any] = {
        "role": "system" if msg.role == "developer" else msg.role,
        "content": content if content is not None else "",
    }
    reasoning = msg.reasoning_content or msg.reasoning
    if reasoning:
        out["reasoning_content"] = reasoning
    for key in ("name", "tool_call_id"):
        value = getattr(msg, key)
        if value is not None:
            out[key] = value
    if msg.tool_calls:
        out["tool_calls"] = [_history_call(c, index) for c in msg.tool_calls]
    return out


def _history_call(call: dict[str, Any], index: int) -> dict[str, Any]:
    """An assistant tool call from the history, its arguments as a mapping for the template."""
    fn = call.get("function") if isinstance(call.get("function"), dict) else call
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as exc:
            raise APIError(
                400,
                f"tool call arguments must be a JSON object: {exc}",
                param=f"messages.{index}.tool_calls",
                code="invalid_value",
            ) from exc
    if not isinstance(args, dict) or not isinstance(fn.get("name"), str):
        raise APIError(
            400,
            "each tool call needs function.name and object arguments",
            param=f"messages.{index}.tool_calls",
            code="invalid_value",
        )
    return {**call, "function": {**fn, "arguments": args}}


def _tools(req: ChatCompletionRequest) -> tuple[list[dict[str, Any]] | None, list[str] | None]:
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


def _logprobs(req: SamplingFields) -> int | None:
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


def _grammar(
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


def _thinking(req: ChatCompletionRequest, default: bool) -> bool:
    """chat_template_kwargs.enable_thinking > enable_thinking > reasoning_effort > default."""
    kwargs = req.chat_template_kwargs or {}
    if "enable_thinking" in kwargs:
        return bool(kwargs["enable_thinking"])
    if req.enable_thinking is not None:
        return req.enable_thinking
    if req.reasoning_effort is not None:
        return req.reasoning_effort.lower() not in ("none", "minimal")
    return default


def _params(
    req: SamplingFields, settings: Settings, engine: Engine, prompt_len: int, max_tokens: int | None
) -> GenerationParams:
    assert engine.models is not None
    ctx = engine.models.context_length
    room = ctx - prompt_len
    if room <= 0:
        raise APIError(
            400,
            f"prompt is {prompt_len} tokens, the context limit is {ctx}: shorten it",
            param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            code="context_length_exceeded",
        )
    speculative = settings.speculative if req.speculative is None else req.speculative
    block_size = req.block_size if req.block_size is not None else settings.block_size
    trained = engine.models.draft_block_size
    if req.block_size is not None and speculative:
        if trained is None:
            raise APIError(400, "no drafter is loaded, block_size cannot apply", param="block_size")
        if not 2 <= req.block_size <= trained:
            raise APIError(
                400,
                f"block_size must be between 2 and the drafter's {trained}",
                param="block_size",
                code="invalid_value",
            )
    if block_size is not None and trained is not None:
        block_size = max(2, min(block_size, trained))
    top_k = req.top_k if req.top_k is not None else settings.top_k
    # Default: as many tokens as fit, so long answers are not cut off at an arbitrary cap.
    limit = max_tokens or settings.max_tokens or room
    return GenerationParams(
        max_tokens=min(limit, room),
        temperature=_pick(req.temperature, settings.temperature),
        top_p=_pick(req.top_p, settings.top_p),
        top_k=max(0, top_k),
        min_p=_pick(req.min_p, settings.min_p),
        repetition_penalty=_pick(req.repetition_penalty, settings.repetition_penalty),
        presence_penalty=_pick(req.presence_penalty, settings.presence_penalty),
        frequency_penalty=_pick(req.frequency_penalty, settings.frequency_penalty),
        stop=tuple(req.stop or ()),
        seed=None if req.seed == -1 else req.seed,
        block_size=block_size,
        speculative=speculative and engine.models.draft is not None,
    )


def _think_end_id(tokenizer: Any) -> int | None:
    """The one-token think end (mlx-lm raises for multi-token markers: no grammar gating then)."""
    try:
        return getattr(tokenizer, "think_end_id", None)
    except ValueError:
        return None


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


async def prepare_chat(req: ChatCompletionRequest, settings: Settings, engine: Engine) -> Prepared:
    """Validate a chat request and render its prompt with the model's chat template."""
    _check_request(req, settings, engine)
    assert engine.models is not None
    messages = [_message_dict(m, i) for i, m in enumerate(req.messages)]
    kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k != "enable_thinking"}
    thinking = _thinking(req, settings.enable_thinking)
    tools, forced = _tools(req)
    logprobs = _logprobs(req)
    tokenizer = engine.models.tokenizer
    try:
        # Templates and tokenizers are CPU work: keep them off the event loop.
        prompt = await run_in_threadpool(
            render_chat,
            tokenizer,
            messages,
            enable_thinking=thinking,
            template_kwargs=kwargs,
            tools=tools,
        )
    except PromptError as exc:
        raise APIError(400, str(exc), param="messages", code="invalid_messages") from exc
    parallel = req.parallel_tool_calls is not False
    grammar = await run_in_threadpool(
        _grammar, tokenizer, req.response_format, tools, forced, parallel
    )
    max_tokens = req.max_completion_tokens or req.max_tokens
    params = _params(req, settings, engine, len(prompt.tokens), max_tokens)
    # With reasoning open, the grammar starts after the think-end token (see structured.py).
    think_end = _think_end_id(tokenizer) if prompt.opens_reasoning else None
    params = dataclasses.replace(
        params, logprobs=logprobs, grammar=grammar, think_end=think_end if grammar else None
    )
    return Prepared(
        kind="chat",
        prompt=prompt,
        params=params,
        model=req.model or settings.model_id,
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        tools=tools,
        parallel_tool_calls=parallel,
    )


async def prepare_completion(
    req: CompletionRequest, settings: Settings, engine: Engine
) -> Prepared:
    """Validate a text completion request and tokenize its prompt as is."""
    _check_request(req, settings, engine)
    assert engine.models is not None
    raw = (
        req.prompt[0]
        if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str)
        else req.prompt
    )
    if not raw:
        raise APIError(400, "prompt must not be empty", param="prompt", code="invalid_value")
    tokenizer = engine.models.tokenizer
    if isinstance(raw, list):
        vocab = engine.models.summary.get("vocab_size")
        if vocab and any(not 0 <= t < vocab for t in raw):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="prompt")
    prompt = await run_in_threadpool(render_completion, tokenizer, raw)
    params = _params(req, settings, engine, len(prompt.tokens), req.max_tokens)
    return Prepared(
        kind="completion",
        prompt=prompt,
        params=dataclasses.replace(params, logprobs=_logprobs(req)),
        model=req.model or settings.model_id,
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
    )
