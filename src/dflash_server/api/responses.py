"""Turn a running engine job into OpenAI responses: whole objects or SSE chunk streams.

Streams follow OpenAI exactly: the first chat chunk carries the role, the last choice chunk
carries ``finish_reason`` (and our ``dflash`` stats), an optional usage chunk with no choices
follows when ``stream_options.include_usage`` is set, then ``data: [DONE]``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from dflash_server.api.errors import APIError
from dflash_server.api.prepare import Prepared
from dflash_server.engine.prompts import think_markers
from dflash_server.engine.reasoning import ReasoningSplitter
from dflash_server.engine.worker import Failed, Finished, Job, TextChunk

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


def _error(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "server_error", "param": None, "code": None}}


class _Stream:
    """Shared chunk framing for chat and text completion streams."""

    def __init__(self, prepared: Prepared, job: Job, tokenizer: Any, interval: float) -> None:
        self.p, self.job, self.interval = prepared, job, interval
        chat = prepared.kind == "chat"
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.object = "chat.completion.chunk" if chat else "text_completion"
        self.created = int(time.time())
        start, end = think_markers(tokenizer)
        self.splitter = (
            ReasoningSplitter(prepared.prompt.opens_reasoning, start, end) if chat else None
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

    def text_chunk(self, text: str, finish: str | None = None) -> str | None:
        """A chunk for new text (None when nothing is to be sent yet)."""
        if self.splitter is None:
            if not text and finish is None:
                return None
            return self.chunk({"index": 0, "text": text, "logprobs": None, "finish_reason": None})
        reasoning, content = self.splitter.feed(text) if finish is None else self.splitter.finish()
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
            delta["reasoning"] = reasoning
        if content:
            delta["content"] = content
        if not delta:
            return None
        return self.chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": None})

    def final_chunk(self, done: Finished) -> str:
        key, empty = ("delta", {}) if self.splitter is not None else ("text", "")
        choice = {"index": 0, key: empty, "logprobs": None, "finish_reason": done.finish_reason}
        return self.chunk(choice, dflash=done.stats)

    async def events(self) -> AsyncIterator[str]:
        if self.splitter is not None:
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
                        if (data := self.text_chunk(ev.text)) is not None:
                            yield data
                    elif isinstance(ev, Finished):
                        if (
                            self.splitter is not None
                            and (data := self.text_chunk("", finish=ev.finish_reason)) is not None
                        ):
                            yield data
                        yield self.final_chunk(ev)
                        if self.p.include_usage:
                            yield self.chunk({}, usage=_usage(ev))
                    elif isinstance(ev, Failed):
                        yield _dumps(_error(ev.message))
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
                elif isinstance(ev, Finished):
                    done = ev
                elif isinstance(ev, Failed):
                    raise APIError(500, ev.message, code="generation_failed")
    finally:
        job.cancel()
    assert done is not None
    text = "".join(parts)
    rid = uuid.uuid4().hex
    common = {"created": int(time.time()), "model": prepared.model, "usage": _usage(done)}
    if prepared.kind == "completion":
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": done.finish_reason}
        return (
            {"id": f"cmpl-{rid}", "object": "text_completion", "choices": [choice]}
            | common
            | {"dflash": done.stats}
        )
    start, end = think_markers(tokenizer)
    splitter = ReasoningSplitter(prepared.prompt.opens_reasoning, start, end)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.finish()
    reasoning, content = r1 + r2, c1 + c2
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
        message["reasoning"] = reasoning
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": done.finish_reason}
    return (
        {"id": f"chatcmpl-{rid}", "object": "chat.completion", "choices": [choice]}
        | common
        | {"dflash": done.stats}
    )
