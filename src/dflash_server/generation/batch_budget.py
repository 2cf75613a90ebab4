"""The verify budget of a batched pass: what a pass costs by its rows, and the widths it affords.

A row's controller picks the width best for it alone (``controller.py``); in a batch every row
pays for the widest row (all are padded to it) and a pass of many rows turns compute-bound, so
``choose_widths`` caps the adaptive rows' widths at the cap that gives the batch the most
expected committed tokens per second (at high concurrency that may be 1: plain batched
decoding). ``PassCosts`` is measured at load (``measure_pass_costs``): plain passes of 1..16
rows, speculative passes (one batched drafter pass plus a recorded verify) of 1..8 rows x 16,
so the engine can also say how many rows are worth running at once (``rows_supported``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.generate import generation_stream

from dflash_server.generation.costs import CostModel
from dflash_server.generation.policy import Choice

if TYPE_CHECKING:
    from dflash_server.generation.row import Row


@dataclass
class PassCosts:
    """Seconds per batched pass: ``plain`` by rows (width 1), ``speculative`` by verified
    positions (rows x width, drafter pass included)."""

    plain: dict[int, float]
    speculative: dict[int, float]
    measured_s: float = 0.0

    def cost(self, rows: int, width: int) -> float:
        if width <= 1:
            return max(CostModel._interp(self.plain, rows), 1e-6)
        return max(CostModel._interp(self.speculative, rows * width), 1e-6)

    def rows_supported(self, gain: float = 1.15, most: int = 16) -> int:
        """Rows worth running at once: doubling them still raises plain batched throughput by
        ``gain`` (beyond that a pass is compute-bound and rows only wait longer)."""
        rows = 1
        while 2 * rows <= most:
            now = rows / self.cost(rows, 1)
            if 2 * rows / self.cost(2 * rows, 1) < gain * now:
                break
            rows *= 2
        return rows

    def describe(self) -> str:
        plain = ", ".join(f"{r}: {1e3 * t:.1f}" for r, t in sorted(self.plain.items()))
        spec = ", ".join(f"{p}: {1e3 * t:.1f}" for p, t in sorted(self.speculative.items()))
        return (
            f"batched pass cost (ms): plain by rows {{{plain}}}; speculative by verified "
            f"positions {{{spec}}}; rows supported {self.rows_supported()} "
            f"(measured in {self.measured_s:.1f} s)"
        )


def choose_widths(rows: list[Row], choices: list[Choice], costs: PassCosts) -> list[int]:
    """Cap the adaptive rows' chosen widths where the batch's tokens per second is highest
    (a fixed width is the request's own choice: kept)."""
    wanted = [c.size for c in choices]
    adaptive = [row.policy.adaptive for row in rows]
    if not any(adaptive):
        return wanted

    def widths(cap: int) -> list[int]:
        return [min(w, cap) if a else w for w, a in zip(wanted, adaptive)]

    def value(cap: int) -> float:
        ws = widths(cap)
        tokens = sum(r.policy.expected(c, w) for r, c, w in zip(rows, choices, ws))
        return tokens / costs.cost(len(ws), max(ws))

    caps = sorted({1, *wanted})
    return widths(max(caps, key=value))


def measure_pass_costs(
    target: Any, draft: Any, *, context: int = 64, width: int = 16, budget_s: float = 8.0
) -> PassCosts:
    """Time plain passes of 1, 2, 4, 8, 16 rows and speculative ones of 1, 2, 4, 8 rows x
    ``width`` (batched drafter pass + recorded verify) on ``context``-token rows; medians of
    up to 3 runs after a warm-up, fewer once ``budget_s`` is spent. Runs MLX work: call it on
    the thread that owns the models."""
    from dflash_server.generation.batch_draft import propose_rows
    from dflash_server.generation.protocols import DraftRow
    from dflash_server.generation.sampling import SamplingParams, TokenSampler

    start = time.perf_counter()
    greedy = TokenSampler(SamplingParams())
    mask_id = draft.config.mask_token_id

    def timed(rows: int, w: int) -> float:
        ids = (mx.arange(rows * (context + w)).reshape(rows, -1) % 97) + 1
        with mx.stream(generation_stream):
            cache = target.make_cache()
            _, taps = target.forward(ids[:, :context], cache, slice(-1, None))
            drafts = []
            for r in range(rows):
                c = draft.make_cache()
                draft.append_context(taps[r : r + 1], c, ids[r, :context])
                block = mx.array([[1] + [mask_id] * (w - 1)])
                drafts.append(DraftRow(draft, block, None, c, greedy, None))
            mx.eval([c.state for c in cache], [c.state for d in drafts for c in d.cache])
        saved = [None if c.is_trimmable() else list(c.cache) for c in cache]

        def once() -> float:
            with mx.stream(generation_stream):
                t0 = time.perf_counter()
                tokens = ids[:, context : context + w]
                if w > 1:
                    proposals = propose_rows(drafts)
                    mx.eval([p[0] for p in proposals])
                    with target.hooks.recording():
                        logits, t = target.forward(tokens, cache, slice(None))
                else:
                    logits, t = target.forward(tokens, cache, slice(None))
                mx.eval(mx.argmax(logits, axis=-1), *([] if t is None else [t]))
                seconds = time.perf_counter() - t0
            for c, slots in zip(cache, saved):  # back to the context, untimed
                if slots is None:
                    c.trim(w)
                else:
                    c.cache = list(slots)
            return seconds

        once()  # warm-up
        runs = [once()]
        while len(runs) < 3 and time.perf_counter() - start < budget_s:
            runs.append(once())
        return statistics.median(runs)

    plain = {r: timed(r, 1) for r in (1, 2, 4, 8, 16)}
    speculative = {4: timed(1, 4), **{r * width: timed(r, width) for r in (1, 2, 4, 8)}}
    return PassCosts(plain, _rising(speculative), time.perf_counter() - start)


def _rising(points: dict[int, float]) -> dict[int, float]:
    out, top = {}, 0.0
    for x in sorted(points):
        top = max(top, points[x])
        out[x] = top
    return out
