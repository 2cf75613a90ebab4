"""Responses API ``input`` items as the chat messages they mean.

Messages (any role: developer and system ones render as system text; ``input_image`` parts
become chat image parts), ``function_call`` items (joined to the assistant turn they belong
to; namespaced ones under the name the prompt gives them), ``function_call_output`` items as
tool results (text and ``input_image`` parts alike), and ``reasoning`` items as the reasoning
of the assistant turn after them. Every malformed field is a 400 naming it.
"""

from __future__ import annotations

from typing import Any

from dflash_server.api.errors import APIError
from dflash_server.api.images import PART_KEY
from dflash_server.api.openai_responses_tools import ResponseTools


def _part_text(part: Any, where: str) -> str:
    """The text of an input_text/output_text/refusal part."""
    kind = part.get("type") if isinstance(part, dict) else None
    text = part.get("refusal" if kind == "refusal" else "text") if kind else None
    if kind not in ("input_text", "output_text", "text", "refusal") or not isinstance(text, str):
        raise APIError(
            400,
            f"{where}: content part type {kind!r} is not supported (input_text, output_text, "
            "refusal and input_image parts are)",
            param=where,
            code="unsupported_content",
        )
    return text


def _content_text(content: Any, where: str) -> str:
    """The text of a message's content: a string, or input_text/output_text/refusal parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise APIError(400, "content must be a string or a list of parts", param=where)
    return "".join(_part_text(part, f"{where}.{j}") for j, part in enumerate(content))


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "input_image"


def _image_part(part: dict[str, Any], where: str) -> dict[str, Any]:
    """An input_image part as the chat image part it means."""
    if part.get("file_id") is not None:
        raise APIError(
            400,
            f"{where}.file_id: files are not supported; send image_url (a data URL or an "
            "http(s) URL)",
            param=f"{where}.file_id",
            code="unsupported_content",
        )
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise APIError(
            400,
            f"{where}.image_url must be a data URL or an http(s) URL",
            param=f"{where}.image_url",
        )
    image = {"url": url, "detail": part.get("detail")}
    return {"type": "image_url", "image_url": image, PART_KEY: where}


def _message_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content as chat content: its text, or with images, text and image parts."""
    if not isinstance(content, list) or not any(_is_image(p) for p in content):
        return _content_text(content, where)
    return [
        _image_part(p, f"{where}.{j}")
        if _is_image(p)
        else {"type": "text", "text": _part_text(p, f"{where}.{j}")}
        for j, p in enumerate(content)
    ]


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """The text of a reasoning item: its ``content`` (reasoning_text parts), else its
    ``summary`` (summary_text parts)."""
    texts = []
    for key in ("content", "summary"):
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list):
            raise APIError(400, f"{where}.{key} must be a list of parts", param=f"{where}.{key}")
        for j, part in enumerate(parts):
            if not isinstance(part, dict) or not isinstance(part.get("text"), str):
                raise APIError(
                    400,
                    f"{where}.{key}.{j} must be a part with a string 'text'",
                    param=f"{where}.{key}.{j}",
                    code="invalid_value",
                )
            texts.append(part["text"])
        if texts:
            break
    return "\n".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    if not isinstance(item.get(key), str):
        raise APIError(400, f"{where}.{key} must be a string", param=f"{where}.{key}")
    return item[key]


_ROLES = ("user", "assistant", "system", "developer")


def input_messages(
    items: str | list[dict[str, Any]], tools: ResponseTools | None = None
) -> list[dict[str, Any]]:
    """Chat messages for ``input``; function calls join the assistant turn they belong to
    (namespaced ones under the name the prompt gives them)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    tools = tools or ResponseTools()
    out: list[dict[str, Any]] = []
    reasoning: str | None = None  # a reasoning item belongs to the assistant turn after it
    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            if item.get("role") not in _ROLES:
                raise APIError(
                    400,
                    f"{where}.role must be one of {', '.join(_ROLES)}",
                    param=f"{where}.role",
                    code="invalid_value",
                )
            message = {
                "role": item["role"],
                "content": _message_content(item.get("content"), f"{where}.content"),
            }
            if message["role"] == "assistant" and reasoning:
                message["reasoning_content"], reasoning = reasoning, None
            out.append(message)
        elif kind == "function_call":
            name, call_id = _string(item, "name", where), _string(item, "call_id", where)
            namespace = item.get("namespace")
            if namespace is not None and not isinstance(namespace, str):
                raise APIError(
                    400, f"{where}.namespace must be a string", param=f"{where}.namespace"
                )
            arguments = item.get("arguments") or "{}"
            if not isinstance(arguments, str):
                raise APIError(
                    400, f"{where}.arguments must be a JSON string", param=f"{where}.arguments"
                )
            function = {"name": tools.flat(name, namespace), "arguments": arguments}
            call = {"id": call_id, "type": "function", "function": function}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)
            else:
                turn = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning:
                    turn["reasoning_content"], reasoning = reasoning, None
                out.append(turn)
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            # Its parts as a message's: input_image parts (Codex's view_image) render inside
            # the tool response (docs/api.md, "Images").
            output = _message_content(item.get("output"), f"{where}.output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            reasoning = _reasoning_text(item, where)
        else:
            raise APIError(
                400,
                f"input item type {kind!r} is not supported (message, function_call, "
                "function_call_output and reasoning are)",
                param=where,
                code="unsupported_content",
            )
    return out
