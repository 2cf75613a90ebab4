"""Check a request and turn it into a ``GenerationRequest`` (the one object the engine runs).

Everything that can reject a request happens here, before any response starts, so a client
always gets a proper status code instead of an error inside an already-open stream.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from dflash_server.api.chat_messages import (
    merged_system,
    template_messages,
    thinking_budget,
    thinking_enabled,
)
from dflash_server.api.constraints import (
    answer_grammar,
    requested_logprobs,
    tool_policy,
    with_thinking_budget,
)
from dflash_server.api.errors import APIError, ContextLengthError, validation_error
from dflash_server.api.images import load_images
from dflash_server.api.types import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    unsupported_features,
)
from dflash_server.chat.prompts import Prompt, PromptError, render_chat, render_completion
from dflash_server.chat.structured import Grammar
from dflash_server.engine.summary import ServedModel
from dflash_server.engine.worker import Engine
from dflash_server.generation.request import PLAIN, BlockPolicy, GenerationRequest, block_policy
from dflash_server.generation.sampling import SERVED_FIELDS, SamplingParams
from dflash_server.models.vision import ImageInput
from dflash_server.settings import Settings


@dataclass(frozen=True)
class Prepared:
    """A validated request: what to generate, and how to shape the answer."""

    kind: Literal["chat", "completion"]
    request: GenerationRequest
    model: str
    stream: bool
    include_usage: bool
    tools: list[dict[str, Any]] | None = None  # parse tool calls against these (None: don't)
    parallel_tool_calls: bool = True
    dflash_tokens: bool = False  # stream extension: each token's text and source
    forced: bool = False  # a grammar writes the answer (tool_choice forcing a call, a schema)
    thinking: bool = True  # False: the request turned thinking off, so no reasoning is parsed


def _check_request(req: SamplingFields, settings: Settings, engine: Engine) -> ServedModel:
    """The model the request names, once it is ready to serve (else the status that says
    why; the route found the model the request names: ``api/model_access.py``)."""
    problem = unsupported_features(req)
    if problem is not None:
        param, message = problem
        raise APIError(400, message, param=param, code="unsupported_parameter")
    served = engine.served
    if engine.state != "ready" or served is None:
        message = engine.error or "models are still loading; retry shortly (see GET /health)"
        raise APIError(503, message, code="model_not_ready", headers={"Retry-After": "5"})
    return served


def _block_policy(req: SamplingFields, settings: Settings, trained: int | None) -> BlockPolicy:
    """The request's block size (checked), else the server's (fitted to the drafter's
    ``trained`` block; None: no drafter)."""
    speculative = settings.speculative if req.speculative is None else req.speculative
    if not speculative:
        return PLAIN
    if req.block_size is None:
        policy = block_policy(trained, settings.block_size, clamp=True)
    elif trained is None:
        raise APIError(400, "no drafter is loaded, block_size cannot apply", param="block_size")
    else:
        try:
            policy = block_policy(trained, req.block_size)
        except ValueError as exc:
            raise APIError(400, str(exc), param="block_size", code="invalid_value") from exc
    if settings.suffix_tokens and (policy.auto or trained is None):
        policy = replace(policy, suffix=settings.suffix_tokens)
    return policy


def _request(
    req: SamplingFields,
    settings: Settings,
    engine: Engine,
    served: ServedModel,
    prompt: Prompt,
    max_tokens: int | None,
    **extra: Any,
) -> GenerationRequest:
    """The generation request: the request's values over the server's defaults, fitted into
    the context window and the KV budget."""
    ctx = served.summary.context_length
    room = ctx - len(prompt.tokens)
    if room <= 0:
        param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        raise ContextLengthError(len(prompt.tokens), ctx, param)
    # The KV budget bounds one request's output like the context does; a prompt that does not
    # fit it at all is refused at submission (503, docs/operations.md "KV memory budget").
    if (fits := engine.output_room(len(prompt.tokens))) is not None and fits > 0:
        room = min(room, fits)
    sampling = {name: getattr(req, name) for name in SERVED_FIELDS}
    defaults = {name: getattr(settings, name) for name in SERVED_FIELDS}
    # Default: as many tokens as fit, so long answers are not cut off at an arbitrary cap.
    limit = max_tokens or settings.max_tokens or room
    block = _block_policy(req, settings, served.summary.block_size)
    params = SamplingParams(**(defaults | {k: v for k, v in sampling.items() if v is not None}))
    seed = None if req.seed == -1 else req.seed
    if (block.auto or block.suffix) and seed is not None and not params.greedy:
        # A seed must reproduce the answer: auto's widths follow timings and the random draws
        # follow the widths, so seeded sampling verifies a fixed block (and copies nothing).
        block = replace(block, auto=False, suffix=0)
    return GenerationRequest(
        prompt=tuple(prompt.tokens),
        max_tokens=min(limit, room),
        sampling=params,
        seed=seed,
        stop=tuple(req.stop or ()),
        block=block,
        logprobs=requested_logprobs(req),
        reasoning=prompt.reasoning,
        checkpoints=prompt.checkpoints,
        skip_special_tokens=req.skip_special_tokens is not False,
        **extra,
    )


def chat_request(data: dict[str, Any]) -> ChatCompletionRequest:
    """A chat request built by a translating endpoint (Anthropic, Responses), checked like a
    request body: invalid values are a 400 naming the field."""
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:
        raise validation_error(RequestValidationError(exc.errors())) from exc


@dataclass(frozen=True)
class ChatPrompt:
    """A chat request's rendered prompt and its tool policy."""

    prompt: Prompt
    tools: list[dict[str, Any]] | None  # rendered into the prompt and parsed from the answer
    forced: list[str] | None  # function names a grammar must force (tool_choice)
    thinking: bool  # the chat template's thinking switch, as the request set it
    images: tuple[ImageInput, ...] = ()  # in prompt order, each at its run of image tokens
    served: ServedModel | None = None  # the model it was rendered for


def _why_no_images(served: ServedModel, settings: Settings) -> str:
    """Why this model refuses images (user turns and tool results alike), and what would take
    them."""
    if not settings.vision:
        fix = "restart the server without --no-vision"
    else:
        fix = "serve a checkpoint with a vision tower (Qwen3.5's own, not a text-only conversion)"
    return f"{served.summary.vision_note}; {fix}, or send no images (in messages or tool results)"


async def render_messages(
    req: ChatCompletionRequest, settings: Settings, engine: Engine
) -> ChatPrompt:
    """Check a chat request and render its prompt with the model's chat template; its images
    are decoded and checked here, and each takes its image tokens in the prompt."""
    served = _check_request(req, settings, engine)
    messages, refs = template_messages(req.messages)
    vision = served.vision
    images = await load_images(refs, settings, vision, _why_no_images(served, settings))
    pads = None
    if vision is not None and images:
        pads = (vision.tokens.image, [vision.count(image) for image in images])
    kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k != "enable_thinking"}
    tools, forced = tool_policy(req)
    thinking = thinking_enabled(req, settings.enable_thinking)
    render = functools.partial(
        render_chat,
        served.tokenizer,
        enable_thinking=thinking,
        template_kwargs=kwargs,
        tools=tools,
        image_pads=pads,
    )
    try:
        # Templates and tokenizers are CPU work: keep them off the event loop.
        prompt = await run_in_threadpool(render, messages)
    except PromptError as exc:
        # System messages later in the conversation render in place where the template
        # allows it; a template that takes one only first gets them merged into that one.
        merged = merged_system(messages)
        if merged is None:
            raise APIError(400, str(exc), param="messages", code="invalid_messages") from exc
        try:
            prompt = await run_in_threadpool(render, merged)
        except PromptError as again:
            raise APIError(400, str(again), param="messages", code="invalid_messages") from exc
    return ChatPrompt(prompt, tools, forced, thinking, tuple(images), served)


async def prepare_chat(req: ChatCompletionRequest, settings: Settings, engine: Engine) -> Prepared:
    """Validate a chat request: its prompt, grammar (tool_choice, response_format), thinking
    budget and sampling, as one GenerationRequest."""
    chat = await render_messages(req, settings, engine)
    served = chat.served
    assert served is not None
    parallel = req.parallel_tool_calls is not False
    grammar = await run_in_threadpool(
        answer_grammar,
        served.tokenizer,
        req.response_format,
        chat.tools,
        chat.forced,
        parallel,
    )
    # With reasoning open, the grammar starts after the think-end token (see structured.py).
    think_end = chat.prompt.reasoning.think_end
    constraint = None if grammar is None else Grammar(grammar, think_end)
    max_tokens = req.max_completion_tokens or req.max_tokens
    request = _request(
        req, settings, engine, served, chat.prompt, max_tokens, constraint=constraint,
        images=chat.images,
    )  # fmt: skip
    budget = thinking_budget(req, settings.max_thinking_tokens)
    request = with_thinking_budget(request, budget, served.summary.vocab_size)
    return Prepared(
        kind="chat",
        request=request,
        model=req.model or settings.model_id,
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        dflash_tokens=bool(req.dflash_tokens),
        tools=chat.tools,
        parallel_tool_calls=parallel,
        forced=grammar is not None,
        thinking=chat.thinking,
    )


async def prepare_completion(
    req: CompletionRequest, settings: Settings, engine: Engine
) -> Prepared:
    """Validate a text completion request and tokenize its prompt as is."""
    served = _check_request(req, settings, engine)
    raw = (
        req.prompt[0]
        if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str)
        else req.prompt
    )
    if not raw:
        raise APIError(400, "prompt must not be empty", param="prompt", code="invalid_value")
    if isinstance(raw, list):
        ids = [t for t in raw if isinstance(t, int)]
        if len(ids) != len(raw):
            raise APIError(400, "prompt must be a string or a list of token ids", param="prompt")
        raw = ids
        vocab = served.summary.vocab_size
        if vocab and any(not 0 <= t < vocab for t in raw):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="prompt")
    prompt = await run_in_threadpool(render_completion, served.tokenizer, raw)
    return Prepared(
        kind="completion",
        request=_request(req, settings, engine, served, prompt, req.max_tokens),
        model=req.model or settings.model_id,
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        dflash_tokens=bool(req.dflash_tokens),
    )
