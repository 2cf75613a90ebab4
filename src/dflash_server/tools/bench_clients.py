"""``dflash-serve bench --concurrency N``: what N clients at once get on this machine.

Runs the server's own engine (batched speculation, the queue and ``--max-active`` as
``dflash-serve`` would set them; the prefix cache off, so repeated prompts stay cold) and sends
N requests at once, for each N and mode (``plain``: plain batched decoding; ``auto``/a block
size: speculation), interleaved. Reported per N and mode: total tokens/s over all clients (from
submitting to the last token: prefills and queueing included), the median client's decode
tokens/s, TTFT p50, the p95 gap between a client's token arrivals, and rows per batched pass:
each the median over ``--repeats`` bursts (3 by default) with its range, and a verdict per
client count that calls a difference inside the bursts' noise that (``bench_noise.py``).
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
from dflash_server.tools.bench_noise import ratio_cell, spread, verdict

WARM_TOKENS = 8  # the unmeasured burst before each client count: enough to run every pass shape
Bursts = dict[tuple[int, str], list[dict[str, Any]]]  # (clients, mode): each burst's measures


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


def _request(
    models: LoadedModels, ids: list[int], mode: str, args: Any, tokens: int
) -> GenerationRequest:
    draft = None if mode == "plain" else models.pair.draft
    size: BlockSize | None = "auto" if mode == "auto" else int(mode) if mode.isdigit() else None
    return GenerationRequest(
        tuple(ids),
        tokens,
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
    """Rows per (clients, mode): medians and ranges over ``args.repeats`` bursts, modes
    interleaved, each burst after an unmeasured short one at the same load."""
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
    bursts: Bursts = {}
    try:
        for n in levels:
            for mode in modes:  # the first passes at n rows compile and allocate: not measured
                asyncio.run(_burst(engine, _requests(models, prompts, n, mode, args, WARM_TOKENS)))
            for _ in range(args.repeats):
                for mode in modes:
                    rows_seen.clear()
                    requests = _requests(models, prompts, n, mode, args, args.max_tokens)
                    burst = asyncio.run(_burst(engine, requests))
                    burst["rows_per_pass"] = statistics.mean(rows_seen) if rows_seen else 0.0
                    bursts.setdefault((n, mode), []).append(burst)
    finally:
        # The worker is idle once every burst ended: joined here, so that no thread of the
        # engine outlives the bench (docs/development.md, "MLX on other threads").
        engine.stop(timeout=60.0)
    return [_row(n, mode, runs, bursts, engine.max_active) for (n, mode), runs in bursts.items()]


def _requests(
    models: LoadedModels, prompts: list[list[int]], n: int, mode: str, args: Any, tokens: int
) -> list[GenerationRequest]:
    return [_request(models, prompts[i % len(prompts)], mode, args, tokens) for i in range(n)]


def _row(
    n: int,
    mode: str,
    runs: list[dict[str, Any]],
    bursts: Bursts,
    max_active: int,
) -> dict[str, Any]:
    """One cell per measure: the median over repeats and its range; each burst's ratio to the
    plain burst beside it (the noise the verdict reads)."""
    row: dict[str, Any] = {"clients": n, "mode": mode, "max_active": max_active}
    for key in runs[0]:
        values = [b[key] for b in runs]
        row[key] = round(statistics.median(values), 3)
        row[f"{key}_range"] = [round(min(values), 3), round(max(values), 3)]
    plain = bursts.get((n, "plain"), [])
    paired = [b["total_tok_s"] / p["total_tok_s"] for b, p in zip(runs, plain) if p["total_tok_s"]]
    row["speedup_runs"] = [round(x, 3) for x in paired]
    row["speedup"] = round(statistics.median(paired), 3) if paired else None
    if mode != "plain" and paired:
        row["vs_plain"] = row["speedup"]
    return row


def clients_table(rows: list[dict[str, Any]]) -> str:
    """Each cell the median over repeats, with its lowest and highest in brackets."""
    head = ["clients", "mode", "total tok/s", "vs plain", "per client tok/s", "TTFT p50 s",
            "gap p95 ms", "rows/pass"]  # fmt: skip
    lines = [" | ".join(head), " | ".join("-" * len(h) for h in head)]
    for r in rows:
        vs = "-" if r["mode"] == "plain" else ratio_cell(r)
        cells = [str(r["clients"]), r["mode"], _cell(r, "total_tok_s", 1), vs,
                 _cell(r, "client_tok_s", 1), _cell(r, "ttft_p50_s", 3),
                 _cell(r, "gap_p95_ms", 0), _cell(r, "rows_per_pass", 1)]  # fmt: skip
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def _cell(row: dict[str, Any], key: str, digits: int) -> str:
    low, high = row[f"{key}_range"]
    return spread(row[key], low, high, digits)


def clients_verdict(rows: list[dict[str, Any]]) -> str:
    """Per client count, the bench's verdict on speculation against plain batched decoding
    at the same load (a best mode only when it beat plain in every burst)."""
    lines = []
    for n in sorted({r["clients"] for r in rows}):
        who = f"{n} client{'s' if n > 1 else ''}"
        at_n = [r for r in rows if r["clients"] == n]
        lines.append(f"{who}: {verdict(at_n, remedy='more --repeats')}")
    return "\n".join(lines)
