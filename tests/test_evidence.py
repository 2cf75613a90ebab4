"""Each source's evidence kept apart (docs/design.md, "Adaptive speculation"): a suffix copy
never moves the drafter's acceptance or cost estimate, a row of a batched pass is charged what
its own cycle costs, and a drafter switched off is probed again on the pair's schedule, however
short its requests are."""

from __future__ import annotations

import math
from typing import Any

import pytest

from dflash_server.adaptive.controller import BlockController
from dflash_server.adaptive.costs import CostModel
from dflash_server.adaptive.evidence import SharedPrior
from dflash_server.adaptive.pass_costs import PassCosts
from dflash_server.adaptive.policy import DRAFTER, SUFFIX, Choice, FixedBlock, Source
from dflash_server.generation.batch import BatchDecoder
from dflash_server.generation.pair import ModelPair
from dflash_server.generation.request import BlockPolicy, GenerationRequest
from dflash_server.generation.row import Row
from dflash_server.generation.sampling import SamplingParams, TokenSampler
from dflash_server.generation.stream import generate
from dflash_server.generation.target import TargetModel
from dflash_server.testing import ReplayDrafter, random_drafter
from test_adaptive import costs
from test_batching import plain_greedy, step_rows
from test_long_prompts import MS, PassClock

# Made-up machines: a compute-bound one (a pass costs per position verified, so a wide pass is
# dear) and a memory-bound one (a wide pass costs little more than a narrow one).
PASSES = PassCosts(
    {r: (1 + 0.1 * r) * MS for r in (1, 2, 4, 8, 16)},
    {p: (1.5 + 0.5 * p) * MS for p in (2, 4, 16, 32, 64, 128)},
)
MEMORY_BOUND = PassCosts(
    {r: (1 + 0.1 * r) * MS for r in (1, 2, 4, 8, 16)},
    {p: (1.5 + 0.05 * p) * MS for p in (2, 4, 16, 32, 64, 128)},
)


def test_suffix_cycles_leave_the_drafters_acceptance_alone() -> None:
    prior = SharedPrior()
    c = BlockController(16, costs(), prior=prior)
    for _ in range(4):
        c.observe(16, 15, None)  # the drafter: full blocks
    rates, shared = c.acceptance.rates(), (prior.rate, list(prior.positions))
    for _ in range(30):  # copies that all break at once
        c.observe(33, 0, None, SUFFIX, (0.9,) * 32)
    assert c.acceptance.rates() == rates and (prior.rate, prior.positions) == shared
    assert c.trust.factor < 0.5  # what the copies taught went to the copies' own evidence


class Spy(FixedBlock):
    """A fixed width of one source every cycle (a copy of junk tokens for ``SUFFIX``), and
    the seconds each cycle was charged."""

    def __init__(self, width: int, source: Source) -> None:
        super().__init__(width)
        self.source, self.seen = source, list[tuple[int, float]]()

    def choose(self, room: int, proposal: Any = None, context: int = 0) -> Choice:
        width = max(1, min(self.block_size, room))
        if self.source == SUFFIX and width > 1:
            return Choice(SUFFIX, width, tuple(range(7, 6 + width)), (0.5,) * (width - 1))
        return Choice.width(width)

    def observe(
        self,
        size: int,
        accepted: int,
        seconds: float | None,
        source: Source = DRAFTER,
        confidence: tuple[float, ...] = (),
    ) -> None:
        super().observe(size, accepted, seconds, source, confidence)
        if seconds is not None:
            self.seen.append((size, seconds))


def test_each_row_of_a_pass_is_charged_its_own_cycle(
    tiny_hybrid: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 2-wide drafter row beside a 33-wide copy: the pass costs what 2 x 33 positions cost,
    and each row is charged what its own cycle costs alone, never the copy's width."""
    model, tokenizer = tiny_hybrid
    draft = random_drafter(model, block_size=16)
    target = TargetModel(model, draft.config.target_layer_ids)
    PassClock(monkeypatch, target, PASSES)
    batch = BatchDecoder(target, costs=PASSES)
    policies = {"draft": Spy(2, DRAFTER), "copy": Spy(33, SUFFIX), "plain": Spy(1, DRAFTER)}
    prompt = list(tokenizer.encode("def fibonacci(n):"))
    specs = {}
    for key, policy in policies.items():
        row = Row(target, draft, TokenSampler(SamplingParams()), policy)
        specs[key] = (row, prompt, 40)
    step_rows(batch, specs)
    for key, policy in policies.items():
        assert policy.seen, key
        for size, seconds in policy.seen:
            assert seconds == pytest.approx(PASSES.cost(1, size), rel=1e-6), (key, size)


def test_after_copy_heavy_requests_the_drafter_drafts_again(
    tiny_hybrid: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copy-heavy requests (answers already in the index of recent outputs) whose text the
    drafter cannot predict, then a request with nothing to copy that it predicts well: the
    drafter drafts that one from its first steps. The copies' plain steps count towards the
    pair's next probe, which comes at once; each request counting on its own (as before)
    waited a whole gap of plain steps first. Every answer is plain decoding's."""
    model, tokenizer = tiny_hybrid
    n = 64
    copied = list(tokenizer.encode("import json\nimport os\n"))[:12]
    fresh = [(17 * i) % 250 + 5 for i in range(200)]
    answers = {"copied": plain_greedy(model, copied, n), "fresh": plain_greedy(model, fresh, n)}
    reference = [1] * (len(fresh) + n + 20)  # junk where the copies go: drafts all wrong
    reference[len(fresh) : len(fresh) + n] = answers["fresh"]
    draft = ReplayDrafter(reference, [15], random_drafter(model, block_size=16))
    cycles = CostModel(
        plain=1.1 * MS,
        verify={w: (1.2 + 0.05 * w) * MS for w in (2, 4, 8, 16, 32, 33)},
        draft={2: 0.3 * MS, 16: 0.3 * MS},
    )
    pair = ModelPair.of(model, tokenizer, draft, measured=cycles)
    pair.suffix_index.add(answers["copied"])
    PassClock(monkeypatch, pair.target, MEMORY_BOUND)
    block = BlockPolicy(16, auto=True, suffix=32)

    def run(prompt: list[int], key: str) -> Any:
        request = GenerationRequest(tuple(prompt), n, block=block)
        out = list(generate(pair, request))
        assert [t for r in out for t in r.tokens] == answers[key]
        return out[-1].stats

    for _ in range(12):
        assert run(copied, "copied").sources["suffix"]["tokens"] > n / 2
    stats = run(fresh, "fresh")  # nothing to copy
    assert stats.sources["drafter"]["tokens"] > 0.8 * n, stats.as_dict()


class Optimist(FixedBlock):
    """An adaptive row that always asks for ``width`` and expects every draft accepted."""

    adaptive = True

    def expected(self, choice: Choice, width: int) -> float:
        return float(width)


def test_a_batch_judges_its_drafted_passes_by_what_they_delivered(
    tiny_hybrid: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows that promise full blocks and get none accepted: the curves (exact here) keep
    predicting a win, but what the drafted passes delivered (``PassCosts.bias``) sends the
    batch to plain decoding, probed rarely (a probe's predicted loss spread over the plain
    passes before it). Rows whose drafts then hold win it back at a probe. Every answer is
    plain decoding's."""
    model, tokenizer = tiny_hybrid
    width = 8
    prompt = list(tokenizer.encode("def fibonacci(n):"))
    answer = plain_greedy(model, prompt, 160)
    inner = random_drafter(model, block_size=16)
    costs = PassCosts(dict(MEMORY_BOUND.plain), dict(MEMORY_BOUND.speculative))

    def run(accept: int, n: int) -> tuple[int, int]:
        draft = ReplayDrafter(prompt + answer + [1] * 20, [accept], inner)
        target = TargetModel(model, draft.config.target_layer_ids)
        PassClock(monkeypatch, target, MEMORY_BOUND)
        batch = BatchDecoder(target, costs=costs)
        specs = {}
        for i in range(4):
            row = Row(target, draft, TokenSampler(SamplingParams()), Optimist(width))
            specs[i] = (row, prompt, n)
        drafted = 0
        observe = costs.observe

        def counted(rows: int, w: int, *args: Any) -> float:
            nonlocal drafted
            drafted += w > 1
            return observe(rows, w, *args)

        monkeypatch.setattr(costs, "observe", counted)
        for commits in step_rows(batch, specs).values():
            assert [t for c in commits for t in c.tokens] == answer[:n]
        return drafted, batch.passes

    drafted, passes = run(accept=0, n=48)
    bias = costs.bias(4)
    assert bias is not None and bias < -1.0
    assert drafted <= 5 and passes >= 47  # the first drafted pass, and a few probes
    drafted, passes = run(accept=width - 1, n=160)  # every draft right now: a probe pays
    assert drafted >= 10 and passes < 120, (drafted, passes)


def test_each_row_count_keeps_its_own_record_of_drafted_passes() -> None:
    """A batch's drafted passes are judged per row count (a pass of 8 rows errs otherwise than
    one of 4); a row count with no record yet starts from the nearest one's."""
    costs = PassCosts({1: 1.0, 4: 2.0, 8: 3.0}, {8: 2.0, 16: 3.0, 64: 10.0})
    assert costs.bias(4) is None
    # 4 tokens in 4 s where plain gives 4 rows' tokens in 2 s: half the predicted speedup (1x).
    costs.observe(4, 2, 4.0, committed=4, predicted=0.0)
    assert costs.bias(4) == pytest.approx(math.log(0.5))
    assert costs.bias(8) == costs.bias(6) == costs.bias(4)  # the nearest record meanwhile
    # 8 rows deliver exactly what was predicted: their record moves on from 4's, 4's stays.
    costs.observe(8, 2, 3.0, committed=8, predicted=0.0)  # a plain pass's 8 tokens in its 3 s
    assert costs.bias(4) == pytest.approx(math.log(0.5))
    assert costs.bias(8) == pytest.approx(0.7 * math.log(0.5))


def test_a_batch_the_curves_hold_to_plain_probes_within_a_share_of_its_time(
    tiny_hybrid: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a compute-bound machine a drafted pass of 4 rows x 8 costs 12 plain ones: the budget
    holds the rows to plain decoding. Its first probes check the calibration (at once, then
    after 4 and 8 narrowed passes); after that a probe waits until the last one's extra cost
    is at most 2 % of the plain passes since (here the longest gap, 256): 3 drafted passes in
    200, where a gap that merely doubled let 6 through. Meanwhile the held rows do not even
    look (each look is a sweep of every width). Every answer is plain decoding's."""
    model, tokenizer = tiny_hybrid
    prompt = list(tokenizer.encode("def fibonacci(n):"))
    answer = plain_greedy(model, prompt, 200)
    draft = random_drafter(model, block_size=16)
    target = TargetModel(model, draft.config.target_layer_ids)
    PassClock(monkeypatch, target, PASSES)
    costs = PassCosts(dict(PASSES.plain), dict(PASSES.speculative))
    batch = BatchDecoder(target, costs=costs)
    specs = {i: (Row(target, draft, TokenSampler(SamplingParams()), Optimist(8)), prompt, 200)
             for i in range(4)}  # fmt: skip
    drafted = 0
    observe = costs.observe

    def counted(rows: int, w: int, *args: Any, **kwargs: Any) -> float:
        nonlocal drafted
        drafted += w > 1
        return observe(rows, w, *args, **kwargs)

    monkeypatch.setattr(costs, "observe", counted)
    looks = 0
    choose = Optimist.choose

    def looked(self: Optimist, *args: Any, **kwargs: Any) -> Choice:
        nonlocal looks
        looks += 1
        return choose(self, *args, **kwargs)

    monkeypatch.setattr(Optimist, "choose", looked)
    for commits in step_rows(batch, specs).values():
        assert [t for c in commits for t in c.tokens] == answer
    assert drafted == 3 and batch.passes >= 197, (drafted, batch.passes)
    assert looks < 4 * 40, looks  # of 4 x 200: the passes before the hold, and around probes
