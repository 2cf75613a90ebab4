"""The Anthropic Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``).

Requests: a thin translation. A Messages request becomes the chat request it means (system,
messages with their tool calls and results, tools, tool_choice, thinking), which
``prepare_chat`` turns into the same ``GenerationRequest`` as ``/v1/chat/completions``: same
template, speculation, grammar and thinking budget. The answer is shaped in
``anthropic_events.py``.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from dflash_server.api.errors import APIError
from dflash_server.api.images import PART_KEY
from dflash_server.api.prepare import chat_request
from dflash_server.api.tool_checks import check_function, check_parameters
from dflash_server.api.types import ChatCompletionRequest, _Request, extensions
from dflash_server.generation.sampling import MAX_INT


class Block(BaseModel):
    """A content block: ``text``, ``image``, ``tool_use``, ``tool_result``, ``thinking``
    (others: 400)."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    thinking: str | None = None  # thinking (its signature is ignored)
    source: dict[str, Any] | None = None  # image: base64 data or a URL


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant", "system"]  # system: rendered as the chat API renders it
    content: str | list[Block]


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(..., min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # None or "custom"; server tools (web search, ...) are refused


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool"
    disable_parallel_tool_use: bool | None = None


class Thinking(BaseModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0, le=MAX_INT)
    display: Literal["summarized", "omitted"] | None = None  # omitted: blocks without text


class OutputFormat(BaseModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(..., alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="allow")  # effort: the thinking settings decide here
    format: OutputFormat | None = None


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: str | None = None


class CountTokensRequest(_Request):
    """``/v1/messages/count_tokens``: what the prompt of a Messages request would hold."""

    model: str | None = None
    messages: list[Message] = Field(..., min_length=1)
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(..., ge=1, le=MAX_INT)
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None  # user_id: ignored
    output_config: OutputConfig | None = None

    @property
    def omit_thinking(self) -> bool:
        return self.thinking is not None and self.thinking.display == "omitted"

    @field_validator("stop_sequences")
    @classmethod
    def _non_empty(cls, value: list[str] | None) -> list[str] | None:
        if value and any(not s for s in value):
            raise ValueError("stop sequences must be non-empty")
        return value


# ----- request -> chat request -------------------------------------------------------------

# Thinking blocks sent without their text (display "omitted") carry it in their signature, so
# the block a client sends back renders the reasoning as it was.
_SIGNED = "dflash-thinking:"


def sign_thinking(text: str) -> str:
    return _SIGNED + base64.b64encode(text.encode()).decode()


def _thinking(block: Block) -> str:
    """A thinking block's text: shown, or kept in a signature from this server."""
    signature = (block.model_extra or {}).get("signature")
    if block.thinking or not isinstance(signature, str) or not signature.startswith(_SIGNED):
        return block.thinking or ""
    try:
        return base64.b64decode(signature[len(_SIGNED) :], validate=True).decode()
    except ValueError:
        return ""


# The block types each place takes, named in the 400 for any other.
_IN_USER = "a user message", "text, image and tool_result"
_IN_ASSISTANT = "an assistant message", "text, thinking, redacted_thinking and tool_use"
_IN_TOOL_RESULT = "a tool_result", "text and image"
_IN_SYSTEM = "a system prompt", "text"


def _unsupported(kind: str, where: str, place: tuple[str, str]) -> APIError:
    name, supported = place
    return APIError(
        400,
        f"{where}: content block type {kind!r} is not supported in {name} ({supported} blocks are)",
        param=where,
        code="unsupported_content",
    )


def _text(blocks: str | list[Any] | None, where: str) -> str:
    """The text of a system prompt: a string or a list of text blocks (as dicts or Blocks)."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    texts = []
    for j, block in enumerate(blocks):
        b = block if isinstance(block, dict) else block.model_dump()
        if b.get("type") != "text":
            raise _unsupported(str(b.get("type")), f"{where}.{j}", _IN_SYSTEM)
        texts.append(_block_text(b, f"{where}.{j}"))
    return "\n\n".join(texts)


def _block_text(block: dict[str, Any], where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise APIError(400, f"{where}.text must be a string", param=f"{where}.text")
    return block["text"]


def _image_part(source: Any, where: str) -> dict[str, Any]:
    """An image block's source as the chat image part it means (base64 data becomes a data
    URL)."""
    source = source if isinstance(source, dict) else {}  # a tool_result's blocks are unchecked
    if source.get("type") == "base64":
        media = source.get("media_type") or "image/png"
        url = f"data:{media};base64,{source.get('data') or ''}"
    elif source.get("type") == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise APIError(
            400,
            f"{where}.source: an image source is base64 (media_type, data) or url; file "
            "sources are not supported",
            param=f"{where}.source",
            code="invalid_value",
        )
    return {"type": "image_url", "image_url": {"url": url}, PART_KEY: where}


def _content(pieces: list[Any], sep: str) -> str | list[dict[str, Any]]:
    """Text strings and image parts as chat content: the texts joined by ``sep``; with images,
    text and image parts in order (adjacent texts joined the same way)."""
    if all(isinstance(p, str) for p in pieces):
        return sep.join(pieces)
    parts: list[dict[str, Any]] = []
    for piece in pieces:
        if isinstance(piece, str) and parts and parts[-1]["type"] == "text":
            parts[-1]["text"] += sep + piece
        else:
            parts.append({"type": "text", "text": piece} if isinstance(piece, str) else piece)
    return parts


def _tool_message(block: Block, where: str) -> dict[str, Any]:
    """A tool_result block as the tool message it means: its text blocks joined by blank lines,
    its images in place (rendered inside <tool_response>, docs/api.md "Images"); ``is_error``
    results start with "Error: "."""
    pieces: list[Any] = []
    if block.content is None or isinstance(block.content, str):
        pieces.append(block.content or "")
    for k, item in enumerate(block.content if isinstance(block.content, list) else []):
        at, kind = f"{where}.content.{k}", item.get("type")
        if kind == "text":
            pieces.append(_block_text(item, at))
        elif kind == "image":
            pieces.append(_image_part(item.get("source"), at))
        else:
            raise _unsupported(str(kind), at, _IN_TOOL_RESULT)
    if block.is_error and pieces and isinstance(pieces[0], str):
        pieces[0] = f"Error: {pieces[0]}"
    elif block.is_error:
        pieces.insert(0, "Error: ")
    content = _content(pieces, "\n\n")
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": content}


def _user_messages(msg: Message, where: str) -> list[dict[str, Any]]:
    """A user turn: its tool results as tool messages, its text and images as a user message."""
    if isinstance(msg.content, str):
        return [{"role": "user", "content": msg.content}]
    out: list[dict[str, Any]] = []
    texts: list[Any] = []  # text strings and image parts, in order
    for j, block in enumerate(msg.content):
        if block.type == "text":
            texts.append(block.text or "")
        elif block.type == "image":
            texts.append(_image_part(block.source, f"{where}.content.{j}"))
        elif block.type == "tool_result":
            if texts:
                out.append({"role": "user", "content": _content(texts, "\n")})
                texts = []
            out.append(_tool_message(block, f"{where}.content.{j}"))
        else:
            raise _unsupported(block.type, f"{where}.content.{j}", _IN_USER)
    if texts or not out:
        out.append({"role": "user", "content": _content(texts, "\n")})
    return out


def _assistant_message(msg: Message, where: str) -> dict[str, Any]:
    """An assistant turn: text, reasoning and tool calls, as the chat template renders them."""
    if isinstance(msg.content, str):
        return {"role": "assistant", "content": msg.content}
    texts, thoughts, calls = [], [], []
    for j, block in enumerate(msg.content):
        if block.type == "text":
            texts.append(block.text or "")
        elif block.type == "thinking":
            thoughts.append(_thinking(block))
        elif block.type == "tool_use":
            if not block.name or not isinstance(block.input, dict | None):
                raise APIError(
                    400,
                    "tool_use blocks need a name and an object input",
                    param=f"{where}.content.{j}",
                )
            function = {"name": block.name, "arguments": block.input or {}}
            calls.append({"id": block.id, "type": "function", "function": function})
        elif block.type != "redacted_thinking":
            raise _unsupported(block.type, f"{where}.content.{j}", _IN_ASSISTANT)
    out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if thoughts:
        out["reasoning_content"] = "\n".join(thoughts)
    if calls:
        out["tool_calls"] = calls
    return out


def _tool_policy(req: CountTokensRequest) -> dict[str, Any]:
    tools = []
    for i, tool in enumerate(req.tools or []):
        if tool.type not in (None, "custom"):
            raise APIError(
                400,
                f"tool type {tool.type!r} is not supported: only client tools with an "
                "input_schema are",
                param=f"tools.{i}",
                code="unsupported_tool",
            )
        where = f"tools.{i}"
        check_function(tool.name, tool.input_schema, f"{where}.name", f"{where}.input_schema")
        function = {"name": tool.name, "parameters": tool.input_schema or {"type": "object"}}
        if tool.description:
            function["description"] = tool.description
        tools.append({"type": "function", "function": function})
    out: dict[str, Any] = {"tools": tools or None}
    choice = req.tool_choice or ToolChoice(type="auto")
    mapped: Any = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type)
    if choice.type == "any" and not tools:
        raise APIError(400, "tool_choice 'any' needs tools", param="tool_choice.type")
    if choice.type == "tool":
        if choice.name not in {t.name for t in req.tools or []}:
            raise APIError(
                400,
                f"tool_choice.name {str(choice.name)[:80]!r} is not among the tools",
                param="tool_choice.name",
                code="invalid_value",
            )
        mapped = {"type": "function", "function": {"name": choice.name}}
    if tools:
        out["tool_choice"] = mapped
    if choice.disable_parallel_tool_use:
        out["parallel_tool_calls"] = False
    return out


def to_chat(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request a Messages (or count_tokens) request means."""
    messages: list[dict[str, Any]] = []
    system = _text(req.system, "system") if req.system is not None else ""
    if system:
        messages.append({"role": "system", "content": system})
    for i, msg in enumerate(req.messages):
        where = f"messages.{i}"
        if msg.role == "user":
            messages += _user_messages(msg, where)
        elif msg.role == "system":
            messages.append({"role": "system", "content": _text(msg.content, f"{where}.content")})
        else:
            messages.append(_assistant_message(msg, where))
    data: dict[str, Any] = {"model": req.model, "messages": messages, **_tool_policy(req)}
    if req.thinking is not None:
        data["enable_thinking"] = req.thinking.type != "disabled"
        if req.thinking.type == "enabled" and req.thinking.budget_tokens is not None:
            data["thinking_budget"] = req.thinking.budget_tokens
    if isinstance(req, MessagesRequest):
        data |= {"max_tokens": req.max_tokens, "stream": req.stream, "stop": req.stop_sequences}
        fmt = req.output_config.format if req.output_config is not None else None
        if fmt is not None:
            check_parameters(fmt.schema_, "output_config.format.schema", object_only=False)
            spec = {"name": "output", "schema": fmt.schema_}
            data["response_format"] = {"type": "json_schema", "json_schema": spec}
        data |= {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k}
    extra = req.model_extra or {}
    data |= {k: extra[k] for k in extensions(type(req)) if k in extra}
    return chat_request(data)
