"""Measuring a pair's ``CostModel`` by running it: component timings, then a short real decode.

``measure_costs`` times pipelined plain steps, a few recorded verify widths and the drafter pass
on a short context (a second or two), then calibrates each width by decoding a few real cycles
at it (the loop's own host work, sync and bookkeeping, is what component timings miss). It sits
above ``speculative.py``, which it runs; the controller only reads the resulting ``CostModel``.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from dataclasses import replace
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import ArraysCache, KVCache

from dflash_server.adaptive.controller import BlockController
from dflash_server.adaptive.costs import CostModel, context_past, rising
from dflash_server.adaptive.policy import SUFFIX, Choice, FixedBlock
from dflash_server.drafters.protocol import Drafter, DraftRow
from dflash_server.drafters.suffix import Proposal, SuffixProposer
from dflash_server.generation.calibrate_passes import (
    HELD_STEPS,
    PREFILL_PIECE,
    prefill_in_pieces,
    timed_in_turn,
)
from dflash_server.generation.cycle import PREFILL_CHUNK
from dflash_server.generation.pauses import pause
from dflash_server.generation.row import Row
from dflash_server.generation.sampling import SamplingParams, TokenSampler
from dflash_server.generation.speculative import SpeculativeDecoder
from dflash_server.generation.target import TargetModel

_APPEND_PIECE = 256  # context positions the drafter takes in between two pauses


def _widths(block: int) -> list[int]:
    return sorted({w for w in (1, 2, 4, 8, 16, 32) if w < block} | {block})


def measure_costs(
    model: nn.Module,
    draft: Drafter | None,
    *,
    context: int = 64,
    long_context: int = 4096,
    plain_steps: int = 8,
    budget_s: float = 3.0,
    calibrate: bool = True,
    widest: int = 0,
    fixed: bool = False,
) -> CostModel:
    """Time plain decoding (``plain_steps`` pipelined steps, as the decoder runs them), recorded
    verifies of a few widths and the drafter pass, each after a warm-up, on a ``context``-token
    prompt. Each is repeated 3 to 9 times (more when cheap; fewer once ``budget_s`` is spent)
    and the median kept; the curves are made non-decreasing in width (noise, not physics, makes
    a wider verify look cheaper). The other widths run once, untimed, so their compiled graphs
    exist before a request needs them. The same pieces at a ``long_context``-token context (the
    prompt's caches copied to fill it: no long prefill) give each width's growth per context
    token (0: not measured). ``calibrate``: then decode a few real steps and cycles and start
    the corrections from what they took (``_calibrate``).

    ``widest``: verify widths up to this one are measured too (suffix copies verify without a
    drafter pass and may be wider than its block), and calibrated as verify-only cycles;
    ``draft=None`` measures plain steps and verify-only cycles alone. ``fixed``: repeat each
    timing exactly 3 times, whatever it takes (ranks of a sharded target measure together, and
    a count that followed each rank's own clock would desynchronise their collectives).

    Beside other models' streams (they ran at the first pause), each timed piece is held to
    about ``HELD_STEPS`` plain steps: fewer steps a run, and verify widths timed in turn up to
    the first that would last longer; wider ones extend the curve, and are refined by the
    requests' real cycles. The calibration cache measures such a ``partial`` result again at a
    load with no other model streaming (``engine/calibration.py``).

    Runs MLX work: call it on the thread that owns the models (the engine's worker).
    """
    start = time.perf_counter()
    block = int(draft.config.block_size) if draft is not None else 1
    widest = max(block, widest)
    taps_ids = tuple(draft.config.target_layer_ids) if draft is not None else ()
    target = TargetModel(model, taps_ids)
    widths = [w for w in _widths(widest) if w > 1]
    deadline = None if fixed else start + budget_s
    # Other models are streaming (they ran at this pause): each timed piece is held short.
    beside = pause() and not fixed
    steps = max(1, min(plain_steps, HELD_STEPS)) if beside else plain_steps
    short = _Pieces(target, draft, context, widest, steps, deadline)
    drafting = {} if draft is None else {s: short.timed(short.drafting(s)) for s in {2, block}}
    plain = short.timed(short.plain)
    ceiling = HELD_STEPS * plain if beside else math.inf
    verify = rising(timed_in_turn(widths, lambda w: short.timed(short.verify(w)), ceiling, {}))
    widths = sorted(verify)  # the widths timed; wider ones extend the curve (costs.interp)
    verify[1] = min(plain, min(verify.values(), default=plain))
    draft_costs = rising(drafting)
    for width in range(2, min(block, widths[-1] if widths else 1)):  # compile graphs now
        if width not in verify:
            pause()
            short.verify(width)()
            short.drafting(width)()
    slope: dict[int, float] = {}
    draft_slope, draft_reach = 0.0, None
    if long_context > context:
        deadline = None if fixed else time.perf_counter() + budget_s
        # Half the plain steps: each timing at that context holds other models' streams.
        long = _Pieces(target, draft, long_context, widest, max(1, steps // 2), deadline, context)
        span = long_context - context
        grown = {1: long.timed(long.plain)}
        grown |= timed_in_turn(widths, lambda w: long.timed(long.verify(w)), ceiling, {})
        shorter = {1: plain, **verify}
        slope = _linear_in_width({w: (t - shorter[w]) / span for w, t in grown.items()})
        if draft is not None:
            draft_reach = _reach(draft)
            reads = context_past(long_context, context, draft_reach)  # its window's part
            grown_draft = long.timed(long.drafting(block)) - draft_costs[block]
            draft_slope = max(0.0, grown_draft) / reads if reads else 0.0
    costs = CostModel(plain, verify, draft_costs, context=context, slope=slope,
                      draft_slope=draft_slope, draft_reach=draft_reach, partial=beside)  # fmt: skip
    if calibrate:
        prompt = cast("list[int]", short.ids[0, :context].tolist())
        # A calibration piece runs about two cycles (``_cycle_times``): widths up to 2, and
        # wider ones while two of their cycles stay under the ceiling.
        cycles = [w for w in _widths(block) if w <= 2 or 2 * costs.base(w) <= ceiling]
        copies = [w for w in widths if w == 2 or 2 * costs.base(w, False) <= ceiling]
        residual = _calibrate(costs, target, draft, prompt, cycles, 1 if beside else 6)
        copied = _calibrate_copies(costs, TargetModel(model, taps_ids), draft, prompt, copies)
        costs = replace(
            costs,
            residual=_level(residual, _widths(block)),
            verify_residual=_level(copied, _widths(widest)),
        )
    return replace(costs, measured_s=time.perf_counter() - start)


def _level(residuals: dict[int, float], widths: list[int]) -> dict[int, float]:
    """``residuals`` with the ``widths`` left uncalibrated at the widest calibrated one's (a
    line through two noisy log ratios, extended far, is wild; real cycles refine them)."""
    top = max((w for w in residuals if w > 1), default=None)
    if top is None:
        return residuals
    return {**{w: residuals[top] for w in widths if w > top}, **residuals}


def _reach(draft: Drafter) -> int | None:
    """The most context positions the drafter reads (sinks included; None: all of them)."""
    window = draft.context_window()
    return None if window is None else sum(window)


class _Pieces:
    """The pieces of a cycle, timed on a prefilled ``context``-token prompt (on this pair);
    ``deadline`` None: each timing repeated exactly 3 times (``measure_costs``'s ``fixed``)."""

    def __init__(
        self,
        target: TargetModel,
        draft: Drafter | None,
        context: int,
        widest: int,
        plain_steps: int,
        deadline: float | None,
        prefill: int | None = None,
    ) -> None:
        """``prefill``: run only that many tokens and fill the rest of the ``context`` with
        copies of them (``_fill``; a pass reading copies costs what one reading a real
        prompt does), so a long context is timed without a long prefill."""
        self.target, self.draft, self.context = target, draft, context
        self.plain_steps, self.deadline = plain_steps, deadline
        real = context if prefill is None else min(prefill, context)
        self.ids = _tiled(mx.arange(1, real + 1)[None] % 97 + 1, context + widest)
        self.cache = target.make_cache()
        taps = prefill_in_pieces(target, self.ids[:, :real], self.cache)
        with mx.stream(generation_stream):
            if real < context and _fill(self.cache, context):
                taps = None if taps is None else _tiled(taps, context)
            elif real < context:  # a cache it cannot fill: prefill the rest
                _, more = target.forward(self.ids[:, real:context], self.cache, slice(-1, None))
                taps = None if taps is None or more is None else mx.concatenate([taps, more], 1)
            mx.eval([c.state for c in self.cache])
        self.draft_cache = draft.make_cache() if draft is not None else []
        for begin in range(0, context if draft is not None else 0, _APPEND_PIECE):
            assert draft is not None and taps is not None, "a target tapped for the drafter"
            pause()
            with mx.stream(generation_stream):
                end = min(begin + _APPEND_PIECE, context)
                draft.append_context(taps[:, begin:end], self.draft_cache, self.ids[0, begin:end])
                mx.eval([c.state for c in self.draft_cache])
        self.rollback = target.make_rollback(self.cache)

    def timed(self, run: Any) -> float:
        """Median of ``run()``'s own timings (it times only what a cycle would pay)."""
        pause()  # other models' passes run between timings, never inside one
        run()  # warm-up: kernels, allocations, compiled graphs
        runs: list[float] = []
        fixed = self.deadline is None
        while len(runs) < 3 or (not fixed and len(runs) < 9 and sum(runs) < 0.1):
            pause()
            runs.append(run())
            if self.deadline is not None and time.perf_counter() > self.deadline:
                break
        return statistics.median(runs)

    def plain(self) -> float:
        cache, ids, context = self.cache, self.ids, self.context
        saved = [list(c.cache) if not c.is_trimmable() else None for c in cache]
        with mx.stream(generation_stream):
            t0 = time.perf_counter()
            token = ids[:, context : context + 1]
            for _ in range(self.plain_steps):  # the next step is queued before this one is read
                logits, _ = self.target.forward(token, cache, slice(None))
                token = mx.argmax(logits[:, -1:], axis=-1)
                mx.async_eval(token)
            mx.eval(token)
            seconds = (time.perf_counter() - t0) / self.plain_steps
        for c, slots in zip(cache, saved):  # back to the prompt
            if slots is None:
                c.trim(self.plain_steps)
            else:
                c.cache = slots
        return seconds

    def verify(self, width: int) -> Any:
        def run() -> float:
            with mx.stream(generation_stream):
                t0 = time.perf_counter()
                with self.rollback.recording():
                    tokens = self.ids[:, self.context : self.context + width]
                    logits, t = self.target.forward(tokens, self.cache, slice(None))
                mx.eval(mx.argmax(logits, axis=-1), t)
                seconds = time.perf_counter() - t0
                self.rollback.rollback(keep=0, fed=width)  # back to the prompt, untimed
                mx.eval([c.state for c in self.cache])
            return seconds

        return run

    def drafting(self, size: int) -> Any:
        draft = self.draft
        assert draft is not None
        block_ids = mx.array([[1] + [draft.config.mask_token_id] * (size - 1)])
        greedy = TokenSampler(SamplingParams())

        def run() -> float:  # the drafter contract, so any family's selector is timed too
            with mx.stream(generation_stream):
                t0 = time.perf_counter()
                mx.eval(draft.propose([DraftRow(block_ids, self.draft_cache, greedy)])[0][0])
                return time.perf_counter() - t0

        return run


def _linear_in_width(growth: dict[int, float]) -> dict[int, float]:
    """Each width's growth per context token as a line in the width (attention reads the
    context once per verified position), fitted over the measured widths by least squares: a
    few milliseconds of noise in one timing, divided by the context, must not make one width
    (and, kept non-decreasing, all wider ones) look ten times dearer at 32k tokens."""
    xs, ys = list(growth), list(growth.values())
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread if spread else 0.0
    slope = max(0.0, slope)
    return {x: max(0.0, mean_y + slope * (x - mean_x)) for x in sorted(xs)}


def _calibrate(
    costs: CostModel,
    target: TargetModel,
    draft: Drafter | None,
    prompt: list[int],
    widths: list[int],
    steps: int = 6,
    rounds: int = 3,
) -> dict[int, float]:
    """Each width's starting residual, from a short real decode at that width (plain steps and
    cycles, interleaved over ``rounds``, the lower quartile of each): the loop's own host work
    per cycle (sync, commit, bookkeeping) is what component timings miss, and it weighs
    differently by width."""

    def periods(width: int) -> list[float]:
        sampler = TokenSampler(SamplingParams())
        row = Row(
            target,
            draft if width > 1 else None,
            sampler,
            FixedBlock(width),
            prefill_step_size=PREFILL_PIECE,
        )
        return _cycle_times(SpeculativeDecoder(row), prompt, width, steps=steps)

    if draft is None:
        widths = [1]
    gaps: dict[int, list[float]] = {w: [] for w in widths}
    for _ in range(rounds):
        for width in widths:
            pause()
            gaps[width] += periods(width)
    # The lower quartile, not the median: a busy moment on a shared machine only adds time,
    # and one that spans half the calibration would otherwise steer every request's choices.
    loop = {w: _low(seconds) for w, seconds in gaps.items() if seconds}
    spec = rising({w: t for w, t in loop.items() if w > 1})  # a wider cycle never costs less
    return {w: math.log(seconds / costs.base(w)) for w, seconds in {**loop, **spec}.items()}


class _Copies(BlockController):
    """Calibration only: every cycle verifies ``width - 1`` copied tokens (never accepted)."""

    def __init__(self, width: int, costs: CostModel):
        super().__init__(1, replace(costs.copy(), refine=False))
        self.width = width

    def choose(self, room: int, proposal: Proposal | None = None, context: int = 0) -> Choice:
        if room <= self.width:
            return Choice.width(1)
        return Choice(SUFFIX, self.width, tuple(range(1, self.width)))

    def observe(self, *args: Any, **kwargs: Any) -> None:
        pass


def _calibrate_copies(
    costs: CostModel,
    target: TargetModel,
    draft: Drafter | None,
    prompt: list[int],
    widths: list[int],
    cycles: int = 3,
) -> dict[int, float]:
    """The verify-only residuals to start from, from short real decodes of copied-token cycles (no
    drafter pass: what suffix drafts cost in the loop, which component timings miss)."""
    loop: dict[int, float] = {}
    for width in widths:
        pause()
        times: list[float] = []
        for _ in range(cycles):  # one timed cycle a run (``_cycle_times``)
            proposer = SuffixProposer(prompt)
            sampler, policy = TokenSampler(SamplingParams()), _Copies(width, costs)
            row = Row(
                target, draft, sampler, policy, suffix=proposer, prefill_step_size=PREFILL_PIECE
            )
            times += _cycle_times(SpeculativeDecoder(row), prompt, width, extra=1)
        loop[width] = _low(times)  # as ``_calibrate``
    return {w: math.log(t / costs.base(w, drafted=False)) for w, t in rising(loop).items()}


def _cycle_times(
    decoder: SpeculativeDecoder, prompt: list[int], width: int, extra: int = 0, steps: int = 6
) -> list[float]:
    """Seconds of real cycles of ``width`` after the prompt's prefill, other models' passes
    between the prefill's chunks and after its token: the second speculative cycle (queued as
    the first is read), or ``steps`` plain steps after an untimed one (plain steps are queued
    ahead of the one read). A piece runs about two cycles: the timed one and the one queued
    after it, which runs at the next pause (docs/design.md, "Several models")."""
    timed = steps if width == 1 else 1
    cycles = decoder.generate(prompt, (timed + 3) * width + extra, yield_chunks=True)
    pause()
    for commit in cycles:  # the prefill's chunks, then its token
        if commit is not PREFILL_CHUNK:
            break
        pause()
    pause()  # the first cycle, queued as the token was handed out, runs before the others
    next(cycles)
    stamps = [time.perf_counter()] + [time.perf_counter() for _ in zip(range(timed), cycles)]
    cycles.close()
    return [b - a for a, b in itertools.pairwise(stamps)]


def _tiled(x: mx.array, length: int, axis: int = 1) -> mx.array:
    """``x`` repeated along ``axis`` and cut at ``length``."""
    reps = [1] * x.ndim
    reps[axis] = -(-length // x.shape[axis])
    return mx.tile(x, reps)[(slice(None),) * axis + (slice(0, length),)]


def _fill(cache: list[Any], context: int) -> bool:
    """Lengthen the attention caches to ``context`` positions with copies of what they hold
    (recurrent states do not grow); False, changing nothing, where a cache is of another kind."""
    if not all(type(c) is KVCache or isinstance(c, ArraysCache) for c in cache):
        return False
    for c in cache:
        if type(c) is KVCache:
            keys, values = c.keys_and_values()
            c.keys, c.values = _tiled(keys, context, 2), _tiled(values, context, 2)
            c.offset = context
    return True


def _low(seconds: list[float]) -> float:
    """The lower quartile of some timings (the median of their faster half)."""
    ordered = sorted(seconds)
    return statistics.median(ordered[: max(1, (len(ordered) + 1) // 2)])
