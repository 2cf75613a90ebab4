"""The soak's traffic (tests/load/soak.py): a deterministic mix of requests and the clients that
send them.

Request ``n`` of the mix is one of ``SPECS`` kinds: chat completions, Messages or Responses,
streamed or not, plain, with tools (forced calls), with a JSON schema, or a second turn; three
long system prompts are shared, so the prefix cache hits. Four in five are greedy: every greedy
answer must equal the same request's solo run (``canonical`` compares the text, reasoning and
tool calls, whatever the chunking). A streamed request is sometimes left after its first text
(a client disconnect).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

SPECS = 48  # distinct request kinds; n and n + SPECS are the same request
SYSTEMS = [
    f"You are helper {k}. " + "Answer briefly, exactly and politely. " * 24 for k in range(3)
]
QUESTIONS = ["What is the capital of France?", "Name three colors.", "Count to five.", "Hi!"]
PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}
SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}
FEATURES = ("plain", "tools", "schema", "turn")
TEXT_KEYS = {"content", "text", "arguments", "partial_json", "delta", "name", "reasoning_content"}
TEXT_KEYS |= {"reasoning", "thinking", "finish_reason", "stop_reason", "refusal"}


@dataclass(frozen=True)
class Spec:
    n: int
    protocol: str
    stream: bool
    feature: str
    greedy: bool
    disconnect: bool  # leave after the first text (a client going away)


def spec(n: int) -> Spec:
    k = n % SPECS
    protocol = ("chat", "messages", "responses")[k % 3]
    stream = (k // 3) % 2 == 1
    greedy = k % 5 != 4
    return Spec(k, protocol, stream, FEATURES[(k // 6) % 4], greedy, stream and k % 7 == 3)


def body(s: Spec) -> dict[str, Any]:
    """The request body of ``s`` (sampled ones draw with a fixed seed)."""
    system, question = SYSTEMS[s.n % 3], QUESTIONS[(s.n // 3) % 4]
    turns: list[dict[str, Any]] = [{"role": "user", "content": question}]
    if s.feature == "turn":  # a second turn: the first one's prefix is cached
        turns = [
            *turns,
            {"role": "assistant", "content": "Sure."},
            {"role": "user", "content": "Why?"},
        ]
    out: dict[str, Any] = {"stream": s.stream, "block_size": "auto" if s.n % 2 else 4}
    out |= {"temperature": 0.0} if s.greedy else {"temperature": 0.9, "top_p": 0.95, "seed": s.n}
    tokens = 16 + (s.n % 4) * 8
    fn = {"name": "get_weather", "description": "Weather for a city"}
    if s.protocol == "chat":
        out |= {"messages": [{"role": "system", "content": system}, *turns], "max_tokens": tokens}
        out["enable_thinking"] = False
        if s.feature == "tools":
            out["tools"] = [{"type": "function", "function": {**fn, "parameters": PARAMS}}]
            out["tool_choice"] = "required"
        elif s.feature == "schema":
            out["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "w", "schema": SCHEMA, "strict": True},
            }
            out["max_tokens"] = 64
    elif s.protocol == "messages":
        out |= {"model": "tiny", "system": system, "messages": turns, "max_tokens": tokens}
        if s.feature in ("tools", "schema"):  # a forced tool call: its input follows the schema
            out["tools"] = [{**fn, "input_schema": PARAMS if s.feature == "tools" else SCHEMA}]
            out["tool_choice"] = {"type": "any"}
            out["max_tokens"] = 64
    else:
        out |= {"model": "tiny", "instructions": system, "input": turns}
        out["max_output_tokens"] = tokens
        if s.feature == "tools":
            out["tools"] = [{"type": "function", **fn, "parameters": PARAMS}]
            out["tool_choice"] = "required"
        elif s.feature == "schema":
            fmt = {"type": "json_schema", "name": "w", "schema": SCHEMA, "strict": True}
            out |= {"text": {"format": fmt}, "max_output_tokens": 64}
    return out


def canonical(events: list[Any]) -> str:
    """The answer's text, reasoning and tool calls out of a body or a stream's events, each
    field's pieces joined (chunk boundaries do not matter)."""
    acc: dict[str, str] = {}

    def walk(obj: Any) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                if k in TEXT_KEYS and isinstance(v, str):
                    acc[k] = acc.get(k, "") + v
                elif k not in ("usage", "dflash", "tools", "instructions", "text_format"):
                    walk(v)
        elif isinstance(obj, list):
            for v in obj:
                walk(v)

    walk(events)
    return json.dumps(acc, sort_keys=True)


@dataclass
class Outcome:
    spec: Spec
    phase: str
    status: int = 0  # 0: no HTTP answer (transport error)
    answer: str = ""
    error: str | None = None
    transport: str | None = None
    disconnected: bool = False
    finished: bool = False  # a non-streamed body, or a stream's last event seen
    ttft: float | None = None
    e2e: float = 0.0


async def send(http: httpx.AsyncClient, s: Spec, phase: str) -> Outcome:
    """One request of the mix; never raises (a transport error is recorded)."""
    out = Outcome(s, phase)
    t0 = time.perf_counter()
    try:
        if not s.stream:
            r = await http.post(PATHS[s.protocol], json=body(s))
            out.status = r.status_code
            data = r.json()
            out.finished = r.status_code == 200
            out.answer = canonical([data])
            if r.status_code != 200:
                out.error = json.dumps(data)[:300]
        else:
            await _stream(http, s, out, t0)
    except (httpx.TransportError, json.JSONDecodeError) as exc:
        out.transport = f"{type(exc).__name__}: {exc}"[:200]
    out.e2e = time.perf_counter() - t0
    return out


async def _stream(http: httpx.AsyncClient, s: Spec, out: Outcome, t0: float) -> None:
    events: list[Any] = []
    async with http.stream("POST", PATHS[s.protocol], json=body(s)) as r:
        out.status = r.status_code
        if r.status_code != 200:
            out.error = (await r.aread()).decode()[:300]
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out.finished = True
                break
            event = json.loads(line[6:])
            events.append(event)
            kind = event.get("type", "")
            if "error" in event and kind in ("", "error"):
                out.error = json.dumps(event)[:300]
            if kind in ("message_stop", "response.completed", "response.incomplete"):
                out.finished = True
            if out.ttft is None and ("delta" in kind or "choices" in event):
                out.ttft = time.perf_counter() - t0
                if s.disconnect:
                    out.disconnected = True
                    return  # leave mid-stream: the server must stop this generation
    out.answer = canonical(events)


@dataclass
class Traffic:
    """Clients sending the mix; their number changes every ``period`` s within 1..``most``."""

    base: str
    most: int = 16
    period: float = 15.0
    seed: int = 0
    phase: str = "steady"
    outcomes: list[Outcome] = field(default_factory=list)
    paused: asyncio.Event = field(default_factory=asyncio.Event)  # set: clients hold off
    inflight: int = 0
    clients: int = 1
    _stop: bool = False

    async def run(self) -> None:
        rng = random.Random(self.seed)
        limits = httpx.Limits(max_connections=self.most + 4)
        timeout = httpx.Timeout(120, connect=10)
        async with httpx.AsyncClient(base_url=self.base, timeout=timeout, limits=limits) as http:
            tasks = [asyncio.create_task(self._client(http, c)) for c in range(self.most)]
            while not self._stop:
                self.clients = rng.randint(1, self.most)
                await asyncio.sleep(self.period)
            await asyncio.gather(*tasks)

    def stop(self) -> None:
        self._stop = True

    async def quiesce(self, timeout: float = 60) -> None:
        """Hold new requests and wait for those in flight."""
        self.paused.set()
        end = time.monotonic() + timeout
        while self.inflight and time.monotonic() < end:
            await asyncio.sleep(0.05)

    async def _client(self, http: httpx.AsyncClient, c: int) -> None:
        rng = random.Random(self.seed * 1000 + c)
        while not self._stop:
            if c >= self.clients or self.paused.is_set():
                await asyncio.sleep(0.2)
                continue
            self.inflight += 1
            try:
                out = await send(http, spec(rng.randrange(SPECS)), self.phase)
            finally:
                self.inflight -= 1
            if self.phase != "steady":  # ended during a fault: it is that fault's
                out.phase = self.phase
            self.outcomes.append(out)
            if out.transport is not None:
                await asyncio.sleep(0.5)  # the server is restarting: try again shortly
