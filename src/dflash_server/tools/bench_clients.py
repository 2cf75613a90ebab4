"""``dflash-serve bench --concurrency N``: what N clients at once get on this machine.

Runs the server's own engine (batched speculation, the queue and ``--max-active`` as
``dflash-serve`` would set them; the prefix cache off, so repeated prompts stay cold) and sends
N requests at once, for each N and mode (``plain``: plain batched decoding; ``auto``/a block
size: speculation), interleaved. Reported per N and mode: total tokens/s over all clients (from
submitting to the last token: prefills and queueing included), the median client's decode
tokens/s, TTFT p50, the p95 gap between a client's token arrivals, and rows per batched pass.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from dflash_server.engine.jobs import Failed, Finished, Job, TextChunk
from dflash_server.engine.loader import LoadedModels
from dflash_server.engine.worker import Engine
from dflash_server.generation.request import (
    BlockSize,
    GenerationRequest,
    block_policy,
    trained_block,
)
from dflash_server.generation.sampling import SamplingParams


def parse_levels(text: str) -> list[int]:
    """ "1,4,8" -> [1, 4, 8]; a clear error for anything else."""
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise SystemExit(
            f"dflash-serve bench: error: --concurrency wants client counts like 1,4,8, got {text!r}"
        )
    return levels


async def _client(job: Job) -> dict[str, Any]:
    """One client's arrivals: (seconds since submit, tokens) per event, and how it ended."""
    arrivals: list[tuple[float, int]] = []
    while True:
        events = await job.next_events()
        if not events:
            raise RuntimeError("the engine ended a request without a final event")
        now = time.monotonic() - job.created
        for event in events:
            if isinstance(event, TextChunk) and event.tokens:
                arrivals.append((now, event.tokens))
            elif isinstance(event, Failed):
                raise RuntimeError(f"a request failed: {event.message}")
            elif isinstance(event, Finished):
                return {"arrivals": arrivals, "tokens": event.completion_tokens}


async def _burst(engine: Engine, requests: list[GenerationRequest]) -> dict[str, Any]:
    """Submit every request at once; wait for all of them."""
    start = time.monotonic()
    jobs = [Job(r) for r in requests]
    for job in jobs:
        engine.submit(job)
    clients = await asyncio.gather(*(_client(j) for j in jobs))
    wall = time.monotonic() - start
    ttft = [c["arrivals"][0][0] for c in clients if c["arrivals"]]
    gaps = [b[0] - a[0] for c in clients for a, b in zip(c["arrivals"], c["arrivals"][1:])]
    decode = [
        (c["tokens"] - c["arrivals"][0][1]) / (c["arrivals"][-1][0] - c["arrivals"][0][0])
        for c in clients
        if len(c["arrivals"]) > 1 and c["arrivals"][-1][0] > c["arrivals"][0][0]
    ]
    return {
        "total_tok_s": sum(c["tokens"] for c in clients) / wall,
        "client_tok_s": statistics.median(decode) if decode else 0.0,
        "ttft_p50_s": statistics.median(ttft) if ttft else 0.0,
        "gap_p95_ms": 1e3 * (statistics.quantiles(gaps, n=20)[-1] if len(gaps) > 1 else 0.0),
    }


def _request(models: LoadedModels, ids: list[int], mode: str, args: Any) -> GenerationRequest:
    draft = None if mode == "plain" else models.pair.draft
    size: BlockSize | None = "auto" if mode == "auto" else int(mode) if mode.isdigit() else None
    return GenerationRequest(
        tuple(ids),
        args.max_tokens,
        SamplingParams(temperature=args.temperature),
        seed=0,
        block=block_policy(trained_block(draft), size, clamp=True),
        skip_special_tokens=True,
    )


def run_clients(
    models: LoadedModels,
    prompts: list[list[int]],
    levels: list[int],
    modes: list[str],
    args: Any,
    settings: Any,
) -> list[dict[str, Any]]:
    """Rows per (clients, mode): medians over ``args.repeats`` bursts, modes interleaved."""
    rows_seen: list[int] = []
    engine = Engine(
        lambda: models,
        max_queue=max(levels),
        max_active=settings.max_active,
        prefill_step_size=settings.prefill_step_size,
        batching=settings.batching,
        max_verify=settings.max_verify,
        kv=settings.kv_quant,
        on_pass=lambda rows, verified: rows_seen.append(rows),
    )
    engine.start()
    if not engine.wait_ready():
        raise RuntimeError(f"the engine did not start: {engine.error}")
    results: dict[tuple[int, str], list[dict[str, Any]]] = {}
    try:
        for n in levels:
            for _ in range(args.repeats):
                for mode in modes:
                    requests = [_request(models, prompts[i % len(prompts)], mode, args)
                                for i in range(n)]  # fmt: skip
                    rows_seen.clear()
                    burst = asyncio.run(_burst(engine, requests))
                    burst["rows_per_pass"] = statistics.mean(rows_seen) if rows_seen else 0.0
                    results.setdefault((n, mode), []).append(burst)
    finally:
        engine.stop()
    out = []
    for (n, mode), bursts in results.items():
        row: dict[str, Any] = {"clients": n, "mode": mode, "max_active": engine.max_active}
        for key in bursts[0]:
            row[key] = round(statistics.median(b[key] for b in bursts), 3)
        out.append(row)
    for row in out:  # speculation against plain batched decoding at the same load
        plain = next((r for r in out if r["clients"] == row["clients"] and r["mode"] == "plain"),
                     None)  # fmt: skip
        if plain and plain["total_tok_s"] and row is not plain:
            row["vs_plain"] = round(row["total_tok_s"] / plain["total_tok_s"], 3)
    return out


def clients_table(rows: list[dict[str, Any]]) -> str:
    head = ["clients", "mode", "total tok/s", "vs plain", "per client tok/s", "TTFT p50 s",
            "gap p95 ms", "rows/pass"]  # fmt: skip
    lines = [" | ".join(head), " | ".join("-" * len(h) for h in head)]
    for r in rows:
        vs = r.get("vs_plain")
        cells = [str(r["clients"]), r["mode"], f"{r['total_tok_s']:.1f}",
                 "-" if vs is None else f"x{vs:.2f}", f"{r['client_tok_s']:.1f}",
                 f"{r['ttft_p50_s']:.3f}", f"{r['gap_p95_ms']:.0f}",
                 f"{r['rows_per_pass']:.1f}"]  # fmt: skip
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def clients_verdict(rows: list[dict[str, Any]]) -> str:
    """Per client count, the best mode and what it gives over plain batched decoding."""
    parts = []
    for n in sorted({r["clients"] for r in rows}):
        best = max((r for r in rows if r["clients"] == n), key=lambda r: r["total_tok_s"])
        vs = best.get("vs_plain")
        gain = f" (x{vs:.2f} over plain)" if vs and best["mode"] != "plain" else ""
        who = f"{n} client{'s' if n > 1 else ''}"
        parts.append(f"{who}: {best['mode']} {best['total_tok_s']:.0f} tok/s in all{gain}")
    return "; ".join(parts)
