"""Anthropic Messages answers: ``thinking``, ``text`` and ``tool_use`` blocks, whole or streamed.

The model's text is split by ``ChatText`` (tool calls cut out, reasoning apart) into Anthropic
content blocks; the stream is Anthropic's event sequence (``message_start``, ``ping``, per block
``content_block_start``/``_delta``/``_stop``, ``message_delta``, ``message_stop``), each event
named by its payload's ``type``. A non-streamed answer is the same stream run to the end.

Stop sequences are the request's stop strings (matched by the generation's text stream, which
reports the one that ended it: ``stop_reason: "stop_sequence"``, ``stop_sequence``).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, ClassVar

from dflash_server.api.answers import ChatText, Part, Wire, dflash_stats
from dflash_server.api.anthropic import sign_thinking
from dflash_server.api.errors import anthropic_error
from dflash_server.api.prepare import Prepared
from dflash_server.chat.tool_calls import ToolCall
from dflash_server.engine.jobs import Failed, Finished, TextChunk

Event = dict[str, Any]  # its "type" is the SSE event name


class MessageShaper:
    """Job events -> Anthropic content blocks, the stream events that build them, the message."""

    wire: ClassVar[Wire] = Wire(named=True, ping={"type": "ping"})  # Anthropic's own keepalive

    def __init__(self, prepared: Prepared, tokenizer: Any, omit_thinking: bool = False) -> None:
        self.p = prepared
        self.chat = ChatText(prepared, tokenizer)
        self.blocks: list[dict[str, Any]] = []
        self.open: str | None = None  # type of the block being written ("thinking", "text")
        # thinking.display "omitted": thinking blocks carry no text, only a signature (which
        # holds the text, so the block sent back renders the same prompt; see anthropic.py).
        self.omit_thinking = omit_thinking
        self.hidden = ""
        self.message: dict[str, Any] = {
            "id": f"msg_{uuid.uuid4().hex}",
            "type": "message",
            "role": "assistant",
            "model": prepared.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(prepared, None),
        }

    def start(self) -> list[Event]:
        return [{"type": "message_start", "message": dict(self.message)}, {"type": "ping"}]

    def feed(self, text: TextChunk) -> list[Event]:
        return self._parts(self.chat.feed(text.text))

    def finish(self, done: Finished) -> list[Event]:
        """The held-back text, the last block closed, then the message's end."""
        reason = done.finish_reason
        events = self._parts(self.chat.finish(reason)) + self._close()
        self.message |= {
            "content": self.blocks,
            "stop_reason": self.stop_reason(reason, done.stop_sequence),
            "stop_sequence": done.stop_sequence,
            "usage": _usage(self.p, done),
            "dflash": self.chat.stats(dflash_stats(done)),
        }
        delta = {"stop_reason": self.message["stop_reason"], "stop_sequence": done.stop_sequence}
        return [
            *events,
            {"type": "message_delta", "delta": delta, "usage": self.message["usage"]},
            {"type": "message_stop"},
        ]

    def fail(self, failed: Failed) -> list[Event]:
        return [anthropic_error(failed.status, failed.message)]

    def whole(self) -> dict[str, Any]:
        return self.message

    def stop_reason(self, reason: str, stop_sequence: str | None) -> str:
        if stop_sequence is not None:
            return "stop_sequence"
        if self.chat.outcome(reason) == "length":
            return "max_tokens"
        return "tool_use" if self.chat.called else "end_turn"

    def _parts(self, parts: list[Part]) -> list[Event]:
        events: list[Event] = []
        for part in parts:
            if isinstance(part, ToolCall):
                events += self._call(part)
            else:
                kind, text = part
                events += self._append("text" if kind == "content" else "thinking", text)
        return events

    def _call(self, call: ToolCall) -> list[Event]:
        events = self._close()
        block = {"type": "tool_use", "id": f"toolu_{call.id.removeprefix('call_')}"}
        block |= {"name": call.name, "input": json.loads(call.arguments)}
        self.blocks.append(block)
        index = len(self.blocks) - 1
        return [
            *events,
            _start(index, block | {"input": {}}),
            _delta(index, {"type": "input_json_delta", "partial_json": call.arguments}),
            {"type": "content_block_stop", "index": index},
        ]

    def _append(self, kind: str, text: str) -> list[Event]:
        if not text:
            return []
        events: list[Event] = []
        if self.open != kind:
            events += self._close()
            block = {"type": kind, kind: ""} | ({"signature": ""} if kind == "thinking" else {})
            self.blocks.append(block)
            self.open = kind
            events.append(_start(len(self.blocks) - 1, dict(block)))
        if kind == "thinking" and self.omit_thinking:
            self.hidden += text
            return events
        self.blocks[-1][kind] += text
        delta_type = "thinking_delta" if kind == "thinking" else "text_delta"
        return [*events, _delta(len(self.blocks) - 1, {"type": delta_type, kind: text})]

    def _close(self) -> list[Event]:
        if self.open is None:
            return []
        index, events = len(self.blocks) - 1, []
        if self.open == "thinking" and self.omit_thinking:
            signature, self.hidden = sign_thinking(self.hidden), ""
            self.blocks[-1]["signature"] = signature
            events.append(_delta(index, {"type": "signature_delta", "signature": signature}))
        self.open = None
        return [*events, {"type": "content_block_stop", "index": index}]


def _start(index: int, block: dict[str, Any]) -> Event:
    return {"type": "content_block_start", "index": index, "content_block": block}


def _delta(index: int, delta: dict[str, Any]) -> Event:
    return {"type": "content_block_delta", "index": index, "delta": delta}


def _usage(prepared: Prepared, done: Finished | None) -> dict[str, int]:
    """Anthropic counts cache reads apart: input_tokens is what had to be prefilled."""
    cached = done.cached_tokens if done is not None else 0
    return {
        "input_tokens": len(prepared.request.prompt) - cached,
        "output_tokens": done.completion_tokens if done is not None else 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }
