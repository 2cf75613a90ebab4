"""Anthropic Messages answers: ``thinking``, ``text`` and ``tool_use`` blocks, whole or streamed.

The model's text is split by ``ChatText`` (tool calls cut out, reasoning apart) into Anthropic
content blocks; the stream is Anthropic's event sequence (``message_start``, ``ping``, per block
``content_block_start``/``_delta``/``_stop``, ``message_delta``, ``message_stop``).

Stop sequences are the request's stop strings (matched by the generation's text stream, which
reports the one that ended it: ``stop_reason: "stop_sequence"``, ``stop_sequence``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from sse_starlette import ServerSentEvent

from dflash_server.api.answers import ChatText, dflash_stats, dumps, job_events, run_to_end
from dflash_server.api.anthropic import sign_thinking
from dflash_server.api.errors import APIError, anthropic_error
from dflash_server.api.prepare import Prepared
from dflash_server.chat.tool_calls import ToolCall
from dflash_server.engine.jobs import Failed, Finished, Job, TextChunk

Event = tuple[str, dict[str, Any]]  # (event name, payload)


class MessageShaper:
    """Model text -> Anthropic content blocks, and the stream events that build them."""

    def __init__(self, prepared: Prepared, tokenizer: Any, omit_thinking: bool = False) -> None:
        self.chat = ChatText(prepared, tokenizer)
        self.blocks: list[dict[str, Any]] = []
        self.open: str | None = None  # type of the block being written ("thinking", "text")
        self.tokens = 0
        # thinking.display "omitted": thinking blocks carry no text, only a signature (which
        # holds the text, so the block sent back renders the same prompt; see anthropic.py).
        self.omit_thinking = omit_thinking
        self.hidden = ""

    def feed(self, ev: TextChunk) -> list[Event]:
        self.tokens += ev.tokens
        return self._pieces(*self.chat.feed(ev.text))

    def finish(self, reason: str) -> list[Event]:
        return self._pieces(*self.chat.finish(reason)) + self._close()

    def stop_reason(self, reason: str, stop_sequence: str | None) -> str:
        if stop_sequence is not None:
            return "stop_sequence"
        if self.chat.outcome(reason) == "length":
            return "max_tokens"
        return "tool_use" if self.chat.called else "end_turn"

    def _pieces(self, reasoning: str, content: str, calls: list[ToolCall]) -> list[Event]:
        events = self._append("thinking", reasoning) + self._append("text", content)
        for call in calls:
            events += self._close()
            block = {"type": "tool_use", "id": f"toolu_{call.id.removeprefix('call_')}"}
            block |= {"name": call.name, "input": json.loads(call.arguments)}
            self.blocks.append(block)
            index = len(self.blocks) - 1
            events += [
                _start(index, block | {"input": {}}),
                _delta(index, {"type": "input_json_delta", "partial_json": call.arguments}),
                ("content_block_stop", {"type": "content_block_stop", "index": index}),
            ]
        return events

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
        return [*events, ("content_block_stop", {"type": "content_block_stop", "index": index})]


def _start(index: int, block: dict[str, Any]) -> Event:
    return "content_block_start", {
        "type": "content_block_start",
        "index": index,
        "content_block": block,
    }


def _delta(index: int, delta: dict[str, Any]) -> Event:
    return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}


def _usage(prepared: Prepared, output_tokens: int, done: Finished | None) -> dict[str, int]:
    """Anthropic counts cache reads apart: input_tokens is what had to be prefilled."""
    cached = done.cached_tokens if done is not None else 0
    return {
        "input_tokens": len(prepared.request.prompt) - cached,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


class _Run:
    """One Messages request against its job: the events, and the whole message at the end."""

    def __init__(self, prepared: Prepared, job: Job, tokenizer: Any, omit_thinking: bool):
        self.p, self.job = prepared, job
        self.shaper = MessageShaper(prepared, tokenizer, omit_thinking)
        self.message: dict[str, Any] = {
            "id": f"msg_{uuid.uuid4().hex}",
            "type": "message",
            "role": "assistant",
            "model": prepared.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(prepared, 0, None),
        }

    async def events(
        self,
        interval: float = 0.0,
        is_disconnected: Callable[[], Awaitable[bool]] | None = None,
    ) -> AsyncGenerator[Event, None]:
        """The stream's events; at the end ``self.message`` is the whole answer."""
        yield "message_start", {"type": "message_start", "message": dict(self.message)}
        yield "ping", {"type": "ping"}
        done: Finished | None = None
        events = job_events(self.job, interval=interval, is_disconnected=is_disconnected)
        async with aclosing(events) as stream:
            async for ev in stream:
                if isinstance(ev, TextChunk):
                    for event in self.shaper.feed(ev):
                        yield event
                elif isinstance(ev, Finished):
                    done = ev
                elif isinstance(ev, Failed):
                    if is_disconnected is not None:
                        raise APIError(ev.status, ev.message, code=ev.code)
                    yield "error", anthropic_error(ev.status, ev.message)
                    return
        reason = done.finish_reason if done is not None else "stop"
        for event in self.shaper.finish(reason):
            yield event
        tokens = done.completion_tokens if done is not None else self.shaper.tokens
        stop_sequence = done.stop_sequence if done is not None else None
        self.message |= {
            "content": self.shaper.blocks,
            "stop_reason": self.shaper.stop_reason(reason, stop_sequence),
            "stop_sequence": stop_sequence,
            "usage": _usage(self.p, tokens, done),
        }
        if done is not None:
            self.message["dflash"] = self.shaper.chat.stats(dflash_stats(done))
        delta = {"stop_reason": self.message["stop_reason"], "stop_sequence": stop_sequence}
        yield (
            "message_delta",
            {"type": "message_delta", "delta": delta, "usage": self.message["usage"]},
        )
        yield "message_stop", {"type": "message_stop"}


async def stream_messages(
    prepared: Prepared, job: Job, tokenizer: Any, interval: float, omit_thinking: bool = False
) -> AsyncGenerator[ServerSentEvent, None]:
    """A Messages stream as server-sent events (``event:`` names and JSON data)."""
    run = _Run(prepared, job, tokenizer, omit_thinking)
    async for name, payload in run.events(interval):
        yield ServerSentEvent(data=dumps(payload), event=name)


def ping() -> ServerSentEvent:
    """Anthropic's keepalive event (sent while a long prompt is prefilled)."""
    return ServerSentEvent(data='{"type":"ping"}', event="ping")


async def collect_message(
    prepared: Prepared,
    job: Job,
    tokenizer: Any,
    is_disconnected: Callable[[], Awaitable[bool]],
    omit_thinking: bool = False,
) -> dict[str, Any] | None:
    """The whole message; None if the client went away."""
    run = _Run(prepared, job, tokenizer, omit_thinking)
    return run.message if await run_to_end(run.events(is_disconnected=is_disconnected)) else None
