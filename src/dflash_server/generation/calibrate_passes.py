"""Measuring a pair's ``PassCosts`` (``adaptive/pass_costs.py``): batched passes of the real
decoder's pieces (the rows' drafter pass, one recorded verify) timed at a few sizes at load."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream

from dflash_server.adaptive.costs import CostModel, interp, rising
from dflash_server.adaptive.pass_costs import PassCosts
from dflash_server.drafters.protocol import Drafter, DraftRow
from dflash_server.generation.pauses import pause
from dflash_server.generation.sampling import SamplingParams, TokenSampler
from dflash_server.generation.target import TargetModel

PREFILL_PIECE = 8  # prompt tokens a measurement prefills between two pauses
# Beside other models' streams, a load's timed piece lasts about this many of its own plain
# steps at most (docs/design.md, "Several models").
HELD_STEPS = 2


def timed_in_turn(
    sizes: list[int], time_one: Callable[[int], float], ceiling: float, times: dict[int, float]
) -> dict[int, float]:
    """``times`` and ``time_one(size)`` of ``sizes`` (ascending) in turn, up to the first
    whose cost, extended from the two before it, would pass ``ceiling`` seconds (two are always
    timed; the wider ones are left to the curve: ``costs.interp``)."""
    times = dict(times)
    for size in sizes:
        if len(times) >= 2 and interp(rising(times), size) > ceiling:
            break
        times[size] = time_one(size)
    return times


def prefill_in_pieces(
    target: TargetModel, ids: mx.array, cache: list[Any], piece: int = PREFILL_PIECE
) -> mx.array | None:
    """Prefill ``ids`` into ``cache`` ``piece`` tokens of each row at a time, other models'
    passes between the pieces (``pauses.py``); the taps of every position (None: an untapped
    target)."""
    taps: list[mx.array] = []
    for begin in range(0, ids.shape[1], piece):
        pause()
        with mx.stream(generation_stream):
            piece_ids = ids[:, begin : begin + piece]
            _, t = target.forward(piece_ids, cache, slice(-1, None))
            mx.eval([c.state for c in cache], *([] if t is None else [t]))
        if t is not None:
            taps.append(t)
    return mx.concatenate(taps, axis=1) if taps else None


def measure_pass_costs(
    target: TargetModel,
    draft: Drafter,
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
    ``measure_costs``). Beside other models' streams, sizes are timed in turn up to the first
    that would last over ``HELD_STEPS`` one-row plain passes; bigger ones extend the curve
    (``PassCosts`` interpolates) and the result is ``partial``. ``growth``: the pair's cycle
    costs, whose per-token growth each row's context adds to a pass. Runs MLX work: call it on
    the thread that owns the models."""
    start = time.perf_counter()
    greedy = TokenSampler(SamplingParams())
    mask_id = draft.config.mask_token_id
    beside = pause() and not fixed  # other models are streaming: each timed piece held short

    def timed(rows: int, w: int) -> float:
        ids = (mx.arange(rows * (context + w)).reshape(rows, -1) % 97) + 1
        cache = target.make_cache()
        piece = max(1, PREFILL_PIECE // rows) if beside else PREFILL_PIECE
        taps = prefill_in_pieces(target, ids[:, :context], cache, piece)
        assert taps is not None, "a target tapped for the drafter"
        drafts = []
        for r in range(rows):
            pause()
            with mx.stream(generation_stream):
                c = draft.make_cache()
                draft.append_context(taps[r : r + 1], c, ids[r, :context])
                mx.eval([s.state for s in c])
            block = mx.array([[1] + [mask_id] * (w - 1)])
            drafts.append(DraftRow(block, c, greedy))
        saved = [None if c.is_trimmable() else list(c.cache) for c in cache]

        def once() -> float:
            with mx.stream(generation_stream):
                t0 = time.perf_counter()
                tokens = ids[:, context : context + w]
                if w > 1:
                    proposals = draft.propose(drafts)
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

        pause()  # other models' passes run between timings (generation/pauses.py)
        once()  # warm-up
        pause()
        runs = [once()]
        while len(runs) < 3 and (fixed or time.perf_counter() - start < budget_s):
            pause()
            runs.append(once())
        return statistics.median(runs)

    one = timed(1, 1)
    ceiling = HELD_STEPS * one if beside else math.inf
    plain = timed_in_turn([2, 4, 8, 16], lambda rows: timed(rows, 1), ceiling, {1: one})
    shapes = {4: (1, 4), **{r * width: (r, width) for r in (1, 2, 4, 8)}}  # by positions
    speculative = timed_in_turn(sorted(shapes), lambda p: timed(*shapes[p]), ceiling, {})
    growth = growth or CostModel(0.0, {}, {})  # each row's context adds the pair's growth
    return PassCosts(
        plain,
        rising(speculative),
        time.perf_counter() - start,
        context=context,
        slope=dict(growth.slope),
        draft_slope=growth.draft_slope,
        draft_reach=growth.draft_reach,
        partial=beside,
    )
