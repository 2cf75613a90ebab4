"""The verify budget of a batched pass: what a pass costs by its rows, and the widths it affords.

A row's controller picks the width best for it alone (``controller.py``); in a batch every row
pays for the widest row (all are padded to it) and a pass of many rows turns compute-bound, so
``choose_widths`` caps the adaptive rows' widths at the cap that gives the batch the most
expected committed tokens per second (at high concurrency that may be 1: plain batched
decoding). ``PassCosts`` is measured at load (``generation/calibrate_passes.py``): plain
passes of 1..16 rows, speculative passes (one batched drafter pass plus a recorded verify) of
1..8 rows x 16, so the engine can also say how many rows are worth running at once (``rows_supported``). Each
row's context adds attention work (the pair's per-token growth, ``CostModel.slope``), and every
pass the engine runs refines the curves (``observe``: a log residual per point, as the cycle
costs do), so a calibration taken at a busy moment is corrected by real traffic.

The budget's predictions can still be wrong (where a pass's host work per row is as large as
its compute; where the rows' acceptance estimates are optimistic), so each pass with drafter rows
is also judged by what it delivered: ``bias``, the decayed log ratio of its realized speedup over
plain to the speedup the budget predicted for it, kept per row count (a pass of 8 rows errs
otherwise than one of 4; a lone row is never budgeted). The drafter's rows must add the margin
with the bias included (suffix copies, which need no drafter pass, are not judged by the drafter's
record); a new mix of rows whose drafts promise far more still drafts at once
(docs/design.md, "Batching under speculation").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from dflash_server.adaptive.costs import context_past, interp
from dflash_server.adaptive.policy import DRAFTER, Choice, WidthPolicy

_PASS_ALPHA = 0.5  # weight of one observed pass (half shared by its kind, half its point's)
_PASS_CLIP = math.log(3.0)  # one pass moves a residual by at most this (log) factor
_EARLY, _EARLY_CLIP = 3, math.log(50.0)  # the first real speculative passes lower the load-time
# calibration to the fastest of them (into the drift all speculative points share: a busy moment
# only adds time); a slower one refines it as later passes do
_BIAS_ALPHA = 0.3  # weight of one drafted pass in the budget's bias
_MARGIN = math.log(1.03)  # drafting must beat plain by this much, bias included (a tie: plain)


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
    # rows -> log realized / predicted speedup of their drafted passes, decayed (``bias``)
    biases: dict[int, float] = field(default_factory=dict)
    paid: bool = False  # the last drafted pass beat plain by the margin
    partial: bool = False  # measured beside other models' streams: big passes extended

    def base(self, rows: int, width: int, contexts: Sequence[int] = ()) -> float:
        """The measured curve at this pass, plus attention over the rows' ``contexts`` past
        the measured one (and, drafted, the drafter's over the part it reads)."""
        points, x = (self.plain, rows) if width <= 1 else (self.speculative, rows * width)
        grow = 0.0
        if self.slope:
            extra = sum(context_past(c, self.context) for c in contexts)
            grow = interp(self.slope, width) * extra
        if width > 1 and self.draft_slope:
            reads = sum(context_past(c, self.context, self.draft_reach) for c in contexts)
            grow += self.draft_slope * reads
        return max(interp(points, x) + grow, 1e-6)

    def cost(self, rows: int, width: int, contexts: Sequence[int] = ()) -> float:
        """The estimate: the measured curve refined by the passes seen since."""
        return self.base(rows, width, contexts) * math.exp(self._correction(rows, width))

    def observe(
        self,
        rows: int,
        width: int,
        seconds: float,
        contexts: Sequence[int] = (),
        committed: int = 0,
        predicted: float | None = None,
    ) -> float:
        """Fold a real pass's wall time into the curve (log space, clipped: one slow pass
        cannot flip the budget): half into the drift every point of its kind shares (a busy
        measure inflated them all), half into its own point; the first speculative
        passes, when faster than estimated, go wholly into the drift (``_EARLY``). A drafted
        pass's ``committed`` tokens, against the log speedup ``predicted`` for it
        (``predicted_gain``; None: no drafter row), move its row count's ``bias``. Return log(seconds /
        estimate)."""
        if not seconds > 0:
            return 0.0
        if predicted is not None and committed > 0:  # tokens/s over a plain pass's rows/s, here
            realized = math.log(committed * self.cost(rows, 1, contexts) / (rows * seconds))
            # Clipped: one slow pass (a busy moment) must not send the rows to plain for good.
            last = self.bias(rows)  # (a row count's first record moves on from its neighbour's)
            step = max(-_PASS_CLIP, min(_PASS_CLIP, realized - predicted - (last or 0.0)))
            self.biases[rows] = step if last is None else last + _BIAS_ALPHA * step
            self.paid = realized >= _MARGIN
        residuals, x = self._residuals(rows, width)
        error = math.log(seconds / self.base(rows, width, contexts))
        error -= self._correction(rows, width)
        if width > 1:
            self.checked += 1
            if self.checked <= _EARLY and error < 0:  # the calibration's error
                self.spec_drift += max(-_EARLY_CLIP, error)
                return error
        step = _PASS_ALPHA / 2 * max(-_PASS_CLIP, min(_PASS_CLIP, error))
        residuals[x] = (interp(residuals, x) if residuals else 0.0) + step
        if width <= 1:
            self.plain_drift += step
        else:
            self.spec_drift += step
        return error

    @property
    def settled(self) -> bool:
        """Whether the first real speculative passes have checked the calibration."""
        return self.checked >= _EARLY

    def bias(self, rows: int) -> float | None:
        """What drafted passes of ``rows`` rows delivered against their predictions (the
        nearest row count's record where this one has none; None: no record)."""
        if rows in self.biases or not self.biases:
            return self.biases.get(rows)
        return self.biases[min(self.biases, key=lambda r: (abs(r - rows), r))]

    def _correction(self, rows: int, width: int) -> float:
        residuals, x = self._residuals(rows, width)
        drift = self.plain_drift if width <= 1 else self.spec_drift
        return drift + (interp(residuals, x) if residuals else 0.0)

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


class BudgetRow(Protocol):
    """What the budget reads of a row of the pass (``generation.row.Row``)."""

    @property
    def policy(self) -> WidthPolicy: ...

    @property
    def position(self) -> int:  # tokens its cycle attends to
        ...


def pass_value(
    rows: Sequence[BudgetRow], choices: Sequence[Choice], widths: Sequence[int], costs: PassCosts
) -> float:
    """Expected committed tokens per second of a pass running ``choices`` at ``widths``."""
    tokens = sum(r.policy.expected(c, w) for r, c, w in zip(rows, choices, widths))
    return tokens / costs.cost(len(rows), max(widths), [row.position for row in rows])


def predicted_gain(rows: Sequence[BudgetRow], choices: Sequence[Choice], costs: PassCosts) -> float:
    """Log of the speedup over plain decoding the curves predict for a pass of ``choices``."""
    sizes = [c.size for c in choices]
    return math.log(
        pass_value(rows, choices, sizes, costs) / pass_value(rows, choices, [1] * len(rows), costs)
    )


def choose_widths(
    rows: Sequence[BudgetRow], choices: Sequence[Choice], costs: PassCosts, judged: bool = True
) -> list[int]:
    """Cap the adaptive rows' chosen widths where the batch's tokens per second is highest
    (a fixed width is the request's own choice: kept); with ``judged``, the drafter's rows must
    add ``_MARGIN`` after the drafted passes' ``bias``, else they decode plainly (suffix
    copies, verified without a drafter pass, keep the cap)."""
    wanted = [c.size for c in choices]
    adaptive = [row.policy.adaptive for row in rows]
    if not any(adaptive) or max(wanted) <= 1:  # nothing to cap (most passes of a busy batch)
        return wanted

    def widths(cap: int) -> list[int]:
        return [min(w, cap) if a else w for w, a in zip(wanted, adaptive)]

    values = {cap: pass_value(rows, choices, widths(cap), costs) for cap in sorted({1, *wanted})}
    cap = max(values, key=values.__getitem__)
    best = widths(cap)
    bias = costs.bias(len(rows)) if judged else None
    if bias is not None:  # the drafter's rows, judged by what they delivered
        undrafted = [
            1 if a and c.source == DRAFTER else w for w, a, c in zip(best, adaptive, choices)
        ]
        if undrafted != best:
            gain = values[cap] / pass_value(rows, choices, undrafted, costs)
            if math.log(gain) + bias < _MARGIN:
                return undrafted
    return best
