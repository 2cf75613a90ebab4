"""What a cycle costs on this machine and model pair: measured once at load, refined per request.

``t(1)`` is one plain decoding step; ``t(B)`` for ``B >= 2`` is one drafter pass plus one verify of
``B`` positions (with the recording it needs). ``measure_costs`` times pipelined plain steps, a few
verify widths and the draft pass on a short context (a second or two); widths in between are
interpolated linearly, which is how verify cost grows in the memory-bound regime (see
docs/design.md, 'The cost model').

The curve is then calibrated by a short real decode at each measured width (the loop's own host
work, sync and bookkeeping, is what component timings miss), and each request refines its own
copy from the wall time of its real cycles: a residual per width plus a small shared correction,
in log space and clipped, so a slow consumer or a long context shifts the estimates and one
outlier cannot flip the choice.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mlx.nn as nn

    from dflash_server.models.drafter import DFlashDraftModel

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


def _widths(block: int) -> list[int]:
    return sorted({w for w in (1, 2, 4, 8, 16, 32) if w < block} | {block})


def measure_costs(
    model: nn.Module,
    draft: DFlashDraftModel,
    *,
    context: int = 64,
    plain_steps: int = 8,
    budget_s: float = 3.0,
    calibrate: bool = True,
) -> CostModel:
    """Time plain decoding (``plain_steps`` pipelined steps, as the decoder runs them), recorded
    verifies of a few widths and the drafter pass, each after a warm-up, on a ``context``-token
    prompt. Each is repeated 3 to 9 times (more when cheap; fewer once ``budget_s`` is spent)
    and the median kept; the curves are made non-decreasing in width (noise, not physics, makes
    a wider verify look cheaper). The other widths run once, untimed, so their compiled graphs
    exist before a request needs them. ``calibrate``: then decode a few real steps and cycles
    and start the corrections from what they took (``_calibrate``).

    Runs MLX work: call it on the thread that owns the models (the engine's worker).
    """
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    from dflash_server.generation.sampling import SamplingParams, TokenSampler
    from dflash_server.generation.target import TargetModel

    start = time.perf_counter()
    block = int(draft.config.block_size)
    target = TargetModel.of(model, tuple(draft.config.target_layer_ids))
    ids = mx.arange(1, context + block + 1)[None] % 97 + 1
    with mx.stream(generation_stream):
        cache = target.make_cache()
        _, taps = target.forward(ids[:, :context], cache, slice(-1, None))
        draft_cache = draft.make_cache()
        draft.append_context(taps, draft_cache)
        mx.eval([c.state for c in cache], [c.state for c in draft_cache])
    rollback = target.make_rollback(cache)

    def timed(run: Any) -> float:
        """Median of ``run()``'s own timings (it times only what a cycle would pay)."""
        run()  # warm-up: kernels, allocations, compiled graphs
        runs: list[float] = []
        while len(runs) < 3 or (len(runs) < 9 and sum(runs) < 0.1):
            runs.append(run())
            if time.perf_counter() - start > budget_s and len(runs) >= 1:
                break
        return statistics.median(runs)

    def plain() -> float:
        saved = [list(c.cache) if not c.is_trimmable() else None for c in cache]
        with mx.stream(generation_stream):
            t0 = time.perf_counter()
            token = ids[:, context : context + 1]
            for _ in range(plain_steps):  # the next step is queued before this one is read
                logits, _ = target.forward(token, cache, slice(None))
                token = mx.argmax(logits[:, -1:], axis=-1)
                mx.async_eval(token)
            mx.eval(token)
            seconds = (time.perf_counter() - t0) / plain_steps
        for c, slots in zip(cache, saved):  # back to the prompt
            if slots is None:
                c.trim(plain_steps)
            else:
                c.cache = slots
        return seconds

    def verify(width: int) -> Any:
        def run() -> float:
            with mx.stream(generation_stream):
                t0 = time.perf_counter()
                with rollback.recording():
                    tokens = ids[:, context : context + width]
                    logits, t = target.forward(tokens, cache, slice(None))
                mx.eval(mx.argmax(logits, axis=-1), t)
                seconds = time.perf_counter() - t0
                rollback.rollback(keep=0, fed=width)  # back to the prompt, untimed
                mx.eval([c.state for c in cache])
            return seconds

        return run

    def drafting(size: int) -> Any:
        block_ids = mx.array([[1] + [draft.config.mask_token_id] * (size - 1)])
        greedy = TokenSampler(SamplingParams())

        def run() -> float:  # the drafter contract, so any family's selector is timed too
            with mx.stream(generation_stream):
                t0 = time.perf_counter()
                mx.eval(draft.propose(block_ids, None, draft_cache, greedy, None)[0])
                return time.perf_counter() - t0

        return run

    costs = CostModel(
        plain=timed(plain),
        verify=_rising({w: timed(verify(w)) for w in _widths(block) if w > 1}),
        draft=_rising({s: timed(drafting(s)) for s in sorted({2, block})}),
    )
    costs.verify[1] = min(costs.plain, min(costs.verify.values()))  # for display and slopes
    for width in range(2, block):  # compile every width's graphs now, not in a request
        if width not in costs.verify:
            verify(width)()
            drafting(width)()
    if calibrate:
        _calibrate(costs, target, draft, ids[0, :context].tolist(), _widths(block))
    costs.measured_s = time.perf_counter() - start
    return costs


def _calibrate(
    costs: CostModel, target: Any, draft: Any, prompt: list[int], widths: list[int], rounds: int = 2
) -> None:
    """Start each width's residual from a short real decode at that width (plain steps and
    cycles, interleaved over ``rounds``, medians): the loop's own host work per cycle (sync,
    commit, bookkeeping) is what component timings miss, and it weighs differently by width."""
    from dflash_server.generation.sampling import SamplingParams, TokenSampler
    from dflash_server.generation.speculative import SpeculativeDecoder

    def periods(width: int, cycles: int) -> list[float]:
        decoder = SpeculativeDecoder(
            target, draft if width > 1 else None, TokenSampler(SamplingParams()), width
        )
        stamps = []
        for _ in decoder.generate(prompt, (cycles + 2) * width):
            stamps.append(time.perf_counter())
            if len(stamps) == cycles + 2:
                break
        return [b - a for a, b in itertools.pairwise(stamps[1:])]  # after the prefill: cycles

    gaps: dict[int, list[float]] = {w: [] for w in widths}
    for _ in range(rounds):
        for width in widths:
            gaps[width] += periods(width, 6 if width == 1 else 3)
    loop = {w: statistics.median(seconds) for w, seconds in gaps.items() if seconds}
    spec = _rising({w: t for w, t in loop.items() if w > 1})  # a wider cycle never costs less
    for width, seconds in {**loop, **spec}.items():
        costs.residual[width] = math.log(seconds / costs.base(width))


def _rising(points: dict[int, float]) -> dict[int, float]:
    out, top = {}, 0.0
    for width in sorted(points):
        top = max(top, points[width])
        out[width] = top
    return out


def costs_for(model: nn.Module, draft: DFlashDraftModel) -> CostModel:
    """The cost model of this pair, measured on first use and kept on the drafter (the engine
    measures at load, so requests never wait for it)."""
    cached = draft.__dict__.get("_dflash_costs")
    if cached is None or cached[0] is not model:
        cached = (model, measure_costs(model, draft))
        draft.__dict__["_dflash_costs"] = cached
    return cached[1]
