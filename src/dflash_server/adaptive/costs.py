"""What a cycle costs on this machine and model pair: measured at load, refined as requests run.

``t(1)`` is one plain decoding step; ``t(B)`` for ``B >= 2`` is one drafter pass plus one verify of
``B`` positions (with the recording it needs); a verify-only cycle (suffix drafts: no drafter
pass) costs the verify alone, and may be wider than the drafter's block. ``generation/calibrate.py``
measures the curve at a few widths on a short context; widths in between are interpolated
linearly (and wider ones extrapolated from the widest two), which is how verify cost grows in the
memory-bound regime (docs/design.md, "Adaptive speculation"). A second, longer context gives each
width's growth per context token (attention reads every cached position), so at 32k tokens the
curve is not the one measured at 64.

Each request refines its own copy from the wall time of its real cycles: a residual per width
(calibrated at load) plus a small shared correction, in log space and clipped, so a slow consumer
shifts the estimates and one outlier cannot flip the choice. A width's first real cycle, where
cheaper than measured at load, places it in the curve; after that most of its correction moves
the other widths of its kind too (the machine's pace is shared), so a slow moment at the width in
use cannot make a width not run lately look cheaper for good (at 32k tokens it made a 5-wide
cycle look cheaper than a 4-wide one). Every observation also nudges the pair's model
(``shared``), which the next request copies: a calibration taken at a busy moment does not
decide for the server's whole life.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, replace
from typing import Any

_ALPHA = 0.25  # weight of one observed cycle in the running correction
_SHARED = 0.2  # the pair's model moves this much of a request's step (many requests refine it)
_CLIP = math.log(3.0)  # one observation moves the correction by at most this (log) factor
_KIND = 0.75  # share of a width's step that the other widths of its kind take (the pace)
# The first real drafted cycles lower the load-time calibration to the fastest of them (clipped
# wide: a busy moment may have inflated it many times); a slower one only refines it, as later
# cycles do (one slow first cycle once sent every row of a batch to plain decoding for good).
_EARLY, _EARLY_CLIP = 3, math.log(50.0)


def interp(points: dict[int, float], x: int) -> float:
    """The curve through ``points`` at ``x``: linear between the measured points, extended
    from the nearest two outside them."""
    if x in points:  # a measured point (most calls: it runs several times per pass)
        return points[x]
    return _between(sorted(points), points, x)


def sweep(points: dict[int, float], limit: int) -> list[float]:
    """``interp(points, x)`` at x = 1..``limit`` (index ``x - 1``; 0 where there are no
    points), sorting the keys once."""
    if not points:
        return [0.0] * limit
    xs = sorted(points)
    return [points[x] if x in points else _between(xs, points, x) for x in range(1, limit + 1)]


def _between(xs: list[int], points: dict[int, float], x: int) -> float:
    """``interp`` at an ``x`` not in ``points``, whose keys ``xs`` are sorted already."""
    if len(xs) == 1:
        return points[xs[0]]
    i = bisect.bisect_left(xs, x)  # the segment [xs[i-1], xs[i]], the end ones outside
    lo, hi = (xs[0], xs[1]) if i == 0 else (xs[-2], xs[-1]) if i == len(xs) else (xs[i - 1], xs[i])
    return points[lo] + (points[hi] - points[lo]) / (hi - lo) * (x - lo)


def rising(points: dict[int, float]) -> dict[int, float]:
    """The points made non-decreasing in x (noise, not physics, makes a wider pass look
    cheaper)."""
    out, top = {}, 0.0
    for x in sorted(points):
        top = max(top, points[x])
        out[x] = top
    return out


def context_past(context: int, measured: int, reach: int | None = None) -> int:
    """Tokens of ``context`` past the ``measured`` one that a pass reads: a windowed drafter
    reads at most ``reach`` (None: all), so its cost stops growing there."""
    return max(0, (context if reach is None else min(context, reach)) - measured)


@dataclass
class CostModel:
    """Seconds per cycle by block size; ``verify`` and ``draft`` are keyed by measured widths."""

    plain: float  # one plain decoding step
    verify: dict[int, float]  # width -> seconds of a recorded verify of that many positions
    draft: dict[int, float]  # block size -> drafter pass seconds
    measured_s: float = 0.0  # how long measuring took
    refine: bool = True  # fold real cycle timings in (off: keep the measured curve as is)
    # log(observed / component estimate): one residual per width (1 = plain; calibrated at
    # load, then refined from real cycles; unseen widths interpolate), plus a shared drift.
    residual: dict[int, float] = field(default_factory=dict)
    verify_residual: dict[int, float] = field(default_factory=dict)  # verify-only cycles
    log_scale: float = 0.0
    context: int = 64  # the context (tokens) the curves above were measured at
    slope: dict[int, float] = field(default_factory=dict)  # width -> s per token past ``context``
    draft_slope: float = 0.0  # the drafter pass's growth per context token
    draft_reach: int | None = None  # context the drafter attends to at most (None: all of it)
    shared: CostModel | None = field(default=None, repr=False)  # the pair's, refined too
    checked: int = 0  # real drafted cycles observed (0: the curve is the calibration alone)
    timed: dict[int, int] = field(default_factory=dict)  # drafted width -> real cycles timed
    partial: bool = False  # measured beside other models' streams: wide widths extended
    _sweeps: tuple[Any, Any] = field(default=(None, None), init=False, repr=False, compare=False)

    def base(self, size: int, drafted: bool = True, context: int = 0) -> float:
        """The component estimate of one cycle of ``size`` positions (draft + verify; without
        ``drafted``, a verify-only cycle) at ``context`` tokens (0: as measured)."""
        grow = 0.0
        if self.slope and context > self.context:  # attention over the longer context
            grow = interp(self.slope, max(1, size)) * (context - self.context)
        if size <= 1:
            return self.plain + grow
        draft = 0.0
        if drafted:
            draft = interp(self.draft, size)
            draft += self.draft_slope * context_past(context, self.context, self.draft_reach)
        return max(draft + interp(self.verify, size) + grow, 1e-6)

    def curve(self, limit: int, context: int = 0, drafted: bool = True) -> list[float]:
        """``cycle(size, drafted, context)`` of every width 1..``limit`` (index ``size - 1``)
        in one sweep: the controller weighs them all, on every row, every few steps."""
        past = context - self.context if self.slope and context > self.context else 0
        slopes, drafts, verifies = self._measured(limit)
        plain = self.residual.get(1, 0.0)
        if drafted:
            kind = sweep({w: r for w, r in self.residual.items() if w > 1}, limit)
        else:  # verify-only cycles: their own residuals, or a plain step's (``_residual``)
            kind = sweep(self.verify_residual, limit) if self.verify_residual else [plain] * limit
        bases = [self.plain + slopes[0] * past]
        drafter = self.draft_slope * context_past(context, self.context, self.draft_reach)
        for slope, draft, verify in zip(slopes[1:], drafts[1:], verifies[1:]):
            drafting = draft + drafter if drafted else 0.0
            bases.append(max(drafting + verify + slope * past, 1e-6))
        residuals = [plain, *kind[1:]]
        return [base * math.exp(self.log_scale + r) for base, r in zip(bases, residuals)]

    def _measured(self, limit: int) -> tuple[list[float], ...]:
        """The measured curves (slope, draft, verify) swept to ``limit``. They never change once
        measured, so the sweep is kept (keyed by the dicts themselves: one swapped in re-sweeps)."""
        curves = (self.slope, self.draft, self.verify)
        key, swept = self._sweeps
        if key is None or key[0] != limit or any(a is not b for a, b in zip(key[1:], curves)):
            swept = tuple(sweep(points, limit) for points in curves)
            self._sweeps = ((limit, *curves), swept)
        return swept

    def _residual(self, size: int, drafted: bool = True) -> float:
        size = max(1, size)
        if not drafted and size > 1:
            # Verify-only cycles have their own residuals; until some exist, a plain step's
            # (the same loop work: no drafter pass).
            if not self.verify_residual:
                return self.residual.get(1, 0.0)
            if size in self.verify_residual:
                return self.verify_residual[size]
            return interp(self.verify_residual, size)
        if size in self.residual:
            return self.residual[size]
        same_kind = {w: r for w, r in self.residual.items() if (w > 1) == (size > 1)}
        return interp(same_kind, size) if same_kind else 0.0

    def cycle(self, size: int, drafted: bool = True, context: int = 0) -> float:
        """The current estimate: the component estimate times calibration and refinement."""
        residual = self._residual(size, drafted)
        return self.base(size, drafted, context) * math.exp(self.log_scale + residual)

    def observe(
        self, size: int, seconds: float, drafted: bool = True, context: int = 0, weight: float = 1.0
    ) -> None:
        """Fold one real cycle's wall time into its width's residual (most of the step into its
        kind's other widths, a little into the drift of all kinds); the pair's model
        (``shared``) takes a fraction of the step. A drafted width's first real cycle, when
        faster than estimated, sets its residual whole (the calibration met a busy moment at
        its turn; a slower one may itself be the busy moment, so it only refines). The first
        ``_EARLY`` drafted cycles, when faster than estimated, move every drafted width by their
        error instead (the calibration's bias: a busy moment only adds time)."""
        if not self.refine or not seconds > 0:
            return
        size = max(1, size)
        residual = self._residual(size, drafted)
        error = math.log(seconds / self.base(size, drafted, context)) - self.log_scale - residual
        residuals = self.residual if drafted or size == 1 else self.verify_residual
        first = size > 1 and drafted and size not in self.timed
        if size > 1 and drafted:
            self.checked += 1
            self.timed[size] = self.timed.get(size, 0) + 1
            if self.checked <= _EARLY and error < 0:  # the calibration's error: every width's
                error = max(-_EARLY_CLIP, error)
                widths = {size, *(w for w in residuals if w > 1)}
                residuals.update({w: self._residual(w) + error for w in widths})
                error = 0.0  # nothing left for the drift below
        error = max(-_CLIP, min(_CLIP, error))
        own = self._residual(size, drafted)
        if first and error < 0:
            # A width's first real cycle, cheaper than estimated: the calibration met a busy
            # moment at its turn, so this sets its residual whole (the pair's too).
            residuals[size] = own + error
        else:  # later ones mostly measure the machine's pace, shared by the widths of its kind
            step = weight * _ALPHA * error
            for width in [w for w in residuals if w != size and (w > 1) == (size > 1)]:
                residuals[width] += _KIND * step
            residuals[size] = own + step
            self.log_scale += step / 4
        if self.shared is not None:
            self.shared.observe(size, seconds, drafted, context, weight * _SHARED)

    def copy(self) -> CostModel:
        """A request's own copy; its observations refine the pair's model too."""
        return replace(self, verify=dict(self.verify), draft=dict(self.draft),
                       residual=dict(self.residual), slope=dict(self.slope),
                       verify_residual=dict(self.verify_residual), timed=dict(self.timed),
                       shared=self.shared or self)  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        """Milliseconds, for logs and stats."""
        return {
            "plain_ms": round(1e3 * self.cycle(1), 3),
            "draft_ms": {b: round(1e3 * t, 3) for b, t in sorted(self.draft.items())},
            "verify_ms": {b: round(1e3 * t, 3) for b, t in sorted(self.verify.items())},
            "cycle_ms": {
                b: round(1e3 * self.cycle(b, bool(self.draft)), 3) for b in sorted(self.verify)
            },
            "us_per_context_token": {b: round(1e6 * s, 4) for b, s in sorted(self.slope.items())},
        }

    def describe(self) -> str:
        """One startup log line."""
        verify = ", ".join(f"{b}: {1e3 * t:.1f}" for b, t in sorted(self.verify.items()))
        draft = ", ".join(f"{b}: {1e3 * t:.1f}" for b, t in sorted(self.draft.items()))
        loop = ", ".join(
            f"{b}: {1e3 * self.cycle(b, bool(self.draft)):.1f}" for b in sorted(self.verify)
        )
        growth = ", ".join(f"{b}: {1e6 * s:.2f}" for b, s in sorted(self.slope.items()))
        reach = "all of it" if self.draft_reach is None else f"{self.draft_reach} tokens"
        return (
            f"cycle cost (ms): plain step {1e3 * self.plain:.1f}; verify by width {{{verify}}}; "
            f"draft {{{draft}}}; in the loop by width {{{loop}}}; growth per context token "
            f"(us) {{{growth}}}, drafter {1e6 * self.draft_slope:.2f} over {reach} "
            f"(measured in {self.measured_s:.1f} s)"
        )
