"""The one answer path: a job's events through a protocol's ``Shaper``, and what shapers share.

``answer`` runs every API: streamed, the shaper's events go out as server-sent events;
otherwise the same events run to their end and ``Shaper.whole`` is the JSON body. The shapers
(``openai_events.py``, ``anthropic_events.py``, ``openai_responses_events.py``) share
``ChatText`` (model text -> reasoning, content and tool calls) and ``dflash_stats``.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.background import BackgroundTask

from dflash_server.api.errors import APIError
from dflash_server.api.prepare import Prepared
from dflash_server.chat.reasoning import ReasoningSplitter, Segment, think_markers
from dflash_server.chat.tool_calls import ToolCall, ToolCallParser
from dflash_server.engine.jobs import Event, Failed, Finished, Job, TextChunk
from dflash_server.settings import Settings

# How often a non-streaming request checks whether its client is still there.
DISCONNECT_POLL_S = 0.5


def dumps(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True)
class Wire:
    """How a protocol's events go out as server-sent events."""

    named: bool = False  # `event:` (the event's "type") + data, else a bare `data:` line
    done: str | None = None  # a last data line after the events (OpenAI's "[DONE]")
    ping: dict[str, Any] | None = None  # the keepalive event (None: an SSE comment)

    def item(self, event: dict[str, Any]) -> str | ServerSentEvent:
        # A bare string takes the response's "\n" separator; a ServerSentEvent keeps "\r\n".
        if self.named:
            return ServerSentEvent(data=dumps(event), event=event["type"])
        return dumps(event)

    def ping_event(self) -> ServerSentEvent:
        assert self.ping is not None
        return ServerSentEvent(data=dumps(self.ping), event=self.ping["type"])


class Shaper(Protocol):
    """One API's answer: a job's events in, that API's events out, and the whole body.

    Events are JSON objects; ``wire`` says how they are sent. A non-streamed answer calls the
    same methods (a failure then raises ``APIError`` instead of ``fail``).
    """

    wire: ClassVar[Wire]

    def start(self) -> list[dict[str, Any]]:
        """What goes out at once, before prefill, so clients see the stream is alive."""
        ...

    def feed(self, text: TextChunk) -> list[dict[str, Any]]:
        """The events new text makes (none while it is held back)."""
        ...

    def finish(self, done: Finished) -> list[dict[str, Any]]:
        """The events that close a successful answer."""
        ...

    def fail(self, failed: Failed) -> list[dict[str, Any]]:
        """A streamed failure as this API's error event."""
        ...

    def whole(self) -> dict[str, Any]:
        """The non-streamed body, once ``finish`` ran."""
        ...


async def answer(
    shaper: Shaper,
    job: Job,
    stream: bool,
    request: Request,
    settings: Settings,
    headers: dict[str, str] | None = None,
    on_end: Callable[[], None] | None = None,
) -> Response:
    """The HTTP answer to a submitted job: a stream of ``shaper``'s events, or its whole body
    (499 when the client left first; a failure raises ``APIError`` with the job's status).
    ``on_end``: called once the answer has ended, either way (it may be called twice)."""
    if stream:
        wire = shaper.wire
        return EventSourceResponse(
            sse_items(shaper, job, settings.stream_interval, on_end),
            ping=settings.keepalive,
            sep="\n",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"} | (headers or {}),
            ping_message_factory=wire.ping_event if wire.ping is not None else None,
            background=BackgroundTask(on_end) if on_end is not None else None,
        )
    events = _events(shaper, job, is_disconnected=request.is_disconnected)
    try:
        async with aclosing(events) as run:
            async for _ in run:
                pass
    except ClientGone:
        return Response(status_code=499)  # nobody reads this
    finally:
        if on_end is not None:
            on_end()
    return JSONResponse(shaper.whole(), headers=headers)


async def sse_items(
    shaper: Shaper, job: Job, interval: float, on_end: Callable[[], None] | None = None
) -> AsyncGenerator[Any, None]:
    """The stream's items; ``interval``: minimum seconds between text events."""
    try:
        async with aclosing(_events(shaper, job, interval=interval)) as events:
            async for event in events:
                yield shaper.wire.item(event)
        if shaper.wire.done is not None:
            yield shaper.wire.done
    finally:
        if on_end is not None:
            on_end()


async def _events(
    shaper: Shaper,
    job: Job,
    interval: float = 0.0,
    is_disconnected: Callable[[], Awaitable[bool]] | None = None,
) -> AsyncGenerator[dict[str, Any], None]:
    """The answer's events (``is_disconnected`` set: not streamed, a failure raises)."""
    for event in shaper.start():
        yield event
    finished = False
    events = job_events(job, interval=interval, is_disconnected=is_disconnected)
    async with aclosing(events) as stream:
        async for ev in stream:
            if isinstance(ev, TextChunk):
                out = shaper.feed(ev)
            elif isinstance(ev, Finished):
                finished, out = True, shaper.finish(ev)
            elif is_disconnected is not None:
                raise APIError(ev.status, ev.message, code=ev.code)
            else:
                out = shaper.fail(ev)
            for event in out:
                yield event
    if not finished and is_disconnected is not None:
        raise APIError(500, "generation ended without a final event", code="generation_failed")


class ClientGone(Exception):
    """The client of a non-streamed request went away."""


async def job_events(
    job: Job,
    *,
    interval: float = 0.0,
    is_disconnected: Callable[[], Awaitable[bool]] | None = None,
) -> AsyncGenerator[Event, None]:
    """A job's events in order, until its last; the job is cancelled when this ends early.

    Streams (``is_disconnected`` None) wait ``interval`` after each batch to send more text
    per event; otherwise the client is polled every DISCONNECT_POLL_S (ClientGone when it
    left). Iterate inside ``contextlib.aclosing`` so an early stop cancels the job at once.
    """
    last_sent = 0.0
    next_check = time.monotonic() + DISCONNECT_POLL_S
    try:
        while True:
            if is_disconnected is None:
                # At most one event per `interval` while tokens flow fast: each SSE event costs
                # the event loop far more than a token of text, and 20 ms is below perception.
                batch = await job.next_events(hold_until=last_sent + interval)
            else:
                batch = await job.next_events(timeout=DISCONNECT_POLL_S)
                if time.monotonic() >= next_check:  # by the clock: events may never pause
                    if await is_disconnected():
                        raise ClientGone
                    next_check = time.monotonic() + DISCONNECT_POLL_S
                if batch is None:
                    continue
            if not batch:
                return
            last_sent = time.monotonic()
            for ev in batch:
                yield ev
    finally:
        # Runs on normal end, when the client disconnects (the task is cancelled) and when the
        # reader stops early: a still-running job stops at its next cycle and frees the worker.
        job.cancel()


def dflash_stats(done: Finished) -> dict[str, Any]:
    """The ``dflash`` object of an answer: how it was generated (speculation, timings)."""
    out: dict[str, Any] = {"speculative": done.speculative}
    if done.stats is not None:
        out |= done.stats.as_dict()
    if done.speculative:
        out.setdefault("block_size", done.block_size)
    if done.timings is not None:
        out |= asdict(done.timings)
    return out


# A piece of an answer, in output order: reasoning or content text, or a complete tool call.
Part = Segment | ToolCall


class ChatText:
    """Model text -> reasoning, content and tool calls, incrementally and in output order.

    Tool calls are cut out first, so their markup never reaches either text field, also when
    the model calls from inside its reasoning; the rest is split at the think markers (not with
    thinking off: then it is all content). A call left unfinished at the end is dropped
    (counted in ``dropped``), never shown as markup. When a grammar writes the answer
    (``Prepared.forced``), only the answer's calls count: the reasoning is split off first and
    stays text, whatever markup it holds. The parts come out in the order the model wrote
    them whatever the text's chunking, so a stream and a whole answer hold the same blocks.
    """

    def __init__(self, prepared: Prepared, tokenizer: Any) -> None:
        start, end = think_markers(tokenizer)
        opens = prepared.request.reasoning.opens
        self.splitter = ReasoningSplitter(opens, start, end, thinking=prepared.thinking)
        self.tools = (
            ToolCallParser(prepared.tools, prepared.parallel_tool_calls, end)
            if prepared.tools
            else None
        )
        self.answer_calls_only = prepared.forced

    def feed(self, text: str) -> list[Part]:
        """The parts that are safe to send now."""
        if self.answer_calls_only:
            return self._answer_calls(self.splitter.feed(text))
        return self._split(self.tools.feed(text) if self.tools is not None else [text])

    def finish(self, reason: str) -> list[Part]:
        """What was held back, once the output ended with finish ``reason``."""
        cut = reason == "length"
        if self.answer_calls_only:
            return self._answer_calls(self.splitter.finish(), cut=cut)
        rest = self.tools.finish(cut) if self.tools is not None else []
        return _joined([*self._split(rest), *self.splitter.finish()])

    def _answer_calls(self, segments: list[Segment], cut: bool | None = None) -> list[Part]:
        """Calls out of the answer text only; ``cut`` set: the output's end."""
        if self.tools is None:
            return _joined(segments)
        parts: list[Part] = []
        for kind, text in segments:
            parts += [(kind, text)] if kind == "reasoning" else _content(self.tools.feed(text))
        if cut is not None:
            parts += _content(self.tools.finish(cut))
        return _joined(parts)

    def _split(self, pieces: list[str | ToolCall]) -> list[Part]:
        parts: list[Part] = []
        for piece in pieces:
            parts += [piece] if isinstance(piece, ToolCall) else self.splitter.feed(piece)
        return _joined(parts)

    @property
    def called(self) -> bool:
        return self.tools is not None and bool(self.tools.calls)

    @property
    def dropped(self) -> int:
        return self.tools.dropped if self.tools is not None else 0

    def outcome(self, reason: str) -> str:
        """How the answer ended, once ``finish`` ran: ``reason``, except that max_tokens cutting
        only an extra call (or the whitespace after a call) leaves a whole answer: "stop".

        The cut call is dropped (``dropped`` counts it): the calls before it are complete,
        and an agent can run them (an incomplete answer makes agent SDKs give up).
        """
        tools = self.tools
        if reason == "length" and tools is not None and tools.calls and not tools.text_after_call:
            return "stop"
        return reason

    def finish_reason(self, reason: str) -> str:
        reason = self.outcome(reason)
        return "tool_calls" if self.called and reason == "stop" else reason

    def stats(self, stats: dict[str, Any]) -> dict[str, Any]:
        """The ``dflash`` stats, saying when an unfinished call was left out."""
        return stats | {"dropped_tool_calls": self.dropped} if self.dropped else stats


def _content(pieces: list[str | ToolCall]) -> list[Part]:
    return [("content", p) if isinstance(p, str) else p for p in pieces]


def _joined(parts: Sequence[Part]) -> list[Part]:
    """``parts`` with neighbouring text of the same kind joined."""
    out: list[Part] = []
    for part in parts:
        last = out[-1] if out else None
        if isinstance(part, tuple) and isinstance(last, tuple) and last[0] == part[0]:
            out[-1] = (part[0], last[1] + part[1])
        else:
            out.append(part)
    return out
