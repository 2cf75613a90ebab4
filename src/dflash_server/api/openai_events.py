"""Chat and text completions: a job's events as OpenAI chunks, or the whole object they add up to.

Streams follow OpenAI exactly: the first chat chunk carries the role, the last choice chunk
carries ``finish_reason`` (and our ``dflash`` stats), an optional usage chunk with no choices
follows when ``stream_options.include_usage`` is set, then ``data: [DONE]``. Tool calls go out
as ``delta.tool_calls[index]`` (each call whole, once parsed); logprobs ride on the chunk that
carries their tokens' text (or the next one, when text is held back). A non-streamed answer is
the same stream run to the end (``whole``).
"""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from dflash_server.api.answers import ChatText, Part, Wire, dflash_stats
from dflash_server.api.prepare import Prepared
from dflash_server.chat.logprobs import TokenLogprob, chat_logprobs, completion_logprobs
from dflash_server.chat.tool_calls import ToolCall
from dflash_server.engine.jobs import Failed, Finished, TextChunk


def usage(done: Finished) -> dict[str, Any]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }


class _Completion(ABC):
    """What chat and text completions share: the chunk envelope, the logprobs and dflash tokens
    not sent yet, the closing chunks and the error object."""

    wire: ClassVar[Wire] = Wire(done="[DONE]")
    id_prefix: ClassVar[str]
    chunk_object: ClassVar[str]
    whole_object: ClassVar[str]

    def __init__(self, prepared: Prepared) -> None:
        self.p = prepared
        self.id = self.id_prefix + uuid.uuid4().hex
        self.created = int(time.time())
        asked = prepared.request.logprobs is not None
        self.logprobs: list[TokenLogprob] | None = [] if asked else None  # not yet sent
        self.all_logprobs: list[TokenLogprob] = []
        # The dflash_tokens extension: tokens not sent yet, as {"text", "source"}.
        self.tokens: list[dict[str, str]] | None = [] if prepared.dflash_tokens else None
        self.done: Finished | None = None

    def chunk(self, choice: dict[str, Any], **extra: Any) -> dict[str, Any]:
        base = {
            "id": self.id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.p.model,
            "choices": [choice] if choice else [],
        }
        if self.p.include_usage:
            base["usage"] = None  # the spec: null on every chunk but the last
        if self.tokens and choice:
            base["dflash_tokens"], self.tokens = self.tokens, []
        return base | extra

    def start(self) -> list[dict[str, Any]]:
        return []

    def feed(self, text: TextChunk) -> list[dict[str, Any]]:
        self.all_logprobs += text.logprobs or []
        if self.logprobs is not None:
            self.logprobs += text.logprobs or []
        if self.tokens is not None:
            self.tokens += [{"text": t, "source": source} for t, source in text.sources or []]
        return self._text(text.text)

    def finish(self, done: Finished) -> list[dict[str, Any]]:
        """The chunks that close the stream: the held-back text, the finish, the usage."""
        self.done = done
        out = self._rest(done.finish_reason)
        logprobs = self._take_logprobs() if self.logprobs else None
        choice = {"index": 0, **self._no_text(), "logprobs": logprobs}
        choice["finish_reason"] = self._finish_reason(done)
        out.append(self.chunk(choice, dflash=self._stats(done)))
        if self.p.include_usage:
            out.append(self.chunk({}, usage=usage(done)))
        return out

    def fail(self, failed: Failed) -> list[dict[str, Any]]:
        kind = "service_unavailable" if failed.status == 503 else "server_error"
        error = {"message": failed.message, "type": kind, "param": None, "code": failed.code}
        return [{"error": error}]

    def _take_logprobs(self) -> dict[str, Any] | None:
        """The logprobs not yet sent, in this endpoint's shape (None when not asked for)."""
        if self.logprobs is None:
            return None
        entries, self.logprobs = self.logprobs, []
        return self._logprobs(entries)

    def _choice(self, **fields: Any) -> list[dict[str, Any]]:
        """A chunk of new output, with the logprobs that came with it."""
        choice = {"index": 0, **fields, "logprobs": self._take_logprobs(), "finish_reason": None}
        return [self.chunk(choice)]

    # ----- what differs between chat and text ----------------------------------------------

    @abstractmethod
    def _text(self, text: str) -> list[dict[str, Any]]:
        """The chunks for new text (none while it is held back)."""

    def _rest(self, reason: str) -> list[dict[str, Any]]:
        """The chunks for text held back until the output ended with ``reason``."""
        return []

    @abstractmethod
    def _no_text(self) -> dict[str, Any]:
        """The choice's empty text, on the closing chunk."""

    @abstractmethod
    def _logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        """``entries`` in this endpoint's logprobs shape."""

    def _finish_reason(self, done: Finished) -> str:
        return done.finish_reason

    def _stats(self, done: Finished) -> dict[str, Any]:
        return dflash_stats(done)

    @abstractmethod
    def _whole_choice(self, done: Finished) -> dict[str, Any]:
        """The whole answer's choice."""

    def whole(self) -> dict[str, Any]:
        done = self.done
        assert done is not None, "the answer has not ended"
        choice = self._whole_choice(done)
        body: dict[str, Any] = {"id": self.id, "object": self.whole_object, "choices": [choice]}
        body |= {"created": self.created, "model": self.p.model, "usage": usage(done)}
        return body | {"dflash": self._stats(done)}


class TextShaper(_Completion):
    """Job events -> text completion chunks (``/v1/completions``)."""

    id_prefix, chunk_object, whole_object = "cmpl-", "text_completion", "text_completion"

    def __init__(self, prepared: Prepared) -> None:
        super().__init__(prepared)
        self.sent = 0  # length of the token strings sent so far (logprobs text_offset)
        self.text = ""

    def _text(self, text: str) -> list[dict[str, Any]]:
        self.text += text
        return self._choice(text=text) if text else []

    def _no_text(self) -> dict[str, Any]:
        return {"text": ""}

    def _logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        out = completion_logprobs(entries, self.sent)
        self.sent += sum(len(e.token) for e in entries)
        return out

    def _whole_choice(self, done: Finished) -> dict[str, Any]:
        asked = self.p.request.logprobs is not None
        return {
            "index": 0,
            "text": self.text,
            "logprobs": completion_logprobs(self.all_logprobs) if asked else None,
            "finish_reason": done.finish_reason,
        }


class ChatShaper(_Completion):
    """Job events -> chat completion chunks: reasoning, content and tool calls apart."""

    id_prefix, whole_object = "chatcmpl-", "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, prepared: Prepared, tokenizer: Any) -> None:
        super().__init__(prepared)
        self.chat = ChatText(prepared, tokenizer)
        self.reasoning = self.content = ""  # the whole answer so far
        self.calls: list[ToolCall] = []

    def start(self) -> list[dict[str, Any]]:
        delta = {"role": "assistant", "content": ""}
        return [self.chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": None})]

    def _text(self, text: str) -> list[dict[str, Any]]:
        return self._deltas(self.chat.feed(text))

    def _rest(self, reason: str) -> list[dict[str, Any]]:
        return self._deltas(self.chat.finish(reason))

    def _deltas(self, parts: list[Part]) -> list[dict[str, Any]]:
        """One chunk per part, in the order the model wrote them."""
        out = []
        for part in parts:
            if isinstance(part, ToolCall):
                out += self._choice(delta={"tool_calls": [part.as_openai(len(self.calls))]})
                self.calls.append(part)
                continue
            kind, text = part
            if kind == "reasoning":
                self.reasoning += text
                out += self._choice(delta={"reasoning_content": text, "reasoning": text})
            else:
                self.content += text
                out += self._choice(delta={"content": text})
        return out

    def _no_text(self) -> dict[str, Any]:
        return {"delta": {}}

    def _logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        return chat_logprobs(entries)

    def _finish_reason(self, done: Finished) -> str:
        return self.chat.finish_reason(done.finish_reason)

    def _stats(self, done: Finished) -> dict[str, Any]:
        return self.chat.stats(dflash_stats(done))

    def _whole_choice(self, done: Finished) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content, "refusal": None}
        if self.calls:
            # OpenAI sends null content beside tool calls unless the model also said something.
            message["content"] = self.content.strip() or None
            message["tool_calls"] = [c.as_openai() for c in self.calls]
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
            message["reasoning"] = self.reasoning
        asked = self.p.request.logprobs is not None
        return {
            "index": 0,
            "message": message,
            "logprobs": chat_logprobs(self.all_logprobs) if asked else None,
            "finish_reason": self._finish_reason(done),
        }
