"""The OpenAI Responses API (``POST /v1/responses``): requests and the response store.

A thin translation: ``input`` items (messages, ``function_call``, ``function_call_output``,
``reasoning``) after the stored conversation of ``previous_response_id``, with ``instructions``
as the system message, become the chat request they mean (tools, tool_choice, ``text.format``
as response_format, ``reasoning.effort`` as the thinking budget); ``prepare_chat`` turns it into
the same ``GenerationRequest`` as ``/v1/chat/completions``. Input items are translated in
``openai_responses_input.py``, tools (namespaces, hosted tools) in ``openai_responses_tools.py``;
the answer is shaped in ``openai_responses_events.py``. ``truncation: "auto"`` drops the oldest
turns of a conversation that does not fit the context (``prepare_response``).

``store`` (default true) keeps the response and its conversation in memory, in a bounded
least-recently-used store (``--responses-store`` entries), so a later request can continue it
with ``previous_response_id``; ``store: false`` keeps nothing.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from dflash_server.api.errors import APIError, ContextLengthError
from dflash_server.api.openai_responses_input import input_messages
from dflash_server.api.openai_responses_tools import ResponseTools, chat_tool_choice
from dflash_server.api.prepare import Prepared, chat_request, prepare_chat
from dflash_server.api.tool_checks import check_parameters
from dflash_server.api.types import (
    THINKING_EXTENSIONS,
    ChatCompletionRequest,
    _Request,
    extensions,
)
from dflash_server.engine.worker import Engine
from dflash_server.generation.sampling import MAX_INT
from dflash_server.settings import Settings

# Fields that would change what is generated and that this server cannot honour.
_REFUSED = ("background", "conversation", "prompt")


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: dict[str, Any] | None = None


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    effort: str | None = None
    summary: str | None = None  # no summaries here: the reasoning itself is returned


# ``include`` values this server can honour: the reasoning is always returned as text (so it
# needs no encrypted copy), and output_text logprobs are computed when asked for.
INCLUDES = ("reasoning.encrypted_content", "message.output_text.logprobs")


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    previous_response_id: str | None = None
    store: bool | None = True
    stream: bool | None = False
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        # OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512.
        if value is not None and (
            len(value) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in value.items())
        ):
            raise ValueError("at most 16 pairs, keys up to 64 and values up to 512 characters")
        return value

    @field_validator("include")
    @classmethod
    def _include(cls, value: list[str] | None) -> list[str] | None:
        for name in value or []:
            if name not in INCLUDES:
                raise ValueError(f"{name!r} is not supported (supported: {', '.join(INCLUDES)})")
        return value

    @property
    def logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or [])


# The extension fields a Responses request may carry, passed on to its chat request.
PASSED_ON = extensions(ResponsesRequest, *THINKING_EXTENSIONS)


# ----- the store ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Stored:
    """A finished response and the conversation it ends (chat messages, without instructions)."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]


class ResponseStore:
    """The last ``size`` stored responses, by id; the least recently used go first."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: collections.OrderedDict[str, Stored] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, response_id: str) -> Stored | None:
        with self._lock:
            found = self._items.get(response_id)
            if found is not None:
                self._items.move_to_end(response_id)
            return found

    def put(self, response_id: str, stored: Stored) -> None:
        if self.size <= 0:
            return
        with self._lock:
            self._items[response_id] = stored
            self._items.move_to_end(response_id)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


def previous(store: ResponseStore, response_id: str | None) -> list[dict[str, Any]]:
    """The conversation ``previous_response_id`` ended (404 when not stored)."""
    if response_id is None:
        return []
    found = store.get(response_id)
    if found is None:
        raise APIError(
            404,
            f"previous response {response_id!r} not found: it was sent with store: false, "
            f"is older than the last {store.size} responses, or the server restarted",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return list(found.conversation)


def _tools(req: ResponsesRequest, tools: ResponseTools) -> dict[str, Any]:
    choice = chat_tool_choice(req.tool_choice, tools)
    if choice == "required" and not tools.functions:
        raise APIError(
            400,
            "tool_choice 'required' needs function tools (hosted tools are left out here)",
            param="tool_choice",
            code="invalid_value",
        )
    if isinstance(choice, dict) and not tools.functions:
        raise APIError(
            400,
            f"tool_choice names {choice['function']['name']!r}, which is not among the tools",
            param="tool_choice",
            code="invalid_value",
        )
    out: dict[str, Any] = {
        "tools": tools.functions or None,
        "parallel_tool_calls": req.parallel_tool_calls,
    }
    if tools.functions:
        out["tool_choice"] = choice
    return out


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise APIError(
            400,
            "text.format.type must be 'text', 'json_object' or 'json_schema'",
            param="text.format.type",
            code="invalid_value",
        )
    for key, kinds in (("name", str), ("schema", dict)):
        if not isinstance(fmt.get(key), kinds):
            raise APIError(
                400,
                f"text.format.{key} is required with type 'json_schema' "
                f"(a {'string' if kinds is str else 'JSON Schema object'})",
                param=f"text.format.{key}",
                code="invalid_value",
            )
    check_parameters(fmt["schema"], "text.format.schema", object_only=False)
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def conversation(
    store: ResponseStore, req: ResponsesRequest, tools: ResponseTools
) -> list[dict[str, Any]]:
    """The conversation so far: the stored one of ``previous_response_id``, then ``input``."""
    return previous(store, req.previous_response_id) + input_messages(req.input, tools)


def to_chat(
    req: ResponsesRequest, conversation: list[dict[str, Any]], tools: ResponseTools
) -> ChatCompletionRequest:
    """The chat request a Responses request means: ``instructions``, then ``conversation``."""
    extra = req.model_extra or {}
    for name in _REFUSED:
        if extra.get(name) not in (None, False):
            raise APIError(
                400, f"{name} is not supported by this server", param=name, code="unsupported"
            )
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    data: dict[str, Any] = {
        "model": req.model,
        "messages": system + conversation,
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stream": req.stream,
        "response_format": _response_format(req.text),
        **_tools(req, tools),
    }
    if req.logprobs or req.top_logprobs:
        data |= {"logprobs": True, "top_logprobs": req.top_logprobs}
    if req.reasoning is not None and req.reasoning.effort is not None:
        data["reasoning_effort"] = req.reasoning.effort
    data |= {k: extra[k] for k in PASSED_ON if k in extra}
    return chat_request(data)


def _turn_starts(conversation: list[dict[str, Any]]) -> list[int]:
    """Where each user turn starts (after the first): the places the oldest items can be
    cut so the rest still begins with a user message."""
    return [i for i, m in enumerate(conversation) if m["role"] == "user" and i > 0]


async def prepare_response(
    req: ResponsesRequest,
    conversation: list[dict[str, Any]],
    tools: ResponseTools,
    settings: Settings,
    engine: Engine,
) -> tuple[Prepared, list[dict[str, Any]]]:
    """The prepared request and the conversation it holds. With ``truncation: "auto"`` a
    conversation over the context loses its oldest turns (system messages stay) until the
    rest fits; otherwise, or when even the last turn does not fit, it is a 400."""
    try:
        return await prepare_chat(to_chat(req, conversation, tools), settings, engine), conversation
    except ContextLengthError as exc:
        exc.param = "input"
        if req.truncation != "auto":
            raise
        error = exc
    system = [m for m in conversation if m["role"] in ("system", "developer")]
    rest = [m for m in conversation if m["role"] not in ("system", "developer")]
    cuts = _turn_starts(rest)
    best: tuple[Prepared, list[dict[str, Any]]] | None = None
    lo, hi = 0, len(cuts) - 1  # binary search: the fewest turns dropped that fit
    while lo <= hi:
        mid = (lo + hi) // 2
        kept = system + rest[cuts[mid] :]
        try:
            best = await prepare_chat(to_chat(req, kept, tools), settings, engine), kept
            hi = mid - 1
        except ContextLengthError as exc:
            exc.param = "input"
            error, lo = exc, mid + 1
    if best is None:
        raise error
    return best
