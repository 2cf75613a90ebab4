"""OpenAI Responses answers: ``reasoning``, ``message`` and ``function_call`` output items.

The model's text is split by ``ChatText`` (tool calls cut out, reasoning apart) into output
items; the stream is the Responses event sequence: ``response.created``,
``response.in_progress``, per item ``response.output_item.added``, its parts and deltas
(``response.reasoning_text.delta``, ``response.output_text.delta``,
``response.function_call_arguments.delta``) and their ``.done`` events,
``response.output_item.done``; then ``response.completed`` (``response.incomplete`` when
``max_output_tokens`` cut it, ``response.failed`` on an error). Every event has a
``sequence_number``. A non-streamed answer is the same stream run to the end; a finished
response is kept in the store (unless ``store: false``) with the conversation it ends.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar

from dflash_server.api.answers import ChatText, Part, Wire, dflash_stats
from dflash_server.api.openai_responses import ResponsesRequest, ResponseStore, Stored
from dflash_server.api.openai_responses_tools import ResponseTools
from dflash_server.api.prepare import Prepared
from dflash_server.chat.logprobs import TokenLogprob, chat_logprobs
from dflash_server.chat.tool_calls import ToolCall
from dflash_server.engine.jobs import Failed, Finished, TextChunk


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool as a response echoes it: function tools with every field the spec requires,
    others as sent."""
    if tool.get("type") != "function":
        return tool
    out = {"type": "function", "name": tool.get("name"), "description": tool.get("description")}
    return out | {"parameters": tool.get("parameters"), "strict": tool.get("strict", False)}


class ResponseShaper:
    """Job events -> output items, the events that build them, and the response; one per
    response. Once whole, the response is put in ``store`` after ``conversation``."""

    wire: ClassVar[Wire] = Wire(named=True)

    def __init__(
        self,
        prepared: Prepared,
        tokenizer: Any,
        req: ResponsesRequest,
        tools: ResponseTools,
        store: ResponseStore,
        conversation: list[dict[str, Any]],
    ) -> None:
        self.p, self.req, self.tools = prepared, req, tools
        self.store, self.conversation = store, conversation
        self.chat = ChatText(prepared, tokenizer)
        self.id = _id("resp")
        self.created = int(time.time())
        self.items: list[dict[str, Any]] = []
        self.open: str | None = None  # the item being written: "reasoning" or "message"
        self.seq = 0
        self.reasoning_tokens = 0
        # output_text logprobs (include: message.output_text.logprobs): those of the tokens
        # generated after the reasoning, not yet sent with their text.
        self.logprobs: list[TokenLogprob] | None = [] if req.logprobs or req.top_logprobs else None
        self.final: dict[str, Any] | None = None  # the finished response

    # ----- the response object -------------------------------------------------------------

    def response(
        self, status: str, done: Finished | None = None, error: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        req, sampling = self.req, self.p.request.sampling
        fmt = (req.text.format if req.text is not None else None) or {"type": "text"}
        body: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.p.model,
            "output": [dict(item) for item in self.items],
            "parallel_tool_calls": self.p.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None},
            "store": req.store is not False,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "text": {"format": fmt},
            "tool_choice": req.tool_choice or "auto",
            "tools": [_tool(t) for t in req.tools or []],
            "truncation": req.truncation or "disabled",
            "metadata": req.metadata or {},
        }
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        if done is not None:  # (the spec's usage is not nullable: left out until known)
            body["usage"] = {
                "input_tokens": done.prompt_tokens,
                "input_tokens_details": {
                    "cached_tokens": done.cached_tokens,
                    "cache_write_tokens": 0,
                },
                "output_tokens": done.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                "total_tokens": done.prompt_tokens + done.completion_tokens,
            }
            body["dflash"] = self.chat.stats(dflash_stats(done))
        return body

    def assistant_message(self) -> dict[str, Any]:
        """The output as one chat message, for the stored conversation."""
        message: dict[str, Any] = {"role": "assistant", "content": ""}
        for item in self.items:
            if item["type"] == "reasoning":
                message["reasoning_content"] = item["content"][0]["text"]
            elif item["type"] == "message":
                message["content"] += item["content"][0]["text"]
            else:
                name = self.tools.flat(item["name"], item.get("namespace"))
                function = {"name": name, "arguments": item["arguments"]}
                call = {"id": item["call_id"], "type": "function", "function": function}
                message.setdefault("tool_calls", []).append(call)
        return message

    # ----- events --------------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def start(self) -> list[dict[str, Any]]:
        created = self.event("response.created", response=self.response("in_progress"))
        return [created, self.event("response.in_progress", response=self.response("in_progress"))]

    def feed(self, text: TextChunk) -> list[dict[str, Any]]:
        if self.chat.splitter.in_reasoning:  # per event: the one holding </think> counts too
            self.reasoning_tokens += text.tokens
        elif self.logprobs is not None:
            self.logprobs += text.logprobs or []
        return self._parts(self.chat.feed(text.text))

    def finish(self, done: Finished) -> list[dict[str, Any]]:
        """The held-back text, the last item closed, then the response, kept before it is sent."""
        events = self._parts(self.chat.finish(done.finish_reason)) + self._close()
        status = "incomplete" if self.chat.outcome(done.finish_reason) == "length" else "completed"
        self.final = self.response(status, done)
        if self.req.store is not False:
            answer = self.assistant_message()
            self.store.put(self.id, Stored(self.final, [*self.conversation, answer]))
        return [*events, self.event(f"response.{status}", response=self.final)]

    def fail(self, failed: Failed) -> list[dict[str, Any]]:
        error = {"code": "server_error", "message": failed.message}
        return [self.event("response.failed", response=self.response("failed", error=error))]

    def whole(self) -> dict[str, Any]:
        assert self.final is not None, "the response has not ended"
        return self.final

    def _parts(self, parts: list[Part]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for part in parts:
            if isinstance(part, ToolCall):
                events += self._call(part)
            else:
                kind, text = part
                events += self._append("message" if kind == "content" else kind, text)
        return events

    def _call(self, call: ToolCall) -> list[dict[str, Any]]:
        events = self._close()
        if self.logprobs:  # the call's own tokens: not output text
            self.logprobs = []
        name, namespace = self.tools.split(call.name)
        item = {"id": _id("fc"), "type": "function_call", "call_id": call.id, "name": name}
        if namespace is not None:
            item["namespace"] = namespace
        item |= {"arguments": "", "status": "in_progress"}
        self.items.append(item)
        index = len(self.items) - 1
        events.append(self.event("response.output_item.added", item=dict(item), output_index=index))
        at = {"item_id": item["id"], "output_index": index}
        item |= {"arguments": call.arguments, "status": "completed"}
        return [
            *events,
            self.event("response.function_call_arguments.delta", delta=call.arguments, **at),
            self.event(
                "response.function_call_arguments.done", name=name, arguments=call.arguments, **at
            ),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def _part(self, kind: str) -> dict[str, Any]:
        if kind == "reasoning":
            return {"type": "reasoning_text", "text": ""}
        return {"type": "output_text", "text": "", "annotations": [], "logprobs": []}

    def _append(self, kind: str, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events: list[dict[str, Any]] = []
        if self.open != kind:
            events += self._close()
            item: dict[str, Any]
            if kind == "reasoning":
                item = {"id": _id("rs"), "type": "reasoning", "summary": [], "content": []}
            else:
                item = {"id": _id("msg"), "type": "message", "role": "assistant", "content": []}
            item["status"] = "in_progress"
            self.items.append(item)
            self.open = kind
            at = {"output_index": len(self.items) - 1}
            events.append(self.event("response.output_item.added", item=dict(item), **at))
            item["content"] = [self._part(kind)]
            at |= {"item_id": item["id"], "content_index": 0}
            events.append(self.event("response.content_part.added", part=self._part(kind), **at))
        item = self.items[-1]
        item["content"][0]["text"] += text
        at = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
        if kind == "reasoning":
            return [*events, self.event("response.reasoning_text.delta", delta=text, **at)]
        logprobs = self._take_logprobs()
        item["content"][0]["logprobs"] += logprobs
        delta = self.event("response.output_text.delta", delta=text, logprobs=logprobs, **at)
        return [*events, delta]

    def _take_logprobs(self) -> list[dict[str, Any]]:
        if not self.logprobs:
            return []
        entries, self.logprobs = self.logprobs, []
        return chat_logprobs(entries)["content"]

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        kind, self.open = self.open, None
        item = self.items[-1]
        item["status"] = "completed"
        part = item["content"][0]
        at = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
        if kind == "reasoning":
            done = self.event("response.reasoning_text.done", text=part["text"], **at)
        else:
            logprobs = part["logprobs"]
            done = self.event(
                "response.output_text.done", text=part["text"], logprobs=logprobs, **at
            )
        return [
            done,
            self.event("response.content_part.done", part=dict(part), **at),
            self.event("response.output_item.done", output_index=at["output_index"], item=item),
        ]
