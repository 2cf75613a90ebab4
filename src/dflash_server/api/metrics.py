"""Prometheus metrics at ``GET /metrics`` and the ``x-request-id`` header on every response.

Requests are counted by endpoint and status by an ASGI middleware (which also names each
request: the client's ``x-request-id`` when it is a plain token, else a new one). Generation
metrics come from the jobs themselves: ``MeteredJob`` records its events as the engine's worker
emits them (time to first token, per-token latency, tokens, tau and acceptance, cycles and
tokens by source, outcome), and the engine reports each batched pass (``Metrics.observe_pass``,
given to it at construction); queue depth, active requests, the KV memory reserved, the prefix
cache's counters and each loaded model's info (``model_gauges.py``) are read at each scrape.
Each app has its own registry, so several servers in one process (tests) do not share counters.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dflash_server.api.model_gauges import ModelGauges, ModelInfo
from dflash_server.engine.jobs import Event, Failed, Finished, Job, TextChunk
from dflash_server.engine.models import ModelSet
from dflash_server.engine.worker import Engine
from dflash_server.generation.request import GenerationRequest

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2)
_TAU = (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10, 12, 16)
_RATE = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
_SIZES = (1, 2, 4, 8, 12, 16, 24, 32)
_VERIFY = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

# Paths with a label of their own; anything else is counted as "other" (bounded cardinality).
_ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/v1/models",
    "/health",
    "/metrics",
)
_PREFIXES = (("/v1/models/", "/v1/models/{id}"), ("/v1/responses/", "/v1/responses/{id}"))
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def endpoint_label(path: str) -> str:
    if path in _ENDPOINTS:
        return path
    for prefix, label in _PREFIXES:
        if path.startswith(prefix):
            return label
    return "other"


class Metrics:
    """The server's metrics, in one registry."""

    def __init__(self) -> None:
        disable_created_metrics()  # no *_created series: timestamps of first use are noise here
        self.registry = r = CollectorRegistry()
        by_endpoint = ["endpoint"]
        self.requests = Counter(
            "dflash_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.generations = Counter(
            "dflash_generations",
            "generations by endpoint and outcome (finish reason, failed, cancelled)",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "dflash_prompt_tokens", "prompt tokens of finished generations", by_endpoint, registry=r
        )
        self.generated_tokens = Counter(
            "dflash_generated_tokens", "tokens generated", by_endpoint, registry=r
        )
        self.cached_tokens = Counter(
            "dflash_cached_prompt_tokens",
            "prompt tokens restored from the prefix cache",
            registry=r,
        )
        self.ttft = Histogram(
            "dflash_time_to_first_token_seconds",
            "submit to first text, queue wait and prefill included",
            by_endpoint,
            buckets=_LATENCY,
            registry=r,
        )
        self.per_token = Histogram(
            "dflash_time_per_output_token_seconds",
            "mean time per token after the first, per generation",
            by_endpoint,
            buckets=_PER_TOKEN,
            registry=r,
        )
        self.duration = Histogram(
            "dflash_generation_duration_seconds",
            "submit to last event",
            by_endpoint,
            buckets=_LATENCY,
            registry=r,
        )
        self.queue_wait = Histogram(
            "dflash_queue_wait_seconds",
            "time waiting for an active slot",
            buckets=_LATENCY,
            registry=r,
        )
        self.tau = Histogram(
            "dflash_tau",
            "tokens committed per target forward, per generation",
            buckets=_TAU,
            registry=r,
        )
        self.acceptance = Histogram(
            "dflash_acceptance_rate",
            "share of drafted tokens accepted, per generation",
            buckets=_RATE,
            registry=r,
        )
        self.accepted = Histogram(
            "dflash_accepted_drafts",
            "drafted tokens accepted per cycle",
            buckets=tuple(range(16)),
            registry=r,
        )
        self.block_size = Histogram(
            "dflash_block_size",
            "verify width per generation (1: plain decoding)",
            buckets=_SIZES,
            registry=r,
        )
        self.source_cycles = Counter(
            "dflash_cycles",
            "target passes by where their drafts came from (drafter, suffix copy, plain step)",
            ["source"],
            registry=r,
        )
        self.source_tokens = Counter(
            "dflash_committed_tokens",
            "tokens committed by the source of the cycle that committed them",
            ["source"],
            registry=r,
        )
        self.batch_rows = Histogram(
            "dflash_batch_rows",
            "requests (rows) per batched target pass",
            buckets=_SIZES,
            registry=r,
        )
        by_model = ["model"]
        self.model_generations = Counter(
            "dflash_model_generations",
            "generations by model and outcome (finish reason, failed, cancelled)",
            ["model", "outcome"],
            registry=r,
        )
        self.model_tokens = Counter(
            "dflash_model_generated_tokens", "tokens generated, by model", by_model, registry=r
        )
        self.embedding_inputs = Counter(
            "dflash_embedding_inputs", "inputs embedded, by model", by_model, registry=r
        )
        self.embedding_tokens = Counter(
            "dflash_embedding_tokens", "tokens embedded, by model", by_model, registry=r
        )
        self.batch_verify = Histogram(
            "dflash_batch_verify_tokens",
            "positions verified per batched target pass (rows x width)",
            buckets=_VERIFY,
            registry=r,
        )

    def observe_pass(self, rows: int, verified: int) -> None:
        """One batched pass (the engine's ``on_pass``, called on its worker thread)."""
        self.batch_rows.observe(rows)
        self.batch_verify.observe(verified)

    def exposition(self, models: ModelSet) -> bytes:
        """The Prometheus text: what was counted, then each loaded model's info and the
        engine's gauges as they are now (with several models: each model's, labelled by model)."""
        gauges: Collector = (
            _EngineGauges(models.single) if models.single is not None else ModelGauges(models)
        )
        return b"".join(generate_latest(c) for c in (self.registry, ModelInfo(models), gauges))

    def job(self, request: GenerationRequest, endpoint: str, model: str = "") -> MeteredJob:
        return MeteredJob(request, self, endpoint, model)

    def embedded(self, model: str, inputs: int, tokens: int) -> None:
        self.embedding_inputs.labels(model).inc(inputs)
        self.embedding_tokens.labels(model).inc(tokens)

    def finished(self, job: MeteredJob, done: Finished, now: float) -> None:
        e = job.endpoint
        self.model_generations.labels(job.model, done.finish_reason).inc()
        self.model_tokens.labels(job.model).inc(done.completion_tokens)
        self.generations.labels(e, done.finish_reason).inc()
        self.prompt_tokens.labels(e).inc(done.prompt_tokens)
        self.generated_tokens.labels(e).inc(done.completion_tokens)
        self.cached_tokens.inc(done.cached_tokens)
        self.duration.labels(e).observe(now - job.created)
        if job.first_text is not None and done.completion_tokens > 1:
            self.per_token.labels(e).observe((now - job.first_text) / (done.completion_tokens - 1))
        if done.timings is not None:
            self.queue_wait.observe(done.timings.queue_wait_s)
        self.block_size.observe(done.block_size)
        stats = done.stats
        for source, counts in ({} if stats is None else stats.sources).items():
            self.source_cycles.labels(source).inc(counts["cycles"])
            self.source_tokens.labels(source).inc(counts["tokens"])
        if done.speculative and stats is not None and stats.cycles:
            self.tau.observe(stats.tau)
            self.acceptance.observe(stats.acceptance_rate)
            for accepted, cycles in enumerate(stats.acceptance_histogram):
                for _ in range(cycles):  # no bulk observe in prometheus_client
                    self.accepted.observe(accepted)


class MeteredJob(Job):
    """A Job that records its events in ``Metrics`` as the worker emits them (thread-safe)."""

    def __init__(
        self, request: GenerationRequest, metrics: Metrics, endpoint: str, model: str = ""
    ) -> None:
        super().__init__(request)
        self.metrics, self.endpoint, self.model = metrics, endpoint, model
        self.first_text: float | None = None

    def emit(self, event: Event) -> None:
        now = time.monotonic()
        if isinstance(event, TextChunk) and self.first_text is None and event.tokens:
            self.first_text = now
            self.metrics.ttft.labels(self.endpoint).observe(now - self.created)
        elif isinstance(event, Finished):
            self.metrics.finished(self, event, now)
        elif isinstance(event, Failed):
            outcome = "cancelled" if self.cancelled else "failed"
            self.metrics.generations.labels(self.endpoint, outcome).inc()
            self.metrics.model_generations.labels(self.model, outcome).inc()
        super().emit(event)


class _EngineGauges(Collector):
    """The engine's load and its prefix cache's counters, read when scraped."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Any]:
        engine = self.engine
        yield GaugeMetricFamily(
            "dflash_active_rows", "requests running as rows of the batch", engine.active_rows
        )
        waiting = max(0, engine.queue_depth - engine.active)
        yield GaugeMetricFamily(
            "dflash_queue_depth", "requests waiting for an active slot", waiting
        )
        yield GaugeMetricFamily("dflash_active_requests", "requests generating now", engine.active)
        if (kv := engine.kv_memory) is not None:  # the KV budget (docs/operations.md)
            yield GaugeMetricFamily(
                "dflash_kv_memory_bytes",
                "KV cache memory the running requests reserve",
                kv["in_use_bytes"],
            )
            yield GaugeMetricFamily(
                "dflash_kv_memory_budget_bytes", "the KV memory budget", kv["budget_bytes"]
            )
        if ranks := engine.rank_memory:  # the target sharded over several machines
            memory = GaugeMetricFamily(
                "dflash_rank_memory_bytes",
                "MLX memory of each rank (active and peak bytes) as of the last round",
                labels=["rank", "kind"],
            )
            for rank, (active, peak) in enumerate(ranks):
                memory.add_metric([str(rank), "active"], active)
                memory.add_metric([str(rank), "peak"], peak)
            yield memory
        yield from _memory_gauges(engine)
        cache = engine.prefix_cache
        if cache is None:
            return
        stats = cache.stats()
        for name in ("hits", "misses"):
            if name in stats:
                yield CounterMetricFamily(
                    f"dflash_prefix_cache_{name}", f"prefix cache lookups ({name})", stats[name]
                )
        for name in (
            "entries",
            "bytes",
            "budget_bytes",
            "disk_entries",
            "disk_bytes",
            "disk_pending_bytes",
        ):
            if name in stats:
                yield GaugeMetricFamily(
                    f"dflash_prefix_cache_{name}", f"prefix cache {name}", stats[name]
                )
        if "disk_writable" in stats:
            yield GaugeMetricFamily(
                "dflash_prefix_cache_disk_writable",
                "1 while the disk tier writes; 0 after a write failed (read-only or full)",
                stats["disk_writable"],
            )


def _memory_gauges(engine: Engine) -> Iterator[Any]:
    """The process's memory and what holds it: RSS, MLX's allocator, the suffix index (the
    prefix cache's own bytes follow), so growth can be matched to a cache and its budget."""
    import mlx.core as mx

    if (rss := _rss_bytes()) is not None:
        yield GaugeMetricFamily("dflash_process_resident_bytes", "resident memory (RSS)", rss)
    mlx = GaugeMetricFamily(
        "dflash_mlx_memory_bytes",
        "MLX memory: active (arrays alive), peak (since start), cache (freed, kept for reuse)",
        labels=["kind"],
    )
    mlx.add_metric(["active"], mx.get_active_memory())
    mlx.add_metric(["peak"], mx.get_peak_memory())
    mlx.add_metric(["cache"], mx.get_cache_memory())
    yield mlx
    if engine.served is not None:
        index = engine.served.suffix_index
        yield GaugeMetricFamily(
            "dflash_suffix_index_bytes", "the shared suffix index's memory", index.bytes
        )
        yield GaugeMetricFamily(
            "dflash_suffix_index_budget_bytes", "the suffix index's budget", index.budget
        )


def _rss_bytes() -> int | None:
    """This process's resident memory (Linux's /proc; elsewhere none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


class RequestMetrics:
    """ASGI middleware: a request id on every response, and requests counted by status."""

    def __init__(self, app: ASGIApp, *, metrics: Metrics | None) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if self.metrics is not None:
                label = endpoint_label(scope["path"])
                self.metrics.requests.labels(label, str(status)).inc()


router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    state = request.app.state
    return Response(state.metrics.exposition(state.models), media_type=CONTENT_TYPE_LATEST)
