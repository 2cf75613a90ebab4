"""Load and memory runs against a real server on loopback (bounded in count and time).

    .venv/bin/python tests/load/loadgen.py                 # N = 1, 8, 32 clients + 200-request memory run
    .venv/bin/python tests/load/loadgen.py --clients 8 --memory 0

Each client streams ``--per-client`` chat requests one after another: a third sampled, the rest
greedy, every fifth cancelled after its first text. Every greedy answer that completes must equal
the same request run alone; every request must end with a final chunk (finish_reason) or an
error event, followed by [DONE]. tests/test_load.py runs a small version of both checks.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

WORDS = ["alpha", "fox", "server", "token", "draft", "the", "capital", "print", "42", "step"]


@dataclass
class Outcome:
    """What one streamed request saw."""

    key: tuple[int, int]
    greedy: bool
    cancelled: bool = False
    text: str = ""
    tokens: int = 0
    finish: str | None = None
    error: str | None = None
    status: int = 0
    done: bool = False  # saw [DONE]
    ttft: float | None = None
    e2e: float = 0.0


@dataclass
class LoadReport:
    clients: int
    outcomes: list[Outcome] = field(default_factory=list)
    wall: float = 0.0
    mismatches: list[tuple[int, int]] = field(default_factory=list)
    unterminated: list[tuple[int, int]] = field(default_factory=list)
    healthy: bool = False

    def row(self) -> dict[str, Any]:
        done = [o for o in self.outcomes if o.finish is not None]
        failed = [o for o in self.outcomes if o.finish is None and not o.cancelled]
        ttft = sorted(o.ttft for o in self.outcomes if o.ttft is not None)
        e2e = sorted(o.e2e for o in done)
        return {
            "clients": self.clients,
            "requests": len(self.outcomes),
            "completed": len(done),
            "cancelled": sum(o.cancelled for o in self.outcomes),
            "failed": len(failed),
            "greedy_checked": sum(o.greedy for o in done),
            "greedy_mismatch": len(self.mismatches),
            "unterminated": len(self.unterminated),
            "ttft_p50_ms": _pct(ttft, 50) * 1e3,
            "ttft_p95_ms": _pct(ttft, 95) * 1e3,
            "e2e_p50_s": _pct(e2e, 50),
            "e2e_p95_s": _pct(e2e, 95),
            "tok_s": sum(o.tokens for o in self.outcomes) / self.wall if self.wall else 0.0,
            "healthy": self.healthy,
        }


def _pct(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def request_body(client: int, i: int, max_tokens: int) -> tuple[dict[str, Any], bool, bool]:
    """(body, greedy, cancel) of a client's i-th request; deterministic per (client, i)."""
    n = client * 7 + i
    words = " ".join(WORDS[(n * 3 + k) % len(WORDS)] for k in range(3 + n % 5))
    greedy = n % 3 != 2
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": f"{words} #{n}"}],
        "max_tokens": max_tokens - (n % 4) * (max_tokens // 8),
        "stream": True,
        "stream_options": {"include_usage": True},
        "enable_thinking": False,
    }
    body |= {"temperature": 0.0} if greedy else {"temperature": 0.9, "top_p": 0.95, "seed": n}
    if n % 2:
        body["block_size"] = 4
    return body, greedy, n % 5 == 4


async def stream_one(
    client: httpx.AsyncClient,
    key: tuple[int, int],
    body: dict[str, Any],
    greedy: bool,
    cancel: bool,
) -> Outcome:
    out = Outcome(key, greedy, cancelled=cancel)
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        out.status = r.status_code
        if r.status_code != 200:
            out.error = (await r.aread()).decode()[:200]
            out.cancelled = False
            out.e2e = time.perf_counter() - t0
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                out.done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                out.error = chunk["error"]["message"]
                continue
            if chunk.get("usage"):
                out.tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                text = choice["delta"].get("content") or ""
                if text and out.ttft is None:
                    out.ttft = time.perf_counter() - t0
                out.text += text
                if choice.get("finish_reason"):
                    out.finish = choice["finish_reason"]
            if cancel and out.ttft is not None:
                break  # leave mid-stream: the server must stop this generation
    out.e2e = time.perf_counter() - t0
    return out


async def run_load(
    base: str, clients: int, per_client: int, max_tokens: int, reference: dict[Any, str]
) -> LoadReport:
    """``clients`` concurrent streaming clients; greedy texts are checked against ``reference``
    (filled here by running each greedy request alone first, when missing)."""
    report = LoadReport(clients)
    timeout = httpx.Timeout(120, connect=10)
    plan = {
        (c, i): request_body(c, i, max_tokens) for c in range(clients) for i in range(per_client)
    }
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=base, timeout=timeout, limits=limits) as http:
        for key, (body, greedy, _) in plan.items():
            if greedy and key not in reference:  # the same request, run alone
                alone = await stream_one(http, key, body, True, False)
                assert alone.finish is not None, alone
                reference[key] = alone.text

        async def client_loop(c: int) -> list[Outcome]:
            return [await stream_one(http, (c, i), *plan[(c, i)]) for i in range(per_client)]

        t0 = time.perf_counter()
        results = await asyncio.wait_for(
            asyncio.gather(*(client_loop(c) for c in range(clients))), timeout=600
        )
        report.wall = time.perf_counter() - t0
        report.outcomes = [o for r in results for o in r]
        health = await http.get("/health")
        report.healthy = health.status_code == 200 and health.json()["status"] == "ready"
    for o in report.outcomes:
        if o.greedy and o.finish is not None and o.text != reference[o.key]:
            report.mismatches.append(o.key)
        if not o.cancelled and not (o.done and (o.finish is not None or o.error)):
            report.unterminated.append(o.key)
    return report


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def memory_run(base: str, n: int, max_tokens: int) -> list[dict[str, float]]:
    """``n`` sequential requests (every 4th cancelled mid-stream); memory after each one."""
    import mlx.core as mx

    samples = []
    timeout = httpx.Timeout(120, connect=10)
    async with httpx.AsyncClient(base_url=base, timeout=timeout) as http:
        for i in range(n):
            body, _, _ = request_body(i % 11, i, max_tokens)
            await stream_one(http, (0, i), body, False, cancel=i % 4 == 3)
            while (await http.get("/health")).json()["queue_depth"]:  # cancelled: wait it out
                await asyncio.sleep(0.01)
            samples.append(
                {
                    "active_mb": mx.get_active_memory() / 2**20,
                    "cache_mb": mx.get_cache_memory() / 2**20,
                    "rss_mb": rss_bytes() / 2**20,
                }
            )
    return samples


def memory_summary(samples: list[dict[str, float]], warmup: int = 5) -> dict[str, float]:
    base = samples[warmup - 1]
    out: dict[str, float] = {"requests": len(samples)}
    for k in base:
        rest = [s[k] for s in samples[warmup:]] or [base[k]]
        out |= {f"{k}_after_{warmup}": base[k], f"{k}_max": max(rest), f"{k}_end": rest[-1]}
        out[f"{k}_max_drift"] = max(rest) - base[k]
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--per-client", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-active", type=int, default=4)
    p.add_argument("--memory", type=int, default=200, help="sequential requests (0: skip)")
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import tempfile

    from dflash_server.testing import build_target
    from server_fixtures import build_draft, make_app, run_server

    tmp = Path(tempfile.mkdtemp(prefix="dflash-load-"))
    target = build_target(tmp / "target", arch="qwen3_5")
    draft = build_draft(tmp / "draft", target)
    app = make_app(
        target, draft, max_active=a.max_active, max_queue=64, context_length=1024,
        stream_interval=0.0,
    )  # fmt: skip
    load1 = os.getloadavg()[0]
    with run_server(app) as srv:
        reference: dict[Any, str] = {}
        rows = []
        for n in a.clients:
            rep = asyncio.run(run_load(srv.base_url, n, a.per_client, a.max_tokens, reference))
            rows.append(rep.row())
            print(json.dumps(rows[-1]), flush=True)
        mem = None
        if a.memory:
            mem = memory_summary(asyncio.run(memory_run(srv.base_url, a.memory, a.max_tokens)))
            print(json.dumps(mem), flush=True)
    print(f"\nload average (1 min) before/after: {load1:.2f} / {os.getloadavg()[0]:.2f}")
    cols = ["clients", "requests", "completed", "cancelled", "failed", "greedy_checked"]
    cols += ["greedy_mismatch", "unterminated", "ttft_p50_ms", "ttft_p95_ms", "e2e_p50_s"]
    cols += ["e2e_p95_s", "tok_s", "healthy"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for row in rows:
        cells = [f"{row[c]:.3g}" if isinstance(row[c], float) else str(row[c]) for c in cols]
        print("| " + " | ".join(cells) + " |")
    if mem:
        print("\n" + "\n".join(f"{k}: {v:.2f}" for k, v in mem.items()))
    bad = any(r["greedy_mismatch"] or r["unterminated"] or not r["healthy"] for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
