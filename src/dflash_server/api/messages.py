"""Chat messages as the chat template wants them, and whether the answer should think."""

from __future__ import annotations

import json
from typing import Any

from dflash_server.api.errors import APIError
from dflash_server.api.types import ChatCompletionRequest, ChatMessage


def template_message(msg: ChatMessage, index: int) -> dict[str, Any]:
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
        out["tool_calls"] = [history_call(c, index) for c in msg.tool_calls]
    return out


def history_call(call: dict[str, Any], index: int) -> dict[str, Any]:
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


def thinking_enabled(req: ChatCompletionRequest, default: bool) -> bool:
    """chat_template_kwargs.enable_thinking > enable_thinking > reasoning_effort > default."""
    kwargs = req.chat_template_kwargs or {}
    if "enable_thinking" in kwargs:
        return bool(kwargs["enable_thinking"])
    if req.enable_thinking is not None:
        return req.enable_thinking
    if req.reasoning_effort is not None:
        return req.reasoning_effort.lower() not in ("none", "minimal")
    return default
