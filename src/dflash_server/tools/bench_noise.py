"""What ``bench`` concludes from repeated runs: a mode is called faster than plain decoding only
when every run of it beat the plain run interleaved with it; inside the runs' spread, the
verdict says it cannot tell them apart. Shared by the single-stream bench and
``bench --concurrency`` (docs/tools.md, "bench")."""

from __future__ import annotations

from typing import Any


def spread(median: float, low: float, high: float, digits: int) -> str:
    """ "median (lowest-highest)" over repeats; the median alone when they round alike."""
    if round(low, digits) == round(high, digits):
        return f"{median:.{digits}f}"
    return f"{median:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def ratio_cell(row: dict[str, Any]) -> str:
    """The median ratio to plain decoding, with its lowest and highest run (the noise)."""
    if row.get("speedup") is None:
        return "-"
    runs = row["speedup_runs"]
    noise = f" ({min(runs):.2f}-{max(runs):.2f})" if row["mode"] != "plain" and runs else ""
    return f"x{row['speedup']:.2f}{noise}"


def verdict(rows: list[dict[str, Any]], remedy: str = "add prompts or --repeats") -> str:
    """Name a block size only when it is faster than plain decoding in every paired run (the
    spread of its ratios excludes 1); a difference inside the runs' noise is called that.

    ``rows``: per mode, ``speedup`` (the median ratio to plain) and ``speedup_runs`` (each
    run's ratio to the plain run beside it); ``remedy``: what gives more runs."""
    spec = [r for r in rows if r["mode"] != "plain" and r["speedup"] is not None]
    if not spec:
        return "no speculative mode measured"
    if any(len(r["speedup_runs"]) < 2 for r in spec):
        return f"one run per mode cannot tell a difference from noise: {remedy}"
    faster = [r for r in spec if min(r["speedup_runs"]) > 1]
    best = max(faster or spec, key=lambda r: r["speedup"])
    runs = best["speedup_runs"]
    noise = f"x{min(runs):.2f} to x{max(runs):.2f} over {len(runs)} runs"
    if faster:
        ratio = f"x{best['speedup']:.2f} over plain decoding"
        return f"best: block size {best['mode']}, {ratio} ({noise})"
    seen = f"x{best['speedup']:.2f}; {noise}"
    if all(max(r["speedup_runs"]) < 1 for r in spec):
        return (
            f"DFlash does not pay on this machine with these prompts (best: {best['mode']}, "
            f"{seen}): serve with --no-speculative, or keep --block-size auto, which falls back "
            "to plain decoding by itself"
        )
    return (
        "no block size beats plain decoding in every run, so this run cannot tell them apart "
        f"(no difference beyond the noise; best: {best['mode']}, {seen}): more --repeats "
        "narrow it, and --block-size auto decodes plainly where speculation does not pay"
    )
