"""Turn a running engine job into OpenAI responses: whole objects or SSE chunk streams.

Streams follow OpenAI exactly: the first chat chunk carries the role, the last choice chunk
carries ``finish_reason`` (and our ``dflash`` stats), an optional usage chunk with no choices
follows when ``stream_options.include_usage`` is set, then ``data: [DONE]``. Tool calls go out
as ``delta.tool_calls[index]`` (each call whole, once parsed); logprobs ride on the chunk that
carries their tokens' text (or the next one, when text is held back).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from dflash_server.api.errors import APIError
from dflash_server.api.prepare import Prepared
from dflash_server.engine.jobs import Failed, Finished, Job, TextChunk
from dflash_server.engine.logprobs import TokenLogprob, chat_logprobs, completion_logprobs
from dflash_server.engine.reasoning import ReasoningSplitter, think_markers
from dflash_server.engine.tool_calls import ToolCall, ToolCallParser

DONE = "[DONE]"
# How often a non-streaming request checks whether its client is still there.
DISCONNECT_POLL_S = 0.5


def _dumps(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _usage(done: Finished) -> dict[str, int]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
    }


def _error(ev: Failed) -> dict[str, Any]:
    kind = "service_unavailable" if ev.status == 503 else "server_error"
    return {"error": {"message": ev.message, "type": kind, "param": None, "code": ev.code}}


class ChatText:
    """Model text -> reasoning, content and tool calls, incrementally.

    Tool calls are cut out first, so their markup never reaches either text field, also when
    the model calls from inside its reasoning; the rest is split at the think markers.
    """

    def __init__(self, prepared: Prepared, tokenizer: Any) -> None:
        start, end = think_markers(tokenizer)
        self.splitter = ReasoningSplitter(prepared.request.reasoning.opens, start, end)
        self.tools = (
            ToolCallParser(prepared.tools, prepared.parallel_tool_calls) if prepared.tools else None
        )

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[ToolCall]]:
        if self.tools is None:
            pieces: list[str | ToolCall] = [text]
        else:
            pieces = self.tools.feed(text) + (self.tools.finish() if final else [])
        reasoning, content, calls = "", "", []
        for piece in pieces:
            if isinstance(piece, ToolCall):
                calls.append(piece)
                continue
            r, c = self.splitter.feed(piece)
            reasoning, content = reasoning + r, content + c
        if final:
            r, c = self.splitter.finish()
            reasoning, content = reasoning + r, content + c
        return reasoning, content, calls

    def finish_reason(self, reason: str) -> str:
        called = self.tools is not None and self.tools.calls
        return "tool_calls" if called and reason == "stop" else reason


class _Stream:
    """Shared chunk framing for chat and text completion streams."""

    def __init__(self, prepared: Prepared, job: Job, tokenizer: Any, interval: float) -> None:
        self.p, self.job, self.interval = prepared, job, interval
        chat = prepared.kind == "chat"
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.object = "chat.completion.chunk" if chat else "text_completion"
        self.created = int(time.time())
        self.chat = ChatText(prepared, tokenizer) if chat else None
        self.calls = 0  # tool calls sent so far (their delta index)
        self.sent = 0  # length of the token strings sent so far (logprobs text_offset)
        self.logprobs: list[TokenLogprob] | None = (
            [] if prepared.request.logprobs is not None else None
        )

    def chunk(self, choice: dict[str, Any], **extra: Any) -> str:
        base = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.p.model,
            "choices": [choice] if choice else [],
        }
        return _dumps(base | extra)

    def _take_logprobs(self) -> dict[str, Any] | None:
        """The logprobs not yet sent, in this endpoint's shape (None when not asked for)."""
        if self.logprobs is None:
            return None
        entries, self.logprobs = self.logprobs, []
        if self.chat is not None:
            return chat_logprobs(entries)
        out = completion_logprobs(entries, self.sent)
        self.sent += sum(len(e.token) for e in entries)
        return out

    def text_chunk(self, ev: TextChunk | None, final: bool = False) -> str | None:
        """A chunk for new text (None when nothing is to be sent yet)."""
        text = ev.text if ev is not None else ""
        if self.logprobs is not None and ev is not None:
            self.logprobs += ev.logprobs or []
        if self.chat is None:
            if not text:
                return None
            choice = {"index": 0, "text": text, "logprobs": self._take_logprobs()}
            return self.chunk(choice | {"finish_reason": None})
        reasoning, content, calls = self.chat.feed(text, final)
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
            delta["reasoning"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [c.as_openai(self.calls + i) for i, c in enumerate(calls)]
            self.calls += len(calls)
        if not delta:
            return None
        choice = {"index": 0, "delta": delta, "logprobs": self._take_logprobs()}
        return self.chunk(choice | {"finish_reason": None})

    def final_chunk(self, done: Finished) -> str:
        key, empty = ("delta", {}) if self.chat is not None else ("text", "")
        reason = done.finish_reason
        if self.chat is not None:
            reason = self.chat.finish_reason(reason)
        logprobs = self._take_logprobs() if self.logprobs else None
        choice = {"index": 0, key: empty, "logprobs": logprobs, "finish_reason": reason}
        return self.chunk(choice, dflash=done.stats)

    async def events(self) -> AsyncIterator[str]:
        if self.chat is not None:
            # The role goes out at once, before prefill, so clients see the stream is alive.
            yield self.chunk(
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            )
        last_sent = 0.0
        try:
            while True:
                # At most one event per `interval` while tokens flow fast: each SSE event costs
                # the event loop far more than a token of text, and 20 ms is below perception.
                batch = await self.job.next_events(hold_until=last_sent + self.interval)
                if not batch:
                    break
                last_sent = time.monotonic()
                for ev in batch:
                    if isinstance(ev, TextChunk):
                        if (data := self.text_chunk(ev)) is not None:
                            yield data
                    elif isinstance(ev, Finished):
                        if self.chat is not None and (data := self.text_chunk(None, True)):
                            yield data
                        yield self.final_chunk(ev)
                        if self.p.include_usage:
                            yield self.chunk({}, usage=_usage(ev))
                    elif isinstance(ev, Failed):
                        yield _dumps(_error(ev))
            yield DONE
        finally:
            # Runs on normal end and when the client disconnects (the task is cancelled):
            # a still-running job stops at its next cycle and frees the worker.
            self.job.cancel()


def stream_response(
    prepared: Prepared, job: Job, tokenizer: Any, interval: float = 0.0
) -> AsyncIterator[str]:
    """The ``data:`` payloads of a streamed chat or text completion.

    ``interval``: minimum seconds between text events; faster tokens are sent together.
    """
    return _Stream(prepared, job, tokenizer, interval).events()


async def collect_response(
    prepared: Prepared,
    job: Job,
    tokenizer: Any,
    is_disconnected: Callable[[], Awaitable[bool]],
) -> dict[str, Any] | None:
    """Run a job to the end and build the whole response; None if the client went away."""
    parts: list[str] = []
    entries: list[TokenLogprob] = []
    done: Finished | None = None
    next_check = time.monotonic() + DISCONNECT_POLL_S
    try:
        while done is None:
            batch = await job.next_events(timeout=DISCONNECT_POLL_S)
            if time.monotonic() >= next_check:  # by the clock: events may never pause
                if await is_disconnected():
                    return None
                next_check = time.monotonic() + DISCONNECT_POLL_S
            if batch is None:
                continue
            if not batch:
                break
            for ev in batch:
                if isinstance(ev, TextChunk):
                    parts.append(ev.text)
                    entries += ev.logprobs or []
                elif isinstance(ev, Finished):
                    done = ev
                elif isinstance(ev, Failed):
                    raise APIError(ev.status, ev.message, code=ev.code)
    finally:
        job.cancel()
    assert done is not None
    text = "".join(parts)
    rid = uuid.uuid4().hex
    common = {"created": int(time.time()), "model": prepared.model, "usage": _usage(done)}
    asked = prepared.request.logprobs is not None
    if prepared.kind == "completion":
        logprobs = completion_logprobs(entries) if asked else None
        choice = {
            "index": 0,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": done.finish_reason,
        }
        return (
            {"id": f"cmpl-{rid}", "object": "text_completion", "choices": [choice]}
            | common
            | {"dflash": done.stats}
        )
    chat = ChatText(prepared, tokenizer)
    reasoning, content, calls = chat.feed(text, final=True)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        # OpenAI sends null content beside tool calls unless the model also said something.
        message["content"] = content.strip() or None
        message["tool_calls"] = [c.as_openai() for c in calls]
    if reasoning:
        message["reasoning_content"] = reasoning
        message["reasoning"] = reasoning
    choice = {
        "index": 0,
        "message": message,
        "logprobs": chat_logprobs(entries) if asked else None,
        "finish_reason": chat.finish_reason(done.finish_reason),
    }
    return (
        {"id": f"chatcmpl-{rid}", "object": "chat.completion", "choices": [choice]}
        | common
        | {"dflash": done.stats}
    )
