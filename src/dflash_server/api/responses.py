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
from contextlib import aclosing
from dataclasses import asdict, dataclass
from typing import Any

from dflash_server.api.errors import APIError
from dflash_server.api.prepare import Prepared
from dflash_server.chat.logprobs import TokenLogprob, chat_logprobs, completion_logprobs
from dflash_server.chat.reasoning import ReasoningSplitter, think_markers
from dflash_server.chat.tool_calls import ToolCall, ToolCallParser
from dflash_server.engine.jobs import Event, Failed, Finished, Job, TextChunk

DONE = "[DONE]"
# How often a non-streaming request checks whether its client is still there.
DISCONNECT_POLL_S = 0.5


def dumps(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def usage(done: Finished) -> dict[str, Any]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }


def _error(ev: Failed) -> dict[str, Any]:
    kind = "service_unavailable" if ev.status == 503 else "server_error"
    return {"error": {"message": ev.message, "type": kind, "param": None, "code": ev.code}}


class ClientGone(Exception):
    """The client of a non-streamed request went away."""


async def run_to_end(events: AsyncIterator[Any]) -> bool:
    """Consume a non-streamed answer's events (closing them either way); False if the client
    left on the way."""
    try:
        async with aclosing(events) as stream:
            async for _ in stream:
                pass
    except ClientGone:
        return False
    return True


async def job_events(
    job: Job,
    *,
    interval: float = 0.0,
    is_disconnected: Callable[[], Awaitable[bool]] | None = None,
) -> AsyncIterator[Event]:
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


@dataclass
class Output:
    """A finished job: all its text, its logprob entries and its final event."""

    text: str
    logprobs: list[TokenLogprob]
    done: Finished


async def run_job(job: Job, is_disconnected: Callable[[], Awaitable[bool]]) -> Output | None:
    """Run a job to the end; None if the client went away, APIError if the job failed."""
    parts: list[str] = []
    entries: list[TokenLogprob] = []
    try:
        async with aclosing(job_events(job, is_disconnected=is_disconnected)) as events:
            async for ev in events:
                if isinstance(ev, TextChunk):
                    parts.append(ev.text)
                    entries += ev.logprobs or []
                elif isinstance(ev, Finished):
                    return Output("".join(parts), entries, ev)
                elif isinstance(ev, Failed):
                    raise APIError(ev.status, ev.message, code=ev.code)
    except ClientGone:
        return None
    raise APIError(500, "generation ended without a final event", code="generation_failed")


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


class ChatText:
    """Model text -> reasoning, content and tool calls, incrementally.

    Tool calls are cut out first, so their markup never reaches either text field, also when
    the model calls from inside its reasoning; the rest is split at the think markers. A call
    left unfinished at the end is dropped (counted in ``dropped``), never shown as markup.
    When a grammar writes the answer (``Prepared.forced``), only the answer's calls count: the
    reasoning is split off first and stays text, whatever markup it holds.
    """

    def __init__(self, prepared: Prepared, tokenizer: Any) -> None:
        start, end = think_markers(tokenizer)
        self.splitter = ReasoningSplitter(prepared.request.reasoning.opens, start, end)
        self.tools = (
            ToolCallParser(prepared.tools, prepared.parallel_tool_calls, end)
            if prepared.tools
            else None
        )
        self.answer_calls_only = prepared.forced

    def feed(self, text: str) -> tuple[str, str, list[ToolCall]]:
        """(reasoning, content, complete calls) that are safe to send now."""
        if self.answer_calls_only:
            return self._answer_calls(*self.splitter.feed(text))
        return self._split(self.tools.feed(text) if self.tools is not None else [text])

    def finish(self, reason: str) -> tuple[str, str, list[ToolCall]]:
        """What was held back, once the output ended with finish ``reason``."""
        cut = reason == "length"
        if self.answer_calls_only:
            return self._answer_calls(*self.splitter.finish(), cut=cut)
        reasoning, content, calls = self._split(
            self.tools.finish(cut) if self.tools is not None else []
        )
        r, c = self.splitter.finish()
        return reasoning + r, content + c, calls

    def _answer_calls(
        self, reasoning: str, content: str, cut: bool | None = None
    ) -> tuple[str, str, list[ToolCall]]:
        """Calls out of the answer text only; ``cut`` set: the output's end."""
        if self.tools is None:
            return reasoning, content, []
        pieces = self.tools.feed(content) + ([] if cut is None else self.tools.finish(cut))
        text = "".join(p for p in pieces if isinstance(p, str))
        return reasoning, text, [p for p in pieces if isinstance(p, ToolCall)]

    def _split(self, pieces: list[str | ToolCall]) -> tuple[str, str, list[ToolCall]]:
        reasoning, content, calls = "", "", []
        for piece in pieces:
            if isinstance(piece, ToolCall):
                calls.append(piece)
                continue
            r, c = self.splitter.feed(piece)
            reasoning, content = reasoning + r, content + c
        return reasoning, content, calls

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
        # The dflash_tokens extension: tokens not sent yet, as {"text", "source"}.
        self.tokens: list[dict[str, str]] | None = [] if prepared.dflash_tokens else None

    def chunk(self, choice: dict[str, Any], **extra: Any) -> str:
        base = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.p.model,
            "choices": [choice] if choice else [],
        }
        if self.p.include_usage:
            base["usage"] = None  # the spec: null on every chunk but the last
        if self.tokens and choice:
            base["dflash_tokens"], self.tokens = self.tokens, []
        return dumps(base | extra)

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

    def text_chunk(self, ev: TextChunk | None, finish: str | None = None) -> str | None:
        """A chunk for new text, or for the held-back rest once the output ended with
        ``finish`` (None when nothing is to be sent yet)."""
        text = ev.text if ev is not None else ""
        if self.logprobs is not None and ev is not None:
            self.logprobs += ev.logprobs or []
        if self.tokens is not None and ev is not None:
            self.tokens += [
                {"text": t, "source": "draft" if drafted else "target"}
                for t, drafted in ev.sources or []
            ]
        if self.chat is None:
            if not text:
                return None
            choice = {"index": 0, "text": text, "logprobs": self._take_logprobs()}
            return self.chunk(choice | {"finish_reason": None})
        if finish is None:
            reasoning, content, calls = self.chat.feed(text)
        else:
            reasoning, content, calls = self.chat.finish(finish)
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
        reason, stats = done.finish_reason, dflash_stats(done)
        if self.chat is not None:
            reason, stats = self.chat.finish_reason(reason), self.chat.stats(stats)
        logprobs = self._take_logprobs() if self.logprobs else None
        choice = {"index": 0, key: empty, "logprobs": logprobs, "finish_reason": reason}
        return self.chunk(choice, dflash=stats)

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
        async with aclosing(job_events(self.job, interval=self.interval)) as events:
            async for ev in events:
                if isinstance(ev, TextChunk):
                    if (data := self.text_chunk(ev)) is not None:
                        yield data
                elif isinstance(ev, Finished):
                    if self.chat is not None and (data := self.text_chunk(None, ev.finish_reason)):
                        yield data
                    yield self.final_chunk(ev)
                    if self.p.include_usage:
                        yield self.chunk({}, usage=usage(ev))
                elif isinstance(ev, Failed):
                    yield dumps(_error(ev))
        yield DONE


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
    out = await run_job(job, is_disconnected)
    if out is None:
        return None
    done, entries = out.done, out.logprobs
    rid = uuid.uuid4().hex
    common = {"created": int(time.time()), "model": prepared.model, "usage": usage(done)}
    asked = prepared.request.logprobs is not None
    if prepared.kind == "completion":
        logprobs = completion_logprobs(entries) if asked else None
        choice = {
            "index": 0,
            "text": out.text,
            "logprobs": logprobs,
            "finish_reason": done.finish_reason,
        }
        return (
            {"id": f"cmpl-{rid}", "object": "text_completion", "choices": [choice]}
            | common
            | {"dflash": dflash_stats(done)}
        )
    chat = ChatText(prepared, tokenizer)
    reasoning, content, calls = chat.feed(out.text)
    r, c, more = chat.finish(done.finish_reason)
    reasoning, content, calls = reasoning + r, content + c, calls + more
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
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
        | {"dflash": chat.stats(dflash_stats(done))}
    )
