"""The soak's memory samples and their analysis (tests/load/soak.py): RSS, MLX memory and the
caches' own sizes from /metrics, and per server run whether growth is a cache's, within budget.
"""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

MB = 2**20
BUDGETS = {"prefix_ram": 2 * MB, "prefix_disk": 5 * MB, "suffix": 2 * MB}  # the soak's server


async def memory_sample(base: str, segment: int, t: float) -> dict[str, float] | None:
    """RSS, MLX memory and the caches' sizes as /metrics reports them now."""
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            text = (await http.get(f"{base}/metrics")).text
    except httpx.TransportError:
        return None  # restarting
    m = {
        (s.name, s.labels.get("kind", "")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
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
    }


def memory_analysis(samples: list[dict], warmup_s: float = 60.0) -> dict[str, Any]:
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
        out[f"run {segment}"] = entry
    return out
