"""What a cycle costs on this machine and model pair: measured once at load, refined per request.

``t(1)`` is one plain decoding step; ``t(B)`` for ``B >= 2`` is one drafter pass plus one verify of
``B`` positions (with the recording it needs). ``generation/calibrate.py`` measures the curve at a
few widths; widths in between are interpolated linearly, which is how verify cost grows in the
memory-bound regime (docs/design.md, "Adaptive speculation").

Each request refines its own copy from the wall time of its real cycles: a residual per width
(calibrated at load) plus a small shared correction, in log space and clipped, so a slow consumer
or a long context shifts the estimates and one outlier cannot flip the choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

_ALPHA = 0.25  # weight of one observed cycle in the running correction
_CLIP = math.log(3.0)  # one observation moves the correction by at most this (log) factor


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
    log_scale: float = 0.0

    @staticmethod
    def _interp(points: dict[int, float], x: int) -> float:
        xs = sorted(points)
        if x <= xs[0]:
            lo, hi = xs[0], xs[min(1, len(xs) - 1)]
        elif x >= xs[-1]:
            lo, hi = xs[max(0, len(xs) - 2)], xs[-1]
        else:
            hi = next(v for v in xs if v >= x)
            lo = max(v for v in xs if v <= x)
        if hi == lo:
            return points[lo]
        slope = (points[hi] - points[lo]) / (hi - lo)
        return points[lo] + slope * (x - lo)

    def base(self, size: int) -> float:
        """The component estimate of one cycle of ``size`` positions (draft + verify)."""
        if size <= 1:
            return self.plain
        return max(self._interp(self.draft, size) + self._interp(self.verify, size), 1e-6)

    def _residual(self, size: int) -> float:
        size = max(1, size)
        same_kind = {w: r for w, r in self.residual.items() if (w > 1) == (size > 1)}
        if size in same_kind or not same_kind:
            return same_kind.get(size, 0.0)
        return self._interp(same_kind, size)

    def cycle(self, size: int) -> float:
        """The current estimate: the component estimate times calibration and refinement."""
        return self.base(size) * math.exp(self.log_scale + self._residual(size))

    def observe(self, size: int, seconds: float) -> None:
        """Fold one real cycle's wall time into its width's residual (and a little into the
        shared drift, so widths not used lately follow a slower machine or a longer context)."""
        if not self.refine or not seconds > 0:
            return
        size = max(1, size)
        residual = self._residual(size)
        error = math.log(seconds / self.base(size)) - self.log_scale - residual
        error = max(-_CLIP, min(_CLIP, error))
        self.residual[size] = residual + _ALPHA * error
        self.log_scale += _ALPHA / 4 * error

    def copy(self) -> CostModel:
        return replace(self, verify=dict(self.verify), draft=dict(self.draft),
                       residual=dict(self.residual))  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        """Milliseconds, for logs and stats."""
        return {
            "plain_ms": round(1e3 * self.cycle(1), 3),
            "draft_ms": {b: round(1e3 * t, 3) for b, t in sorted(self.draft.items())},
            "verify_ms": {b: round(1e3 * t, 3) for b, t in sorted(self.verify.items())},
            "cycle_ms": {b: round(1e3 * self.cycle(b), 3) for b in sorted(self.verify)},
        }

    def describe(self) -> str:
        """One startup log line."""
        verify = ", ".join(f"{b}: {1e3 * t:.1f}" for b, t in sorted(self.verify.items()))
        draft = ", ".join(f"{b}: {1e3 * t:.1f}" for b, t in sorted(self.draft.items()))
        loop = ", ".join(f"{b}: {1e3 * self.cycle(b):.1f}" for b in sorted(self.verify))
        return (
            f"cycle cost (ms): plain step {1e3 * self.plain:.1f}; verify by width {{{verify}}}; "
            f"draft {{{draft}}}; in the loop by width {{{loop}}} "
            f"(measured in {self.measured_s:.1f} s)"
        )
