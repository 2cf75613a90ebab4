"""The verify budget of a batched pass: what a pass costs by its rows, and the widths it affords.

A row's controller picks the width best for it alone (``controller.py``); in a batch every row
pays for the widest row (all are padded to it) and a pass of many rows turns compute-bound, so
``choose_widths`` caps the adaptive rows' widths at the cap that gives the batch the most
expected committed tokens per second (at high concurrency that may be 1: plain batched
decoding). ``PassCosts`` is measured at load (``measure_pass_costs``): plain passes of 1..16
rows, speculative passes (one batched drafter pass plus a recorded verify) of 1..8 rows x 16,
so the engine can also say how many rows are worth running at once (``rows_supported``). Each
row's context adds attention work (the pair's per-token growth, ``CostModel.slope``), and every
pass the engine runs refines the curves (``observe``: a log residual per point, as the cycle
costs do), so a calibration taken at a busy moment is corrected by real traffic.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.generate import generation_stream

from dflash_server.generation.costs import CostModel, context_past
from dflash_server.generation.policy import Choice

if TYPE_CHECKING:
    from dflash_server.generation.row import Row

_PASS_ALPHA = 0.5  # weight of one observed pass (half shared by its kind, half its point's)
_PASS_CLIP = math.log(3.0)  # one pass moves a residual by at most this (log) factor
_EARLY, _EARLY_CLIP = 3, math.log(50.0)  # the first real speculative passes lower the load-time
# calibration to the fastest of them (into the drift all speculative points share: a busy moment
# only adds time); a slower one refines it as later passes do


@dataclass
class PassCosts:
    """Seconds per batched pass: ``plain`` by rows (width 1), ``speculative`` by verified
    positions (rows x width, drafter pass included)."""

    plain: dict[int, float]
    speculative: dict[int, float]
    measured_s: float = 0.0
    context: int = 64  # the rows' context when measured
    slope: dict[int, float] = field(default_factory=dict)  # width -> s per row-context token
    draft_slope: float = 0.0  # a drafted pass's growth per context token its drafter reads
    draft_reach: int | None = None  # a row's context the drafter reads at most (None: all)
    plain_residual: dict[int, float] = field(default_factory=dict)  # rows -> log correction
    spec_residual: dict[int, float] = field(default_factory=dict)  # positions -> log correction
    plain_drift: float = 0.0  # log correction every plain point shares
    spec_drift: float = 0.0  # the same for speculative points
    checked: int = 0  # real speculative passes observed (0: the calibration alone)

    def base(self, rows: int, width: int, contexts: Sequence[int] = ()) -> float:
        """The measured curve at this pass, plus attention over the rows' ``contexts`` past
        the measured one (and, drafted, the drafter's over the part it reads)."""
        points, x = (self.plain, rows) if width <= 1 else (self.speculative, rows * width)
        grow = 0.0
        if self.slope:
            extra = sum(context_past(c, self.context) for c in contexts)
            grow = CostModel._interp(self.slope, width) * extra
        if width > 1 and self.draft_slope:
            reads = sum(context_past(c, self.context, self.draft_reach) for c in contexts)
            grow += self.draft_slope * reads
        return max(CostModel._interp(points, x) + grow, 1e-6)

    def cost(self, rows: int, width: int, contexts: Sequence[int] = ()) -> float:
        """The estimate: the measured curve refined by the passes seen since."""
        return self.base(rows, width, contexts) * math.exp(self._correction(rows, width))

    def observe(self, rows: int, width: int, seconds: float, contexts: Sequence[int] = ()) -> float:
        """Fold a real pass's wall time into the curve (log space, clipped: one slow pass
        cannot flip the budget): half into the drift every point of its kind shares (a busy
        measure inflated them all), half into its own point; the first speculative
        passes, when faster than estimated, go wholly into the drift (``_EARLY``). Return
        log(seconds / estimate)."""
        if not seconds > 0:
            return 0.0
        residuals, x = self._residuals(rows, width)
        error = math.log(seconds / self.base(rows, width, contexts))
        error -= self._correction(rows, width)
        if width > 1:
            self.checked += 1
            if self.checked <= _EARLY and error < 0:  # the calibration's error
                self.spec_drift += max(-_EARLY_CLIP, error)
                return error
        step = _PASS_ALPHA / 2 * max(-_PASS_CLIP, min(_PASS_CLIP, error))
        residuals[x] = (CostModel._interp(residuals, x) if residuals else 0.0) + step
        if width <= 1:
            self.plain_drift += step
        else:
            self.spec_drift += step
        return error

    def _correction(self, rows: int, width: int) -> float:
        residuals, x = self._residuals(rows, width)
        drift = self.plain_drift if width <= 1 else self.spec_drift
        return drift + (CostModel._interp(residuals, x) if residuals else 0.0)

    def _residuals(self, rows: int, width: int) -> tuple[dict[int, float], int]:
        return (self.plain_residual, rows) if width <= 1 else (self.spec_residual, rows * width)

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

    contexts = [row.position for row in rows]

    def value(cap: int) -> float:
        ws = widths(cap)
        tokens = sum(r.policy.expected(c, w) for r, c, w in zip(rows, choices, ws))
        return tokens / costs.cost(len(ws), max(ws), contexts)

    caps = sorted({1, *wanted})
    return widths(max(caps, key=value))


def measure_pass_costs(
    target: Any,
    draft: Any,
    *,
    context: int = 64,
    width: int = 16,
    budget_s: float = 8.0,
    growth: CostModel | None = None,
    fixed: bool = False,
) -> PassCosts:
    """Time plain passes of 1, 2, 4, 8, 16 rows and speculative ones of 1, 2, 4, 8 rows x
    ``width`` (batched drafter pass + recorded verify) on ``context``-token rows; medians of
    up to 3 runs after a warm-up, fewer once ``budget_s`` is spent (``fixed``: always 3, as
    ``measure_costs``). ``growth``: the pair's cycle costs, whose per-token growth each row's
    context adds to a pass. Runs MLX work: call it on the thread that owns the models."""
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
        while len(runs) < 3 and (fixed or time.perf_counter() - start < budget_s):
            runs.append(once())
        return statistics.median(runs)

    plain = {r: timed(r, 1) for r in (1, 2, 4, 8, 16)}
    speculative = {4: timed(1, 4), **{r * width: timed(r, width) for r in (1, 2, 4, 8)}}
    growth = growth or CostModel(0.0, {}, {})  # each row's context adds the pair's growth
    return PassCosts(
        plain,
        _rising(speculative),
        time.perf_counter() - start,
        context=context,
        slope=dict(growth.slope),
        draft_slope=growth.draft_slope,
        draft_reach=growth.draft_reach,
    )


def _rising(points: dict[int, float]) -> dict[int, float]:
    out, top = {}, 0.0
    for x in sorted(points):
        top = max(top, points[x])
        out[x] = top
    return out
