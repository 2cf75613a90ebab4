"""The soak's traffic (tests/load/soak.py): the clients that send a server's mix of requests
(tests/load/soak_requests.py) and what came back.

The clients take turns at their server's mix (shuffled, seeded: ``Traffic.next_spec``); a
streamed request is sometimes left after its first text (a client disconnect). Every greedy
answer must equal the same request's solo run: ``canonical`` compares the text, reasoning and
tool calls, whatever the chunking.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from soak_requests import PATHS, Spec, body

TEXT_KEYS = {"content", "text", "arguments", "partial_json", "delta", "name", "reasoning_content"}
TEXT_KEYS |= {"reasoning", "thinking", "finish_reason", "stop_reason", "refusal"}
# Fields that echo the request (or count tokens), not the answer.
ECHOED = ("usage", "dflash", "tools", "instructions", "text_format")


def canonical(events: list[Any]) -> str:
    """The answer's text, reasoning and tool calls out of a body or a stream's events, each
    field's pieces joined (chunk boundaries do not matter)."""
    acc: dict[str, str] = {}

    def walk(obj: Any) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                if k in TEXT_KEYS and isinstance(v, str):
                    acc[k] = acc.get(k, "") + v
                elif k == "input" and isinstance(v, dict):  # a Messages tool call's arguments
                    acc[k] = acc.get(k, "") + json.dumps(v, sort_keys=True)
                elif k not in ECHOED:
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


async def solo_references(base: str, specs: list[Spec]) -> dict[tuple[str, int], str]:
    """Each greedy request of a mix run alone: the answer every later run must equal."""
    refs = {}
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        for s in specs:
            if s.greedy and not s.disconnect:
                out = await send(http, s, "solo")
                assert out.status == 200 and out.finished, (s, out)
                refs[(s.server, s.n)] = out.answer
    return refs


@dataclass
class Traffic:
    """Clients sending ``specs`` to one server; their number changes every ``period`` s within
    1..``most``. One per server: a fault on one server pauses its clients only."""

    base: str
    specs: list[Spec]
    most: int = 16
    period: float = 15.0
    seed: int = 0
    phase: str = "steady"
    outcomes: list[Outcome] = field(default_factory=list)
    paused: asyncio.Event = field(default_factory=asyncio.Event)  # set: clients hold off
    inflight: int = 0
    clients: int = 1
    stopped: bool = False
    _queue: list[Spec] = field(default_factory=list)
    _rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        self._rng.seed(self.seed)

    def next_spec(self) -> Spec:
        """The next request of the mix, shared by all clients: the mix goes round, shuffled, each
        round one request of every kind first, then a second of every kind, and so on, so that
        even a one-minute run meets every kind (a plain random pick can miss a rare one)."""
        if not self._queue:
            by_kind: dict[str, list[Spec]] = {}
            for s in self._rng.sample(self.specs, len(self.specs)):
                by_kind.setdefault(s.kind, []).append(s)
            rounds = itertools.zip_longest(*by_kind.values())
            self._queue = [s for r in rounds for s in r if s is not None]
        return self._queue.pop(0)

    async def run(self) -> None:
        rng = random.Random(self.seed)
        limits = httpx.Limits(max_connections=self.most + 4)
        timeout = httpx.Timeout(120, connect=10)
        async with httpx.AsyncClient(base_url=self.base, timeout=timeout, limits=limits) as http:
            tasks = [asyncio.create_task(self._client(http, c)) for c in range(self.most)]
            while not self.stopped:
                self.clients = rng.randint(1, self.most)
                await asyncio.sleep(self.period)
            await asyncio.gather(*tasks)

    def stop(self) -> None:
        self.stopped = True

    async def quiesce(self, timeout: float = 60) -> None:
        """Hold new requests and wait for those in flight."""
        self.paused.set()
        end = time.monotonic() + timeout
        while self.inflight and time.monotonic() < end:
            await asyncio.sleep(0.05)

    async def _client(self, http: httpx.AsyncClient, c: int) -> None:
        while not self.stopped:
            if c >= self.clients or self.paused.is_set():
                await asyncio.sleep(0.2)
                continue
            self.inflight += 1
            try:
                out = await send(http, self.next_spec(), self.phase)
            finally:
                self.inflight -= 1
            if self.phase != "steady":  # ended during a fault: it is that fault's
                out.phase = self.phase
            self.outcomes.append(out)
            if out.transport is not None:
                await asyncio.sleep(0.5)  # the server is restarting: try again shortly
