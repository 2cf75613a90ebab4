"""The OpenAI Responses API (``POST /v1/responses``): requests and the response store.

A thin translation: ``input`` items (messages, ``function_call``, ``function_call_output``,
``reasoning``) after the stored conversation of ``previous_response_id``, with ``instructions``
as the system message, become the chat request they mean (tools, tool_choice, ``text.format``
as response_format, ``reasoning.effort`` as the thinking budget); ``prepare_chat`` turns it into
the same ``GenerationRequest`` as ``/v1/chat/completions``. The answer is shaped in
``openai_responses_events.py``.

``store`` (default true) keeps the response and its conversation in memory, in a bounded
least-recently-used store (``--responses-store`` entries), so a later request can continue it
with ``previous_response_id``; ``store: false`` keeps nothing.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from dflash_server.api.errors import APIError
from dflash_server.api.prepare import chat_request
from dflash_server.api.types import ChatCompletionRequest, _Request
from dflash_server.generation.sampling import MAX_INT

# DFlash and sampling extensions a Responses request may carry as extra fields.
_EXTENSIONS = ("block_size", "speculative", "seed", "top_k", "min_p", "repetition_penalty")
_EXTENSIONS += ("presence_penalty", "frequency_penalty", "thinking_budget", "enable_thinking")
# Fields that would change what is generated and that this server cannot honour.
_REFUSED = ("background", "conversation", "prompt", "top_logprobs")


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: dict[str, Any] | None = None


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    effort: str | None = None
    summary: str | None = None  # no summaries here: the reasoning itself is returned


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
    previous_response_id: str | None = None
    store: bool | None = True
    stream: bool | None = False
    metadata: dict[str, Any] | None = None


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


# ----- input items -> chat messages --------------------------------------------------------


def _content_text(content: Any, where: str) -> str:
    """The text of a message's content: a string, or input_text/output_text/refusal parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise APIError(400, "content must be a string or a list of parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("refusal" if kind == "refusal" else "text") if kind else None
        if kind not in ("input_text", "output_text", "text", "refusal") or not isinstance(
            text, str
        ):
            raise APIError(
                400,
                f"content part type {kind!r} is not supported; only text parts are",
                param=f"{where}.{j}",
                code="unsupported_content",
            )
        texts.append(text)
    return "".join(texts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages for ``input``; function calls join the assistant turn they belong to."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    reasoning: str | None = None  # a reasoning item belongs to the assistant turn after it
    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            message = {
                "role": item.get("role"),
                "content": _content_text(item.get("content"), f"{where}.content"),
            }
            if message["role"] == "assistant" and reasoning:
                message["reasoning_content"], reasoning = reasoning, None
            out.append(message)
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise APIError(400, "function_call items need name and call_id", param=where)
            function = {"name": item["name"], "arguments": item.get("arguments") or "{}"}
            call = {"id": item["call_id"], "type": "function", "function": function}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)
            else:
                turn = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning:
                    turn["reasoning_content"], reasoning = reasoning, None
                out.append(turn)
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _content_text(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind == "reasoning":
            parts = (item.get("content") or []) + (item.get("summary") or [])
            reasoning = "\n".join(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            raise APIError(
                400,
                f"input item type {kind!r} is not supported (message, function_call, "
                "function_call_output and reasoning are)",
                param=where,
                code="unsupported_content",
            )
    return out


def _tools(req: ResponsesRequest) -> dict[str, Any]:
    tools = []
    for i, tool in enumerate(req.tools or []):
        if tool.get("type") != "function":
            raise APIError(
                400,
                f"tool type {tool.get('type')!r} is not supported: only function tools are",
                param=f"tools.{i}",
                code="unsupported_tool",
            )
        keys = ("name", "description", "parameters", "strict")
        tools.append({"type": "function", "function": {k: tool[k] for k in keys if k in tool}})
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise APIError(
                400,
                "tool_choice must be 'auto', 'none', 'required' or "
                "{'type': 'function', 'name': ...}",
                param="tool_choice",
                code="invalid_value",
            )
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    out: dict[str, Any] = {"tools": tools or None, "parallel_tool_calls": req.parallel_tool_calls}
    if tools:
        out["tool_choice"] = choice
    return out


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if not fmt or fmt.get("type") != "json_schema":
        return fmt
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def conversation(store: ResponseStore, req: ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation so far: the stored one of ``previous_response_id``, then ``input``."""
    return previous(store, req.previous_response_id) + input_messages(req.input)


def to_chat(req: ResponsesRequest, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
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
        **_tools(req),
    }
    if req.reasoning is not None and req.reasoning.effort is not None:
        data["reasoning_effort"] = req.reasoning.effort
    data |= {k: extra[k] for k in _EXTENSIONS if k in extra}
    return chat_request(data)
