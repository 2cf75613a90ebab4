"""The soak's memory samples and their analysis (tests/load/soak.py): RSS, MLX memory and the
caches' own sizes from /metrics, and per server run whether growth is a cache's, within budget.
Each sample also holds the tokens committed so far by source (drafter, suffix copy, plain step):
counters that start again at each server run, so ``committed_by_source`` sums each run's last.
"""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

MB = 2**20
BUDGETS = {"prefix_ram": 2 * MB, "prefix_disk": 5 * MB, "suffix": 2 * MB}  # each soak server
SOURCES = ("drafter", "suffix", "plain")  # dflash_committed_tokens{source=...}


async def memory_sample(base: str, segment: int, t: float) -> dict[str, float] | None:
    """RSS, MLX memory and the caches' sizes as /metrics reports them now."""
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            text = (await http.get(f"{base}/metrics")).text
    except httpx.TransportError:
        return None  # restarting
    m = {
        (s.name, s.labels.get("kind", s.labels.get("source", ""))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    committed = {
        f"{source}_tokens": m.get(("dflash_committed_tokens_total", source), 0.0)
        for source in SOURCES
    }
    return {
        "t_s": round(t, 1),
        "segment": segment,
        "rss_mb": m.get(("dflash_process_resident_bytes", ""), 0) / MB,
        "mlx_active_mb": m[("dflash_mlx_memory_bytes", "active")] / MB,
        "mlx_cache_mb": m[("dflash_mlx_memory_bytes", "cache")] / MB,
        "mlx_peak_mb": m[("dflash_mlx_memory_bytes", "peak")] / MB,
        "prefix_ram_mb": m.get(("dflash_prefix_cache_bytes", ""), 0) / MB,
        "prefix_disk_mb": m.get(("dflash_prefix_cache_disk_bytes", ""), 0) / MB,
        "suffix_mb": m.get(("dflash_suffix_index_bytes", ""), 0) / MB,
        "disk_writable": m.get(("dflash_prefix_cache_disk_writable", ""), 1),
        **committed,
    }


def committed_by_source(samples: list[dict]) -> dict[str, Any]:
    """Tokens committed by each source over all server runs, and the suffix copies' share."""
    total = dict.fromkeys(SOURCES, 0)
    for segment in {s["segment"] for s in samples}:
        last = [s for s in samples if s["segment"] == segment][-1]  # counters only grow
        for source in SOURCES:
            total[source] += int(last.get(f"{source}_tokens", 0))
    n = sum(total.values())
    return {**total, "suffix_share": round(total["suffix"] / n, 3) if n else None}


def memory_analysis(
    samples: list[dict], warmup_s: float = 60.0, server: str = "main"
) -> dict[str, Any]:
    """Per server run: each cache's peak (against its budget), and the RSS growth that MLX's
    memory and the suffix index do not explain, from the first sample after ``warmup_s`` on (a
    run with fewer than 3 samples after it is too short to judge). The prefix cache's RAM tier
    is MLX arrays (inside MLX's active bytes); MLX's buffer cache counts when it grows only
    (freed buffers may stay in the process's heap)."""
    out = {}
    for segment in sorted({s["segment"] for s in samples}):
        run = [s for s in samples if s["segment"] == segment]
        warm = [s for s in run if s["t_s"] >= run[0]["t_s"] + warmup_s]
        entry: dict[str, Any] = {
            "samples": len(run),
            "rss_first_last_max_mb": [
                round(run[0]["rss_mb"], 1),
                round(run[-1]["rss_mb"], 1),
                round(max(s["rss_mb"] for s in run), 1),
            ],
            **{f"{c}_max_mb": round(max(s[f"{c}_mb"] for s in run), 2) for c in BUDGETS},
            "judged": len(warm) >= 3,
        }
        if entry["judged"]:
            base = warm[0]

            def unexplained(s: dict, base: dict = base) -> float:
                d = {k: s[k] - base[k] for k in ("rss_mb", "mlx_active_mb", "suffix_mb")}
                cache = max(0.0, s["mlx_cache_mb"] - base["mlx_cache_mb"])
                return d["rss_mb"] - d["mlx_active_mb"] - d["suffix_mb"] - cache

            entry["rss_growth_after_warmup_mb"] = round(run[-1]["rss_mb"] - base["rss_mb"], 1)
            entry["unexplained_max_growth_mb"] = round(max(unexplained(s) for s in warm), 1)
        out[f"{server} run {segment}"] = entry
    return out
