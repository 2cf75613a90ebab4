"""Chat and text completions: a job's events as OpenAI chunks, or the whole object they add up to.

Streams follow OpenAI exactly: the first chat chunk carries the role, the last choice chunk
carries ``finish_reason`` (and our ``dflash`` stats), an optional usage chunk with no choices
follows when ``stream_options.include_usage`` is set, then ``data: [DONE]``. Tool calls go out
as ``delta.tool_calls[index]`` (each call whole, once parsed); logprobs ride on the chunk that
carries their tokens' text (or the next one, when text is held back). A non-streamed answer is
the same stream run to the end (``CompletionShaper.whole``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from dflash_server.api.answers import ChatText, dflash_stats, dumps, job_events, run_to_end
from dflash_server.api.errors import APIError
from dflash_server.api.prepare import Prepared
from dflash_server.chat.logprobs import TokenLogprob, chat_logprobs, completion_logprobs
from dflash_server.chat.tool_calls import ToolCall
from dflash_server.engine.jobs import Failed, Finished, Job, TextChunk

DONE = "[DONE]"


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


class CompletionShaper:
    """Job events -> chat (or text) completion chunks, keeping what the whole answer needs."""

    def __init__(self, prepared: Prepared, tokenizer: Any) -> None:
        self.p = prepared
        chat = prepared.kind == "chat"
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.object = "chat.completion.chunk" if chat else "text_completion"
        self.created = int(time.time())
        self.chat = ChatText(prepared, tokenizer) if chat else None
        self.sent = 0  # length of the token strings sent so far (logprobs text_offset)
        asked = prepared.request.logprobs is not None
        self.logprobs: list[TokenLogprob] | None = [] if asked else None  # not yet sent
        self.all_logprobs: list[TokenLogprob] = []
        # The dflash_tokens extension: tokens not sent yet, as {"text", "source"}.
        self.tokens: list[dict[str, str]] | None = [] if prepared.dflash_tokens else None
        # The whole answer so far.
        self.text = self.reasoning = self.content = ""
        self.calls: list[ToolCall] = []
        self.done: Finished | None = None

    def chunk(self, choice: dict[str, Any], **extra: Any) -> dict[str, Any]:
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
        return base | extra

    def start(self) -> dict[str, Any] | None:
        """The role chunk (chat): it goes out at once, before prefill, so clients see the
        stream is alive."""
        if self.chat is None:
            return None
        delta = {"role": "assistant", "content": ""}
        return self.chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": None})

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

    def text_chunk(self, ev: TextChunk | None, finish: str | None = None) -> dict[str, Any] | None:
        """A chunk for new text, or for the held-back rest once the output ended with
        ``finish`` (None when nothing is to be sent yet)."""
        text = ev.text if ev is not None else ""
        if ev is not None:
            self.all_logprobs += ev.logprobs or []
            if self.logprobs is not None:
                self.logprobs += ev.logprobs or []
            if self.tokens is not None:
                self.tokens += [
                    {"text": t, "source": "draft" if drafted else "target"}
                    for t, drafted in ev.sources or []
                ]
        if self.chat is None:
            self.text += text
            if not text:
                return None
            choice = {"index": 0, "text": text, "logprobs": self._take_logprobs()}
            return self.chunk(choice | {"finish_reason": None})
        if finish is None:
            reasoning, content, calls = self.chat.feed(text)
        else:
            reasoning, content, calls = self.chat.finish(finish)
        self.reasoning, self.content = self.reasoning + reasoning, self.content + content
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
            delta["reasoning"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [c.as_openai(len(self.calls) + i) for i, c in enumerate(calls)]
            self.calls += calls
        if not delta:
            return None
        choice = {"index": 0, "delta": delta, "logprobs": self._take_logprobs()}
        return self.chunk(choice | {"finish_reason": None})

    def _finish_reason(self, done: Finished) -> str:
        reason = done.finish_reason
        return self.chat.finish_reason(reason) if self.chat is not None else reason

    def _stats(self, done: Finished) -> dict[str, Any]:
        stats = dflash_stats(done)
        return self.chat.stats(stats) if self.chat is not None else stats

    def end(self, done: Finished) -> list[dict[str, Any]]:
        """The chunks that close the stream: the held-back text, the finish, the usage."""
        self.done = done
        out = []
        if self.chat is not None and (rest := self.text_chunk(None, done.finish_reason)):
            out.append(rest)
        key, empty = ("delta", {}) if self.chat is not None else ("text", "")
        logprobs = self._take_logprobs() if self.logprobs else None
        choice = {"index": 0, key: empty, "logprobs": logprobs}
        out.append(
            self.chunk(
                choice | {"finish_reason": self._finish_reason(done)}, dflash=self._stats(done)
            )
        )
        if self.p.include_usage:
            out.append(self.chunk({}, usage=usage(done)))
        return out

    def whole(self) -> dict[str, Any]:
        """The non-streamed answer, once ``end`` ran."""
        done = self.done
        assert done is not None, "the answer has not ended"
        asked = self.p.request.logprobs is not None
        common = {"created": self.created, "model": self.p.model, "usage": usage(done)}
        if self.chat is None:
            choice = {
                "index": 0,
                "text": self.text,
                "logprobs": completion_logprobs(self.all_logprobs) if asked else None,
                "finish_reason": done.finish_reason,
            }
            body = {"id": self.id, "object": "text_completion", "choices": [choice]}
            return body | common | {"dflash": self._stats(done)}
        message: dict[str, Any] = {"role": "assistant", "content": self.content, "refusal": None}
        if self.calls:
            # OpenAI sends null content beside tool calls unless the model also said something.
            message["content"] = self.content.strip() or None
            message["tool_calls"] = [c.as_openai() for c in self.calls]
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
            message["reasoning"] = self.reasoning
        choice = {
            "index": 0,
            "message": message,
            "logprobs": chat_logprobs(self.all_logprobs) if asked else None,
            "finish_reason": self._finish_reason(done),
        }
        body = {"id": self.id, "object": "chat.completion", "choices": [choice]}
        return body | common | {"dflash": self._stats(done)}


async def _chunks(
    shaper: CompletionShaper,
    job: Job,
    interval: float = 0.0,
    is_disconnected: Callable[[], Awaitable[bool]] | None = None,
) -> AsyncGenerator[dict[str, Any], None]:
    """The answer's chunks (a failure: an error object when streaming, else APIError)."""
    if (first := shaper.start()) is not None:
        yield first
    events = job_events(job, interval=interval, is_disconnected=is_disconnected)
    async with aclosing(events) as stream:
        async for ev in stream:
            if isinstance(ev, TextChunk):
                if (data := shaper.text_chunk(ev)) is not None:
                    yield data
            elif isinstance(ev, Finished):
                for data in shaper.end(ev):
                    yield data
            elif isinstance(ev, Failed):
                if is_disconnected is not None:
                    raise APIError(ev.status, ev.message, code=ev.code)
                yield _error(ev)
    if shaper.done is None and is_disconnected is not None:
        raise APIError(500, "generation ended without a final event", code="generation_failed")


async def stream_response(
    prepared: Prepared, job: Job, tokenizer: Any, interval: float = 0.0
) -> AsyncGenerator[str, None]:
    """The ``data:`` payloads of a streamed chat or text completion.

    ``interval``: minimum seconds between text events; faster tokens are sent together.
    """
    async with aclosing(_chunks(CompletionShaper(prepared, tokenizer), job, interval)) as chunks:
        async for chunk in chunks:
            yield dumps(chunk)
    yield DONE


async def collect_response(
    prepared: Prepared,
    job: Job,
    tokenizer: Any,
    is_disconnected: Callable[[], Awaitable[bool]],
) -> dict[str, Any] | None:
    """Run a job to the end and build the whole response; None if the client went away."""
    shaper = CompletionShaper(prepared, tokenizer)
    finished = await run_to_end(_chunks(shaper, job, is_disconnected=is_disconnected))
    return shaper.whole() if finished else None
