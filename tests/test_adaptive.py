"""block_size "auto": the controller's choices, and losslessness for any sequence of widths."""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from dflash_server import stream_generate
from dflash_server.adaptive.controller import AcceptanceModel, BlockController
from dflash_server.adaptive.costs import CostModel
from dflash_server.adaptive.policy import Choice, FixedBlock
from dflash_server.generation.pair import ModelPair
from dflash_server.generation.row import Row
from dflash_server.generation.sampling import SamplingParams, TokenSampler
from dflash_server.generation.speculative import SpeculativeDecoder
from dflash_server.generation.target import TargetModel
from dflash_server.testing import ReplayDrafter, random_drafter

N = 60


def costs(
    plain: float = 1.0, verify16: float = 1.8, draft: float = 0.5, refine: bool = False
) -> CostModel:
    """A synthetic cost curve: verify grows linearly from a plain step to ``verify16``; by
    default not refined from timings (tests run on any machine)."""
    verify = {w: plain + (verify16 - plain) * (w - 1) / 15 for w in (1, 2, 4, 8, 16)}
    return CostModel(plain=plain, verify=verify, draft={2: draft, 16: draft}, refine=refine)


class Scripted(FixedBlock):
    """A policy that plays a fixed sequence of widths (cycled), whatever happens."""

    adaptive = True

    def __init__(self, sizes: list[int], block_size: int = 16):
        super().__init__(block_size)
        self.sizes, self.i = sizes, 0

    def choose(self, room: int, proposal: Any = None, context: int = 0) -> Choice:
        size = self.sizes[self.i % len(self.sizes)]
        self.i += 1
        return Choice.width(max(1, min(size, room)))


def plain(model, ids, n=N) -> list[int]:
    return [t for t, _ in generate_step(mx.array(ids), model, max_tokens=n)]


def decode(model, draft, ids, policy, n=N, params=None, seed=0):
    target = TargetModel(model, draft.config.target_layer_ids)
    sampler = TokenSampler(params or SamplingParams(), seed)
    decoder = SpeculativeDecoder(Row(target, draft, sampler, policy))
    tokens = [t for commit in decoder.generate(ids, n) for t in commit.tokens]
    return tokens, decoder.stats


# -- the controller alone ---------------------------------------------------------------------


def test_expected_tokens_per_cycle():
    assert AcceptanceModel.expected([1.0] * 15, 16) == 16
    assert AcceptanceModel.expected([0.0] * 15, 16) == 1
    assert AcceptanceModel.expected([0.5] * 15, 3) == pytest.approx(1.75)


def test_controller_widens_on_acceptance_and_falls_back_on_rejection():
    c = BlockController(16, costs())
    for _ in range(10):
        size = c.next_size(100)
        c.observe(size, size - 1, None)  # everything accepted
    assert c.next_size(100) == 16
    for _ in range(10):
        size = c.next_size(100)
        c.observe(size, 0, None)  # nothing accepted
        if size == 1:
            break
    assert c.next_size(100) == 1
    estimate = c.estimate()
    assert estimate["block_size"] == 1 and estimate["expected_tau"] < 1.2


def test_controller_probes_and_recovers():
    c = BlockController(16, costs(), probe_gap=8, max_probe_gap=32)
    sizes = []
    for _ in range(10):  # a drafter that never agrees
        size = c.next_size(1000)
        sizes.append(size)
        c.observe(size, 0, None)
    for _ in range(200):
        size = c.next_size(1000)
        sizes.append(size)
        c.observe(size, 0, None)
    probes = [i for i, s in enumerate(sizes[10:]) if s > 1]
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert probes and gaps == sorted(gaps) and max(gaps) <= 33  # backing off, bounded
    assert sizes[-1] == 1
    # The text turns predictable: the next probe accepts everything and speculation resumes.
    for _ in range(64):
        size = c.next_size(1000)
        c.observe(size, size - 1, None)
        if size > 1 and c.next_size(1000) > 1:
            break
    else:
        pytest.fail("the controller never resumed speculation")


def test_costs_pick_plain_when_verifying_is_expensive():
    # Verify 16 at 20 plain steps: even perfect acceptance (tau 16) never pays.
    c = BlockController(16, costs(verify16=20.0, draft=2.0))
    for _ in range(20):
        size = c.next_size(100)
        c.observe(size, size - 1, None)
    assert c.next_size(100) == 1


def test_width_settles_at_the_acceptance_length():
    # Three drafts always survive, the fourth never: wider blocks only cost more.
    c = BlockController(16, costs(verify16=4.0))
    for _ in range(30):
        size = c.next_size(100)
        c.observe(size, min(size - 1, 3), None)
    assert 4 <= c.next_size(100) <= 6


def test_a_small_gain_at_a_hard_wall_is_kept():
    # One draft always survives, the second never; on this curve (the ~100M benchmark target's,
    # in plain steps) width 2 pays 11 % over plain decoding and every wider block less.
    curve = CostModel(
        plain=1.0, verify={1: 1.0, 2: 1.3, 4: 1.75, 8: 2.4, 16: 3.9}, draft={2: 0.5, 16: 0.5}
    )
    c, sizes = BlockController(16, curve), []
    for _ in range(60):
        size = c.next_size(1000)
        sizes.append(size)
        c.observe(size, min(size - 1, 1), None)
    assert sizes[-30:].count(2) >= 28, sizes


def test_cost_residuals_are_per_width():
    model = costs(refine=True)
    model.residual = {1: 0.0, 2: 0.0, 16: 0.0}
    two, sixteen = model.cycle(2), model.cycle(16)
    for _ in range(3):  # the first real cycles correct the calibration: every drafted width
        model.observe(2, 0.5 * two)
    assert model.cycle(2) == pytest.approx(0.5 * two, rel=1e-6)
    assert model.cycle(16) == pytest.approx(0.5 * sixteen, rel=1e-6)
    assert model.cycle(1) == pytest.approx(1.0)  # a plain step is another kind
    two, sixteen, plain = model.cycle(2), model.cycle(16), model.cycle(1)
    for _ in range(40):  # later ones refine their own width ...
        model.observe(2, 0.5 * two)
    assert model.cycle(2) == pytest.approx(0.5 * two, rel=0.05)
    # ... and most of their correction is the machine's pace, shared by the other drafted
    # widths; the curve's shape moves slowly (a plain step only by the drift of all kinds)
    assert 0.5 * sixteen < model.cycle(16) < 0.65 * sixteen
    assert 0.8 * plain < model.cycle(1) < plain
    assert model.cycle(4) < model.cycle(8) < model.cycle(16)  # in between: interpolated


def test_a_slow_cycle_does_not_send_the_width_past_the_acceptance_length():
    # Three drafts always survive, the fourth never: a fifth position costs ~14 % more for
    # nothing. One cycle at the width in use taking twice its time (a busy moment on a shared
    # machine) must not make the wider cycle, not run lately, look the cheaper one for good.
    curve = CostModel(
        plain=1.0, verify={1: 1.0, 2: 2.0, 4: 2.6, 8: 4.2, 16: 7.4}, draft={2: 0.3, 16: 0.3}
    )
    truth = curve.copy()
    c, sizes = BlockController(16, curve.copy()), []
    for i in range(60):
        size = c.next_size(1000)
        sizes.append(size)
        slow = 2.0 if i == 30 else 1.0
        c.observe(size, min(size - 1, 3), slow * truth.cycle(size))
    assert sizes[20:30] == [4] * 10, sizes
    assert sizes[31:].count(4) >= 27, sizes


def test_a_width_a_busy_load_overpriced_is_found_by_a_real_cycle():
    # The calibration met a busy moment at width 4's turn (37 % dear; its wider neighbours
    # as measured): three drafts survive, the fourth never. Before, auto probed 8 wide and went
    # back to plain decoding; a narrower width no real cycle has timed now gets tried, and its
    # first cycle places it in the curve.
    truth = CostModel(
        plain=1.0, verify={1: 1.0, 2: 2.0, 4: 2.6, 8: 4.2, 16: 7.4}, draft={2: 0.3, 16: 0.3}
    )
    busy = truth.copy()
    busy.shared, busy.residual = None, {4: math.log(1.37), 8: 0.0, 16: 0.0}
    c, sizes = BlockController(16, busy), []
    for _ in range(40):
        size = c.next_size(1000)
        sizes.append(size)
        c.observe(size, min(size - 1, 3), truth.cycle(size))
    assert sizes[20:].count(4) >= 17, sizes


def test_cost_model_refines_from_observations():
    model = costs(refine=True)
    before = model.cycle(16)
    for _ in range(3):  # the first real cycles confirm the calibration
        model.observe(16, before)
    for _ in range(30):  # then the machine slows down
        model.observe(16, 2 * before)
    assert model.cycle(16) == pytest.approx(2 * before, rel=0.05)
    assert model.cycle(8) > model.base(8) * 1.8  # the correction applies to every width
    assert model.base(1) < model.cycle(1) < model.cycle(16) / model.base(16)  # plain: partly
    for _ in range(60):
        model.observe(1, model.base(1))  # plain steps as measured: their own residual
    assert model.cycle(1) == pytest.approx(model.base(1), rel=0.1)
    assert model.cycle(16) > 1.3 * before  # speculative cycles keep most of their correction
    model.observe(16, 1e9)  # one outlier moves it by a bounded factor only
    assert model.cycle(16) < 4 * 2 * before


# -- lossless for any sequence of widths ------------------------------------------------------

SCRIPTS = [[1, 16, 3, 1, 1, 7, 2], [5, 1], [1] * 20 + [16] * 3, [2, 16, 1, 4]]


@pytest.fixture(params=["tiny_hybrid", "tiny_attn"])
def target(request):
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("script", SCRIPTS, ids=["mixed", "alternate", "plain-run", "wide"])
def test_greedy_is_lossless_whatever_the_widths(target, script):
    model, tokenizer = target
    ids = tokenizer.encode("def fibonacci(n):")
    reference = plain(model, ids)
    tokens, stats = decode(model, random_drafter(model), ids, Scripted(script))
    assert tokens == reference
    draft = ReplayDrafter(ids + reference, [15], random_drafter(model))  # drafts always right
    tokens, stats = decode(model, draft, ids, Scripted(script))
    assert tokens == reference
    # Every speculative cycle accepted all its drafts: the drafter's context (plain steps'
    # positions included) lined up with the committed tokens throughout.
    assert stats.accepted == stats.drafted
    widths = {b for b, n in enumerate(stats.block_size_histogram) if n}
    assert set(script) <= widths  # each scripted width ran (the last may be cut by max_tokens)


def test_greedy_with_penalties_and_changing_widths(tiny_hybrid):
    from mlx_lm.sample_utils import make_logits_processors

    model, tokenizer = tiny_hybrid
    ids = tokenizer.encode("The quick brown fox")
    processors = make_logits_processors(None, 1.3, 20, 0.7, 20, None, 20)
    reference = [
        t
        for t, _ in generate_step(mx.array(ids), model, max_tokens=N, logits_processors=processors)
    ]
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.7)
    draft = ReplayDrafter(ids + reference, [3, 0, 15], random_drafter(model))
    tokens, _ = decode(model, draft, ids, Scripted(SCRIPTS[0]), params=params)
    assert tokens == reference


@pytest.mark.slow
def test_sampling_is_exact_with_changing_widths(tiny_hybrid):
    """Joint law of the first 3 tokens when cycles switch between widths (cf. test_sampling)."""
    from collections import Counter

    from tests.test_sampling import exact_law, total_variation, tv_tolerance

    model, tokenizer = tiny_hybrid
    prompt = tokenizer.encode("The quick brown")
    params = SamplingParams(temperature=1.5, top_k=2, repetition_penalty=1.2)
    inner = random_drafter(model, block_size=4)
    target = TargetModel(model, inner.config.target_layer_ids)

    exact = exact_law(model, prompt, params)
    best = max(exact, key=exact.get)
    n, counts = 500, Counter()
    for seed in range(n):
        draft = ReplayDrafter(prompt + list(best) + [0] * 8, [3], inner)
        # The width depends on the seed: plain first, a 2-wide block, or a 3-wide one.
        script = [[1, 2], [2, 1], [3], [1, 1]][seed % 4]
        decoder = SpeculativeDecoder(
            Row(target, draft, TokenSampler(params, seed=seed), Scripted(script, 4))
        )
        counts[tuple(t for commit in decoder.generate(prompt, 3) for t in commit.tokens)] += 1
    assert total_variation(counts, exact, n) < tv_tolerance(len(exact), n, factor=2.0)


# -- "auto" end to end ------------------------------------------------------------------------


def test_auto_through_stream_generate(tiny_hybrid):
    model, tokenizer = tiny_hybrid
    ids = tokenizer.encode("def fibonacci(n):")
    n = 200
    reference = plain(model, ids, n)
    # Predictable, then hopeless (drafter calls, not tokens: plain steps call no drafter), then
    # predictable again. One rejection after full blocks is not yet a turn: it takes a few.
    pattern = [15] * 4 + [0] * 6 + [15] * 200
    draft = ReplayDrafter(ids + reference, pattern, random_drafter(model))
    ModelPair.of(model, tokenizer, draft, measured=costs())  # no timing in tests
    out = list(stream_generate(model, draft, tokenizer, ids, "auto", max_tokens=n))
    assert [t for r in out for t in r.tokens] == reference
    stats = out[-1].stats
    d = stats.as_dict()
    assert d["block_policy"] == "auto" and d["block_size"] == 16
    hist = d["block_size_histogram"]
    assert hist[1] > 0 and sum(hist[2:]) > 0  # both plain steps and speculation happened
    assert 0 < d["plain_share"] < 1
    assert d["controller"]["block_size"] > 1  # recovered by the end
    assert "blocks (auto)" in stats.summary()


def test_block_size_none_is_the_trained_block_and_fixed(tiny_hybrid):
    model, tokenizer = tiny_hybrid
    ids = tokenizer.encode("hello")
    out = list(
        stream_generate(model, random_drafter(model, block_size=8), tokenizer, ids, None, 12)
    )
    d = out[-1].stats.as_dict()
    assert d["block_policy"] == "fixed" and d["block_size"] == 8 and "controller" not in d
    assert d["block_size_histogram"][8] > 0  # the trained block (the last cycle may be cut)


def test_only_steady_cycles_teach_the_costs(tiny_hybrid):
    """Between two reads lies one cycle's work only in a steady state: a plain run's first
    step (after a prefill or a speculative cycle) and its last (before one) are not timed."""

    seen: list[tuple[int, bool]] = []  # (width, timed) per cycle read

    class Timed(Scripted):
        def observe(self, size, accepted, seconds, *args, **kwargs):
            seen.append((size, seconds is not None))

    model, tokenizer = tiny_hybrid
    ids = tokenizer.encode("def fibonacci(n):")
    policy = Timed([1, 1, 1, 1, 4])
    tokens, _ = decode(model, random_drafter(model), ids, policy, n=30)
    assert tokens == plain(model, ids, 30)
    run = [(1, False), (1, True), (1, True), (1, False), (4, True)]
    assert seen[:10] == run + run


def test_a_new_request_starts_from_the_last_ones_stopping_point():
    """The pair's prior keeps where drafts stop being accepted, not only a per-draft rate:
    after a request whose drafts go wrong at the fourth, the next one starts about 4 wide,
    where the same rate spread evenly over the positions verifies drafts that will fail."""
    from dflash_server.adaptive.controller import SharedPrior

    prior = SharedPrior()
    first = BlockController(16, costs(verify16=4.0), prior=prior)
    for _ in range(12):
        size = first.next_size(100)
        first.observe(size, min(size - 1, 3), None)
    assert first.next_size(100) == 4
    assert BlockController(16, costs(verify16=4.0), prior=prior).next_size(100) in (4, 5)
    flat = SharedPrior(prior.rate)  # the same per-draft rate, no positions
    assert BlockController(16, costs(verify16=4.0), prior=flat).next_size(100) > 5


@pytest.mark.parametrize("verify16", [2.0, 6.0])
def test_a_new_request_remembers_where_a_wider_cycle_failed(verify16):
    """Full 8-wide blocks say nothing past the eighth position; the one wider cycle that
    failed there is what keeps the next request from a wider first cycle (or, the evidence
    shrunk twice, a narrower one): it starts where the last one's estimate ended."""
    from dflash_server.adaptive.controller import SharedPrior

    prior = SharedPrior()
    first = BlockController(16, costs(verify16=verify16), prior=prior)
    first.observe(13, 7, None)  # drafts 1-7 right, the eighth wrong
    for _ in range(5):
        first.observe(8, 7, None)  # full (censored) blocks
    second = BlockController(16, costs(verify16=verify16), prior=prior)
    assert second.acceptance.rates()[7] == pytest.approx(first.acceptance.rates()[7], abs=0.02)
    assert second.next_size(100) == 8


def test_a_new_request_starts_from_the_last_ones_acceptance():
    from dflash_server.adaptive.controller import SharedPrior

    prior = SharedPrior()
    first = BlockController(16, costs(), prior=prior)
    assert first.next_size(100) > 1  # optimistic start
    for _ in range(20):
        first.observe(16, 0, None)
    assert prior.rate == 0.2  # bounded: a hopeless request does not rule out the next one
    assert BlockController(16, costs(), prior=prior).next_size(100) == 1
    for _ in range(20):
        first.observe(16, 15, None)
    assert prior.rate == 0.9
    assert BlockController(16, costs(), prior=prior).next_size(100) == 16


@pytest.mark.parametrize("family", ["DFlash", "DFlash2"])
def test_measure_costs(tiny_hybrid, family):
    from dflash_server.generation.calibrate import measure_costs
    from dflash_server.testing import random_dflash2_drafter

    model, _ = tiny_hybrid
    draft = random_drafter(model) if family == "DFlash" else random_dflash2_drafter(model)
    measured = measure_costs(model, draft, budget_s=2.0)
    widths = sorted(measured.verify)
    assert widths[0] == 1 and widths[-1] == draft.config.block_size
    assert all(measured.verify[a] <= measured.verify[b] for a, b in itertools.pairwise(widths))
    assert measured.plain > 0 and all(t > 0 for t in measured.draft.values())
    # A wider cycle never costs less (the calibration's times are kept rising; the residuals'
    # log/exp round trip may leave the last bit either way).
    assert measured.cycle(draft.config.block_size) >= measured.cycle(2) * (1 - 1e-9) > 0
    assert "cycle cost (ms): plain step" in measured.describe()


def test_a_choice_the_batch_narrows_to_plain_is_followed_for_a_while() -> None:
    """A batch's budget ran the controller's drafted choice as a plain step: it decodes
    plainly as if it had decided so, re-checking every 8th step (not every step: the check
    weighs every width, on every row of every pass)."""
    c = BlockController(16, costs())
    for _ in range(5):
        c.observe(16, 15, None)  # full blocks: speculation pays
    assert c.next_size(100) > 1
    c.narrowed(1)
    c.observe(1, 0, None)
    c.prior.plain_steps, c.gap = 0, 10**6  # (no probe due meanwhile)
    sizes = [c.next_size(100) for _ in range(8)]
    assert sizes[:7] == [1] * 7 and sizes[7] > 1


def test_a_held_row_looks_every_8th_step_even_with_a_probe_due() -> None:
    """A row the batch holds to plain wants to speculate at each look, so no probe is ever
    started to reset the pair's count: it still looks only every 8th step. A probe the batch
    narrows backs off as one that did not pay."""
    c = BlockController(16, costs())
    for _ in range(5):
        c.observe(16, 15, None)  # full blocks: speculation pays for this row alone
    looks = []
    weigh = c._best
    c._best = lambda limit: looks.append(limit) or weigh(limit)  # type: ignore[method-assign]
    assert c.next_size(100) > 1
    c.narrowed(1)
    c.prior.plain_steps = 10**6  # a probe long due
    for _ in range(16):
        if c.next_size(100) > 1:
            c.narrowed(1)
    assert len(looks) == 3  # the first choice, then steps 8 and 16

    gap = c.gap
    c.probing = True  # a probe, which the batch runs as a plain step
    c.narrowed(1)
    assert c.gap == min(2 * gap, c.max_gap) and not c.probing


def test_the_swept_cost_curve_equals_each_width_priced_alone():
    """``CostModel.curve`` (what the controller weighs every few steps) prices every width
    exactly as ``cycle`` does one at a time: drafted and verify-only, refined residuals, past
    the measured context, and after the measured curves are swapped."""
    rng = random.Random(0)
    for _ in range(300):
        widths = sorted(rng.sample(range(2, 34), rng.randint(1, 6)))
        model = CostModel(
            plain=rng.uniform(1e-3, 1e-2),
            verify={w: rng.uniform(1e-3, 5e-2) for w in widths},
            draft={
                w: rng.uniform(1e-4, 5e-3) for w in rng.sample(widths, rng.randint(1, len(widths)))
            },
            slope={
                w: rng.uniform(0, 1e-6)
                for w in rng.sample([1, *widths], rng.randint(0, len(widths)))
            },
            draft_slope=rng.choice([0.0, 1e-7]),
            draft_reach=rng.choice([None, 100]),
        )
        for _ in range(2):  # the second round: a swapped-in curve must be swept again
            model.residual = {w: rng.uniform(-1, 1) for w in rng.sample(range(1, 17), 3)}
            model.verify_residual = {w: rng.uniform(-1, 1) for w in rng.sample(range(2, 33), 2)}
            model.log_scale = rng.uniform(-0.5, 0.5)
            context, limit = rng.choice([0, 64, 65, 5000]), rng.randint(1, 33)
            for drafted in (True, False):
                alone = [model.cycle(s, drafted, context) for s in range(1, limit + 1)]
                assert model.curve(limit, context, drafted) == alone
            model.slope = {w: rng.uniform(0, 1e-6) for w in (1, 16)}

    controller = BlockController(16, costs())
    for size, accepted in ((16, 9), (8, 7), (4, 1)):
        controller.acceptance.observe(size - 1, accepted)
    rates = controller.acceptance.rates()
    assert controller._values(16) == [controller._value(rates, s) for s in range(1, 17)]
