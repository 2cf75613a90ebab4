"""Parse Qwen3.5's XML tool calls out of streamed model text into OpenAI ``tool_calls``.

The format (docs/design.md, "The Qwen chat format")::

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

Values are raw text; their JSON type comes from the function's parameter schema. A call is
emitted whole once its closing tag arrives, so a malformed call can still fall back to plain text
(with a logged warning) instead of half-sent arguments; an unfinished one (cut by max_tokens) is
dropped, never returned as markup. A ``<tool_call>`` that another ``<tool_call>`` or the think-end
marker follows before its closing tag was stray (a model musing about the format in its
reasoning): it stays text, and the call after it is still parsed. One parser per request.
"""

from __future__ import annotations

import ast
import json
import logging
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("dflash_server")

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*\Z", re.S)
# Lenient on a missing </parameter>: the value then runs to the next parameter or the end.
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI sends it

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index, **out}


Piece = str | ToolCall


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def tool_schemas(tools: Sequence[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Function name -> its parameters schema, from OpenAI ``tools``."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out[fn["name"]] = params if isinstance(params, dict) else {}
    return out


def _types(schema: dict[str, Any] | None) -> list[str]:
    """The JSON types a (sub)schema allows, in order; empty when it says nothing."""
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    types = [kind] if isinstance(kind, str) else list(kind or [])
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(key) or []:
            types += [t for t in _types(sub) if t not in types]
    if not types and "enum" in schema:
        types = sorted({type(v).__name__ for v in schema["enum"]})
        types = [{"str": "string", "int": "integer", "float": "number"}.get(t, t) for t in types]
    if not types and "properties" in schema:
        types = ["object"]
    return types


def coerce_value(raw: str, schema: dict[str, Any] | None) -> Any:
    """Turn a parameter's text into the JSON value its schema asks for.

    Strings stay verbatim; anything that does not parse as the declared type stays a string
    (the client's validation then names the problem, instead of us guessing further).
    """
    types = _types(schema)
    text = raw.strip()
    if "null" in types and text.lower() in ("null", "none"):
        return None
    for kind in types:
        if kind == "string":
            return raw
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if kind == "integer" and re.fullmatch(r"[-+]?\d+", text):
            return int(text)
        if kind == "number":
            try:
                number = float(text)
            except ValueError:
                continue
            return int(number) if re.fullmatch(r"[-+]?\d+", text) else number
        if kind in ("object", "array"):
            value = _loads(text)
            if isinstance(value, dict if kind == "object" else list):
                return value
    if not types:  # no schema: JSON if it parses, else the text
        value = _loads(text)
        return raw if value is _FAIL else value
    return raw


_FAIL = object()


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:  # models sometimes write Python literals (single quotes, True/False)
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return _FAIL


def _strip_newline(value: str) -> str:
    """The template puts one newline around each value; the value itself keeps the rest."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def parse_call(body: str, schemas: dict[str, dict[str, Any]]) -> ToolCall | None:
    """The call inside ``<tool_call>...</tool_call>``; None if malformed."""
    match = _FUNCTION.match(body)
    if match is None:
        return None
    name, inner = match.group(1).strip(), match.group(2)
    if not name:
        return None
    leftover = _PARAMETER.sub("", inner)
    if leftover.strip():
        return None
    properties = (schemas.get(name) or {}).get("properties") or {}
    arguments = {}
    for m in _PARAMETER.finditer(inner):
        key = m.group(1).strip()
        arguments[key] = coerce_value(_strip_newline(m.group(2)), properties.get(key))
    if name not in schemas:
        log.warning("model called unknown tool %r; passing the call on", name)
    return ToolCall(
        f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(arguments, ensure_ascii=False)
    )


class ToolCallParser:
    """Incremental: ``feed`` text chunks, then ``finish`` once; both return pieces in order.

    A piece is text (safe to show: no markup, possibly a held-back tail released later) or a
    complete ToolCall. After a call, whitespace-only text is dropped (the model's separators).
    ``think_end``: the reasoning's closing marker, which no call contains (see the module doc).
    """

    def __init__(
        self,
        tools: Sequence[dict[str, Any]] | None,
        parallel: bool = True,
        think_end: str | None = "</think>",
    ) -> None:
        self.schemas = tool_schemas(tools)
        self.parallel = parallel
        self.calls: list[ToolCall] = []
        self.dropped = 0  # unfinished calls left out at the end
        self.text_after_call = False  # text (not whitespace) came after the last complete call
        self._breaks = (CALL_START, think_end) if think_end else (CALL_START,)
        self._buf = ""
        self._in_call = False
        self._space = ""  # whitespace after a call, kept until we know text follows

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        self._buf += text
        while True:
            if not self._in_call:
                i = self._buf.find(CALL_START)
                if i < 0:
                    keep = _partial_suffix(self._buf, CALL_START)
                    self._text(self._buf[: len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                self._text(self._buf[:i], out)
                self._buf, self._in_call = self._buf[i + len(CALL_START) :], True
            else:
                j = self._buf.find(CALL_END)
                stray = self._stray(len(self._buf) if j < 0 else j)
                if stray is not None:  # the open tag was text: give it back, look again
                    self._text(CALL_START + self._buf[:stray], out)
                    self._buf, self._in_call = self._buf[stray:], False
                    continue
                if j < 0:
                    return out
                body, self._buf = self._buf[:j], self._buf[j + len(CALL_END) :]
                self._in_call = False
                self._call(body, out)

    def _stray(self, end: int) -> int | None:
        """Where a marker no call contains starts in the open call's text before ``end``."""
        hits = [i for m in self._breaks if (i := self._buf.find(m, 0, end)) >= 0]
        return min(hits) if hits else None

    def finish(self, cut: bool = False) -> list[Piece]:
        """The rest, at the end of the output; ``cut``: it ended at max_tokens.

        An unclosed call is never returned as markup: parsed if it got as far as
        ``</function>`` (the model may stop right there), else dropped and counted in
        ``dropped``. So is a ``<tool_call>`` tag prefix when the output was cut.
        """
        out: list[Piece] = []
        if self._in_call:
            body, self._buf, self._in_call = self._buf, "", False
            call = parse_call(body, self.schemas) if "</function>" in body else None
            if call is None:
                self.dropped += 1
                log.warning("unfinished tool call dropped (%s)", "max_tokens" if cut else "ended")
            else:
                self._accept(call, out)
        elif cut and self._buf and CALL_START.startswith(self._buf):
            self._buf = ""
        self._text(self._buf, out)
        self._buf = ""
        return out

    def _text(self, text: str, out: list[Piece]) -> None:
        if not text:
            return
        if self.calls:
            if not text.strip():
                self._space += text
                return
            text, self._space = self._space + text, ""
            self.text_after_call = True
        out.append(text)

    def _call(self, body: str, out: list[Piece]) -> None:
        call = parse_call(body, self.schemas)
        if call is None:
            self._malformed(body, out)
            return
        self._accept(call, out)

    def _accept(self, call: ToolCall, out: list[Piece]) -> None:
        self._space, self.text_after_call = "", False
        if self.calls and not self.parallel:
            log.warning("parallel_tool_calls is false: dropping extra call to %r", call.name)
            return
        self.calls.append(call)
        out.append(call)

    def _malformed(self, body: str, out: list[Piece]) -> None:
        raw = CALL_START + body + CALL_END
        # Model text can quote the prompt: it reaches the log only at debug level.
        log.warning("malformed tool call from the model, returned as text")
        log.debug("the malformed tool call: %r", raw[:200])
        if self.calls:
            raw, self._space = self._space + raw, ""
            self.text_after_call = True
        out.append(raw)


def split_tool_calls(
    text: str, tools: Sequence[dict[str, Any]] | None, parallel: bool = True
) -> tuple[str, list[ToolCall]]:
    """Whole-text version: (text without the calls, calls)."""
    parser = ToolCallParser(tools, parallel)
    pieces = parser.feed(text) + parser.finish()
    return "".join(p for p in pieces if isinstance(p, str)), parser.calls
