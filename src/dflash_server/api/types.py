"""Request and response shapes of the OpenAI-compatible API, plus the DFlash extensions.

Requests accept the OpenAI fields; features this server cannot honour are rejected by
``unsupported_features`` with a 400 naming the field, never silently ignored. Other extra
fields are accepted (clients send provider-specific ones) and named back, or refused when they
look like a typo, by ``fields.py``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator
from pydantic.fields import FieldInfo

from dflash_server.generation.sampling import MAX_INT, SERVED_FIELDS, SamplingParams

# Bounds that keep absurd values out of the engine (a 400, never an overflow deep inside).
MAX_SEED = 2**64 - 1


def _first_unencodable(data: Any) -> str | None:
    """The path of the first string, value or key, that is not valid UTF-8 text (JSON allows
    lone surrogates like "\\ud800"; tokenizers, headers and the error body itself raise on them),
    its bad characters escaped. Iterative: depth is bounded by the JSON parser."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path.encode("utf-8", "backslashreplace").decode() or "body"
        elif isinstance(value, dict):
            for k, v in value.items():
                at = f"{path}.{k}" if path else str(k)
                stack += [(at, v), (at, k)]  # the key is text too
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}" if path else str(i), v) for i, v in enumerate(value))
    return None


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        bad = _first_unencodable(data)
        if bad is not None:
            raise ValueError(f"{bad}: text is not valid UTF-8 (lone surrogate escape)")
        return data


# SamplingParams' served fields, each optional (None: the server's default) with its bounds.
_SamplingOverrides = create_model(  # type: ignore[call-overload]  # fields built at import
    "SamplingOverrides",
    __base__=_Request,
    **{
        name: (
            Optional[SamplingParams.model_fields[name].annotation],  # noqa: UP045 (runtime types)
            FieldInfo.merge_field_infos(SamplingParams.model_fields[name], default=None),
        )
        for name in SERVED_FIELDS
    },
)


class SamplingFields(_SamplingOverrides):
    """Sampling and DFlash fields shared by chat and text completions."""

    model: str | None = Field(None, description="served model id (see /v1/models)")
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-1, le=MAX_SEED, description="-1: random (llama.cpp)")
    stream: bool | None = Field(False, description="null: false")
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1)
    logprobs: Any = None
    logit_bias: dict[str, float] | None = None
    # DFlash extensions
    block_size: Annotated[int, Field(ge=1, le=MAX_INT)] | Literal["auto"] | None = Field(
        None, description="draft block size for this request: 2..the drafter's, or 'auto'"
    )
    speculative: bool | None = Field(None, description="false: plain decoding, no drafter")
    dflash_tokens: bool | None = Field(
        None,
        description="streams: each chunk lists its tokens' texts and sources (draft/suffix/target)",
    )
    skip_special_tokens: bool | None = Field(
        None, description="vLLM: leave control tokens out of the text (null: true)"
    )

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops or None


# What Messages and Responses requests may carry as extra fields, translated onto chat: every
# served sampling field and the DFlash switches (a new SamplingParams field reaches all three).
EXTENSIONS = (*SERVED_FIELDS, "seed", "block_size", "speculative", "skip_special_tokens")
THINKING_EXTENSIONS = ("enable_thinking", "thinking_budget")  # Messages has its own thinking


def extensions(request: type[BaseModel], *more: str) -> tuple[str, ...]:
    """The extension fields a protocol's request model does not declare itself."""
    return tuple(f for f in (*EXTENSIONS, *more) if f not in request.model_fields)


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    """A content part; ``text`` parts, and ``refusal`` parts of earlier assistant answers."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    refusal: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    enable_thinking: bool | None = Field(None, description="shortcut for chat_template_kwargs")
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = Field(
        None, description="'none'/'minimal': no thinking; low/medium/high: thinking budgets"
    )
    thinking_budget: int | None = Field(
        None, ge=0, le=MAX_INT, description="most reasoning tokens before the answer"
    )
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] = Field(..., description="one prompt: text or token ids")
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


# Fields of other servers that change what gets generated; accepting them silently would lie.
_FOREIGN_FEATURES = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "grammar",
    "json_schema",
    "prediction",
    "audio",
)


def unsupported_features(req: SamplingFields) -> tuple[str, str] | None:
    """(param, message) for the first requested feature this server does not implement."""
    if req.n not in (None, 1):
        return "n", "only n=1 is supported (one completion per request)"
    if req.logit_bias:
        return "logit_bias", "logit_bias is not supported"
    extras = req.model_extra or {}
    for name in _FOREIGN_FEATURES:
        if extras.get(name) not in (None, False):
            return name, f"{name} is not supported by this server; use response_format"
    legacy = isinstance(req, ChatCompletionRequest) and (
        req.functions or req.function_call not in (None, "none", "auto")
    )
    if legacy:
        return "functions", "legacy function calling is not supported; use tools"
    if isinstance(req, CompletionRequest):
        if req.echo:
            return "echo", "echo is not supported"
        if req.suffix:
            return "suffix", "suffix (insertion) is not supported"
        if req.best_of not in (None, 1):
            return "best_of", "only best_of=1 is supported"
        is_texts = isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str)
        if is_texts and len(req.prompt) != 1:
            return "prompt", "only one prompt per request is supported"
    return None


# ----- responses ---------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dflash-server"
    # The served context, under the names clients read it by (OpenRouter/LM Studio style,
    # vLLM's, Anthropic's): a client that knows it can compact before a request overflows.
    context_length: int | None = None
    max_model_len: int | None = None
    max_input_tokens: int | None = None
    # What the model takes, as Ollama (capabilities) and OpenRouter (modalities) say it: "vision"
    # and "image" when prompts may hold images.
    capabilities: list[str] | None = None
    modalities: dict[str, list[str]] | None = None
    # Where it stands and what it is (LM Studio's state and type, in the words):
    # loaded, loading or unloaded; chat or embeddings.
    state: Literal["loaded", "loading", "unloaded"] | None = None
    kind: Literal["chat", "embeddings"] | None = None
    aliases: list[str] | None = None
    pinned: bool | None = None
    dimensions: int | None = None  # an embeddings model's vector width, once loaded


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


SamplingFields.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()
