"""Chat messages as the chat template wants them, and whether the answer should think."""

from __future__ import annotations

import json
from typing import Any

from dflash_server.api.errors import APIError
from dflash_server.api.images import VIDEO_PARTS, ImageRef, image_ref, video_unsupported
from dflash_server.api.types import ChatCompletionRequest, ChatMessage, TextPart


def template_messages(messages: list[ChatMessage]) -> tuple[list[dict[str, Any]], list[ImageRef]]:
    """Template-ready messages, and the images their parts hold, in prompt order."""
    images: list[ImageRef] = []
    return [template_message(m, i, images) for i, m in enumerate(messages)], images


# Where the chat template renders images: user turns, and tool results inside their
# <tool_response> block (docs/api.md, "Images").
IMAGE_ROLES = ("user", "tool")
_PARTS = {
    "user": "text and image_url",
    "tool": "text and image_url",
    "assistant": "text and refusal",
}


def template_message(msg: ChatMessage, index: int, images: list[ImageRef]) -> dict[str, Any]:
    """A template-ready message: text (and refusal) parts joined, 'developer' read as 'system';
    with images (user and tool messages), a list of text and image parts (as Qwen3.5's template
    renders them), each image's reference appended to ``images``."""
    content: Any = msg.content
    if isinstance(content, list):
        parts = [_template_part(msg.role, p, index, j, images) for j, p in enumerate(content)]
        content = _joined(parts)
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
        out["tool_calls"] = [history_call(c, index) for c in msg.tool_calls]
    return out


def _template_part(
    role: str, part: TextPart, index: int, j: int, images: list[ImageRef]
) -> dict[str, Any]:
    """Part ``j`` of message ``index`` as the template takes it: text, or an image whose
    reference is appended to ``images``."""
    where = f"messages.{index}.content.{j}"
    if part.type == "image_url":
        ref = image_ref(part.model_dump(), where)  # named as the request spelled it
        if role not in IMAGE_ROLES:
            raise APIError(
                400,
                f"{ref.part}: images are supported in user and tool messages, not in {role} "
                "messages",
                param=ref.param,
                code="unsupported_content",
            )
        images.append(ref)
        return {"type": "image"}
    if part.type in VIDEO_PARTS:
        raise video_unsupported(where)
    # An earlier assistant refusal is what the assistant said: it renders as text.
    text = part.refusal if part.type == "refusal" else part.text
    if part.type not in ("text", "refusal") or text is None:
        supported = _PARTS.get(role, "text")
        raise APIError(
            400,
            f"{where}: content part type {part.type!r} is not supported in {role} messages "
            f"({supported} parts are)",
            param=f"messages.{index}.content",
            code="unsupported_content",
        )
    return {"type": "text", "text": text}


def _joined(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Adjacent text parts joined; without images, the text alone."""
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    out: list[dict[str, Any]] = []
    for part in parts:
        if part["type"] == "text" and out and out[-1]["type"] == "text":
            out[-1] = {"type": "text", "text": out[-1]["text"] + part["text"]}
        else:
            out.append(part)
    return out


def merged_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The messages with every system message after the first turn merged, in order, into the
    leading system text; None when there are none to merge. For templates that only take a
    system message first (Qwen3.5's raises on one elsewhere)."""
    late = [i for i, m in enumerate(messages) if m["role"] == "system" and i > 0]
    if not late or all(messages[j]["role"] == "system" for j in range(max(late) + 1)):
        return None
    system = [m["content"] for m in messages if m["role"] == "system" and m["content"]]
    rest = [m for m in messages if m["role"] != "system"]
    return [{"role": "system", "content": "\n\n".join(system)}, *rest] if system else rest


def history_call(call: dict[str, Any], index: int) -> dict[str, Any]:
    """An assistant tool call from the history, its arguments as a mapping for the template."""
    function = call.get("function")
    fn: dict[str, Any] = function if isinstance(function, dict) else call
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


# reasoning_effort -> reasoning tokens before the server closes the think block (None: no
# limit of its own; the server's --max-thinking-tokens applies). "none"/"minimal": no thinking.
EFFORT_BUDGETS: dict[str, int | None] = {
    "low": 1024,
    "medium": 8192,
    "high": 32768,
    "xhigh": None,
}
_NO_THINKING = ("none", "minimal")


def _effort(req: ChatCompletionRequest) -> str | None:
    effort = req.reasoning_effort
    if effort is None:
        return None
    effort = effort.lower()
    if effort not in EFFORT_BUDGETS and effort not in _NO_THINKING:
        names = ", ".join(repr(e) for e in (*_NO_THINKING, *EFFORT_BUDGETS))
        raise APIError(
            400,
            f"reasoning_effort must be one of {names}",
            param="reasoning_effort",
            code="invalid_value",
        )
    return effort


def thinking_enabled(req: ChatCompletionRequest, default: bool) -> bool:
    """chat_template_kwargs.enable_thinking > enable_thinking > reasoning_effort > default."""
    kwargs = req.chat_template_kwargs or {}
    if "enable_thinking" in kwargs:
        return bool(kwargs["enable_thinking"])
    if req.enable_thinking is not None:
        return req.enable_thinking
    effort = _effort(req)
    if effort is not None:
        return effort not in _NO_THINKING
    return default


def thinking_budget(req: ChatCompletionRequest, default: int | None) -> int | None:
    """Reasoning tokens allowed: thinking_budget > reasoning_effort > the server's default."""
    if req.thinking_budget is not None:
        return req.thinking_budget
    effort = _effort(req)
    if effort in EFFORT_BUDGETS and EFFORT_BUDGETS[effort] is not None:
        return EFFORT_BUDGETS[effort]
    return default
