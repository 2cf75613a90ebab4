"""Suffix drafts: the index's proposals, and exactness (greedy ids, sampling law, constraints)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from dflash_server.adaptive.controller import BlockController
from dflash_server.adaptive.costs import CostModel
from dflash_server.adaptive.policy import FixedBlock
from dflash_server.chat.budget import Budgeted
from dflash_server.drafters.suffix import (
    HOLDER_BYTES,
    SharedSuffixIndex,
    SuffixProposer,
    TokenIndex,
)
from dflash_server.generation.pair import ModelPair
from dflash_server.generation.request import BlockPolicy, GenerationRequest
from dflash_server.generation.row import Row
from dflash_server.generation.sampling import SamplingParams, TokenSampler, point_mass
from dflash_server.generation.speculative import SpeculativeDecoder
from dflash_server.generation.stream import generate
from dflash_server.generation.target import TargetModel
from dflash_server.testing import random_drafter
from test_logprobs_constraints import NoMultipleOfThree
from test_sampling import exact_law, total_variation, tv_tolerance

N = 60
REPEATED = "def add(a, b):\n    return a + b\n\n" * 3 + "def add("


def cheap_verify() -> CostModel:
    """Verify cost barely grows with width: every proposal is worth verifying."""
    verify = {1: 1.0, 2: 1.01, 16: 1.1, 64: 1.3}
    return CostModel(plain=1.0, verify=verify, draft={2: 0.5, 16: 0.5}, refine=False)


def plain(model: Any, ids: list[int], n: int = N, processors: Any = None) -> list[int]:
    steps = generate_step(mx.array(ids), model, max_tokens=n, logits_processors=processors)
    return [t for t, _ in steps]


def copy_decode(
    model: Any,
    ids: list[int],
    n: int = N,
    *,
    draft: Any = None,
    shared: SharedSuffixIndex | None = None,
    params: SamplingParams | None = None,
    seed: int = 0,
    constraint: Any = None,
) -> tuple[list[int], Any]:
    target = TargetModel(model, draft.config.target_layer_ids if draft is not None else ())
    policy = BlockController(16 if draft is not None else 1, cheap_verify())
    decoder = SpeculativeDecoder(
        Row(
            target,
            draft,
            TokenSampler(params or SamplingParams(), seed),
            policy,
            constraint=constraint,
            suffix=SuffixProposer(ids, shared, max_tokens=48),
        )
    )
    tokens = [t for commit in decoder.generate(ids, n) for t in commit.tokens]
    return tokens, decoder.stats


# -- the index ----------------------------------------------------------------------------------


def test_proposes_the_most_frequent_continuation_of_the_longest_match():
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 0, 0]
    first = SuffixProposer([*tokens, 1, 2, 3]).propose()  # "1 2 3" twice: at 0 and 5
    assert first is not None and first.match == 3 and first.tokens[0] in (4, 5)
    tokens = [8, 2, 3, 4, 9, 2, 3, 5, 6, 2, 3, 5, 1]  # "2 3" -> 5 twice, -> 4 once
    second = SuffixProposer([*tokens, 7, 2, 3]).propose(4)
    assert second is not None and second.match == 2 and second.tokens[0] == 5
    assert second.confidence[0] == pytest.approx(2 / 3 * 2 / 3)  # 2 of 3 votes, match 2
    longest = SuffixProposer([*tokens, 8, 2, 3]).propose()  # "8 2 3": only the 4 follows it
    assert longest is not None and longest.match == 3 and longest.tokens[:3] == [4, 9, 2]
    assert SuffixProposer([1, 2, 3, 4]).propose() is None  # nothing repeats
    assert not SuffixProposer([1, 2, 3, 4]).matches() and SuffixProposer([2, 3, 2, 3]).matches()


def test_index_extends_incrementally_and_the_shared_index_stays_in_budget():
    index = TokenIndex([5, 6])
    index.extend([7, 5, 6])
    assert index.follows[(5, 6)] == [2, 5]
    one = TokenIndex(range(10)).nbytes() + 9 * HOLDER_BYTES  # one 10-token entry, as measured
    shared = SharedSuffixIndex(budget_bytes=int(2.5 * one))
    for start in range(0, 40, 10):
        shared.add(list(range(start, start + 10)))
    assert len(shared.entries) == 2 and shared.bytes <= shared.budget  # the oldest went
    proposer = SuffixProposer([99, 31, 32], shared, max_tokens=4)
    assert proposer.propose() == proposer.propose() is not None
    assert proposer.propose().tokens == [33, 34, 35, 36]  # type: ignore[union-attr]
    proposer.extend([33])
    proposer.finish()  # its output (one token) is too short to index
    assert len(shared.entries) == 2


@pytest.mark.parametrize("vocab", [2_000, 150_000])
def test_the_shared_index_reports_its_real_memory(vocab: int) -> None:
    """Its budget is real memory: what it reports is within 2x of what tracemalloc measures
    (Python ints, lists and tuples cost a few hundred bytes a token, not the ids' 4)."""
    import random
    import tracemalloc

    rng = random.Random(0)
    tracemalloc.start()
    try:
        shared = SharedSuffixIndex(budget_bytes=2**40)
        for _ in range(100):  # the ids are made under tracing: the index keeps their objects
            shared.add([rng.randrange(1000, 1000 + vocab) for _ in range(300)])
        measured, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert measured / 2 <= shared.bytes <= measured * 2, (shared.bytes, measured)
    assert shared.bytes / 30_000 > 150  # bytes per token: far above the old 72


# -- exactness ----------------------------------------------------------------------------------


@pytest.fixture(params=["tiny_hybrid", "tiny_attn"])
def target(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(request.param)


def test_greedy_copies_equal_plain_decoding(target: Any) -> None:
    """Prompts that repeat a block; then the same prompt again (its earlier output is in the
    shared index: long copies, wider than the drafter's block), a corrupted earlier output (every
    acceptance length), and copies next to a drafter."""
    model, tokenizer = target
    ids = tokenizer.encode(REPEATED)
    reference = plain(model, ids)
    shared = SharedSuffixIndex(1 << 20)
    tokens, _ = copy_decode(model, ids, shared=shared)
    assert tokens == reference
    tokens, stats = copy_decode(model, ids, shared=shared)
    assert tokens == reference
    copied = stats.sources["suffix"]
    assert copied["widest"] > 16 and copied["tokens"] > N // 2  # wider than a drafter block
    corrupted = SharedSuffixIndex(1 << 20)
    corrupted.add([t + 1 if i % 7 == 6 else t for i, t in enumerate(reference)])
    tokens, stats = copy_decode(model, ids, shared=corrupted)
    assert tokens == reference and stats.sources["suffix"]["tokens"] > 0
    tokens, stats = copy_decode(model, ids, draft=random_drafter(model), shared=shared)
    assert tokens == reference and stats.sources["suffix"]["cycles"] > 0


def test_constrained_copies_equal_plain_decoding(tiny_attn: Any) -> None:
    model, tokenizer = tiny_attn
    ids = tokenizer.encode(REPEATED)
    vocab = model.model.embed_tokens.weight.shape[0]
    reference = plain(model, ids, N, [NoMultipleOfThree(vocab, ids[-1]).processor()])
    shared = SharedSuffixIndex(1 << 20)
    shared.add(reference)
    for _ in range(2):
        constraint = NoMultipleOfThree(vocab, ids[-1])
        tokens, stats = copy_decode(model, ids, shared=shared, constraint=constraint)
        assert tokens == reference and stats.sources["suffix"]["tokens"] > 0
        shared.add([t + 1 if i % 5 == 4 else t for i, t in enumerate(reference)])


@pytest.mark.slow
def test_point_mass_acceptance_reproduces_the_target_distribution():
    """A proposal with q = 1 on its token: kept with p(token), else resampled from p without it."""
    probs = [[0.5, 0.3, 0.15, 0.05, 0.0], [0.1, 0.2, 0.3, 0.2, 0.2]]
    p = mx.log(mx.array(probs) + 1e-30)
    sampler = TokenSampler(SamplingParams(temperature=1.0), seed=1)
    n = 4000
    for proposed in (0, 3, 4):
        drafts = mx.array([proposed])
        log_q = point_mass(drafts, 5)
        counts: Counter = Counter()
        for _ in range(n):
            accepted, bonus = sampler.accept(p, drafts, log_q)
            counts[proposed if accepted.item() else int(bonus.item())] += 1
        assert counts[4] == 0
        want = dict(enumerate(probs[0]))
        assert total_variation(counts, want, n) < tv_tolerance(4, n)


LAW_PARAMS = SamplingParams(temperature=1.5, top_k=2, repetition_penalty=1.2)


def three_token_law(model: Any, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """The exact joint law of the first 3 sampled tokens under ``LAW_PARAMS``."""
    return exact_law(model, prompt, LAW_PARAMS)


def likeliest_copies(prompt: list[int], exact: dict[tuple[int, ...], float]) -> SharedSuffixIndex:
    """An index that, whichever first token comes, proposes the likeliest rest after it."""
    best = max(exact, key=exact.__getitem__)
    shared = SharedSuffixIndex(1 << 20)
    for t0 in {k[0] for k in exact}:
        shared.add([prompt[-1], t0, *best[1:], 0])
    return shared


@pytest.mark.slow
def test_sampled_copies_follow_the_target_law(tiny_hybrid: Any) -> None:
    """Joint law of the first 3 tokens when every cycle verifies a copy of the likeliest path."""
    model, tokenizer = tiny_hybrid
    prompt = tokenizer.encode("The quick brown")
    exact = three_token_law(model, prompt)
    shared = likeliest_copies(prompt, exact)
    n, counts = 600, Counter()
    copied = 0
    for seed in range(n):
        tokens, stats = copy_decode(model, prompt, 3, shared=shared, params=LAW_PARAMS, seed=seed)
        counts[tuple(tokens)] += 1
        copied += stats.sources["suffix"]["cycles"]
    assert copied > n // 2  # most runs verified a copy
    assert total_variation(counts, exact, n) < tv_tolerance(len(exact), n, factor=2.0)


@pytest.mark.parametrize("with_drafter", [False, True])
def test_copies_are_exact_under_a_thinking_budget(tiny_hybrid: Any, with_drafter: bool) -> None:
    """Through ``generate`` with the pair's measured costs (verify-only widths calibrated at
    first use, with and without a drafter); the budget's forced token may be copied too."""
    model, tokenizer = tiny_hybrid
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Is it sunny?"}],
        add_generation_prompt=True,
        tokenize=False,
        enable_thinking=True,
    )
    prompt, end = tokenizer.encode(text), tokenizer.think_end_id
    rows = model.language_model.model.embed_tokens.weight.shape[0]
    spec = Budgeted(10, end, rows, None)

    def run(draft: Any, block: BlockPolicy) -> tuple[list[int], Any]:
        request = GenerationRequest(tuple(prompt), 40, block=block, constraint=spec)
        out = list(generate(ModelPair.of(model, tokenizer, draft), request))
        return [t for r in out for t in r.tokens], out[-1].stats

    reference, _ = run(None, BlockPolicy(1))
    assert reference.index(end) == 10
    draft = random_drafter(model, block_size=8) if with_drafter else None
    block = BlockPolicy(8, auto=True, suffix=32) if with_drafter else BlockPolicy(1, suffix=32)
    pair = ModelPair.of(model, tokenizer, draft)
    pair.suffix_index.add([prompt[-1], *reference])
    tokens, stats = run(draft, block)
    assert tokens == reference
    assert stats.sources["suffix"]["tokens"] > 10
    assert max(pair.costs.get().verify) >= 33  # measured up to the widest copy


# -- inside a batched pass -----------------------------------------------------------------------


def copy_decoder(
    model: Any,
    ids: list[int],
    draft: Any = None,
    shared: SharedSuffixIndex | None = None,
    **kw: Any,
) -> SpeculativeDecoder:
    """A decoder as ``copy_decode`` builds it (the "auto" controller with suffix drafts)."""
    target = TargetModel(model, draft.config.target_layer_ids if draft is not None else ())
    sampler = TokenSampler(kw.pop("params", None) or SamplingParams(), kw.pop("seed", None))
    policy = BlockController(16 if draft is not None else 1, cheap_verify())
    suffix = SuffixProposer(ids, shared, max_tokens=48)
    return SpeculativeDecoder(Row(target, draft, sampler, policy, suffix=suffix, **kw))


def batched(model: Any, specs: dict[str, tuple], max_verify: int | None = None) -> tuple:
    """specs: key -> (decoder factory, prompt, n, start round); key -> (tokens, commits,
    decoder), and the batch."""
    from test_batching import new_batch, step_rows

    batch = new_batch(model, max_verify)
    decoders = {k: make() for k, (make, *_) in specs.items()}
    rows = {k: (decoders[k].row, p, n) for k, (_, p, n, _) in specs.items()}
    commits = step_rows(batch, rows, {k: s[3] for k, s in specs.items()})
    tokens = {k: [t for c in cs for t in c.tokens] for k, cs in commits.items()}
    return {k: (tokens[k], commits[k], decoders[k]) for k in specs}, batch


@pytest.mark.parametrize("max_verify", [None, 40])
def test_batched_rows_copy_and_equal_plain_decoding(target: Any, max_verify: int | None) -> None:
    """Copying rows (with and without a drafter, one under a grammar) next to a drafting row and
    a plain row, joining at different rounds; with ``max_verify`` the wide copies are narrowed
    to fit the pass. Every row equals plain greedy decoding."""
    model, tokenizer = target
    ids = tokenizer.encode(REPEATED)
    other = tokenizer.encode("The quick brown fox")
    vocab = model.model.embed_tokens.weight.shape[0]
    reference, other_ref = plain(model, ids), plain(model, other)
    constrained_ref = plain(model, ids, N, [NoMultipleOfThree(vocab, ids[-1]).processor()])
    shared = SharedSuffixIndex(1 << 20)
    shared.add(reference)  # an earlier request's output: copies wider than a drafter block
    shared.add(constrained_ref)
    inner = random_drafter(model)
    specs = {
        "copy": (lambda: copy_decoder(model, ids, shared=shared), ids, N, 0),
        "copy+draft": (lambda: copy_decoder(model, ids, inner, shared), ids, N, 2),
        "grammar": (lambda: copy_decoder(model, ids, shared=shared,
                    constraint=NoMultipleOfThree(vocab, ids[-1])), ids, N, 1),
        "drafter": (lambda: SpeculativeDecoder(Row(TargetModel(model,
                    inner.config.target_layer_ids), inner, TokenSampler(SamplingParams()),
                    FixedBlock(4))), other, N, 0),
        "plain": (lambda: SpeculativeDecoder(Row(TargetModel(model, ()), None,
                  TokenSampler(SamplingParams()), FixedBlock(1))), other, N, 3),
    }  # fmt: skip
    out, batch = batched(model, specs, max_verify)
    assert out["copy"][0] == out["copy+draft"][0] == reference
    assert out["grammar"][0] == constrained_ref
    assert out["drafter"][0] == out["plain"][0] == other_ref
    for key in ("copy", "copy+draft", "grammar"):
        assert out[key][2].stats.sources["suffix"]["tokens"] > N // 2, key
    widest = max(out[k][2].stats.sources["suffix"]["widest"] for k in ("copy", "copy+draft"))
    if max_verify is None:
        assert widest > 16  # copies wider than the drafter's block ran in the batch
    else:
        assert widest <= max_verify // 2  # narrowed: several rows shared each pass
    assert max(batch.histogram) >= 4 and batch.rows == []
    assert len(shared.entries) > 2  # finished rows' outputs joined the shared index


def test_batched_sampled_copies_equal_their_lone_runs(tiny_hybrid: Any) -> None:
    """Seeded sampled rows that copy (point-mass acceptance, rejections resampled) draw the same
    tokens batched as alone, so they follow the law the lone test above checks; their logprobs
    agree within 1e-4."""
    model, tokenizer = tiny_hybrid
    prompt = tokenizer.encode("The quick brown")
    exact = three_token_law(model, prompt)
    inner = random_drafter(model)

    def make(seed: int) -> Any:
        def build() -> SpeculativeDecoder:
            draft = inner if seed % 2 else None  # its own index: rows finish in another order
            shared = likeliest_copies(prompt, exact)
            return copy_decoder(model, prompt, draft, shared, params=LAW_PARAMS, seed=seed,
                                logprobs=2)  # fmt: skip

        return build

    specs = {seed: (make(seed), prompt, 3 + seed % 4, seed % 3) for seed in range(12)}
    out, batch = batched(model, specs)
    copied = 0
    for seed, (make_one, _, n, _) in specs.items():
        lone = list(make_one().generate(prompt, n))
        tokens, commits, row = out[seed]
        assert tokens == [t for c in lone for t in c.tokens], seed
        got = [lp for c in commits for lp in c.logprobs]
        want = [lp for c in lone for lp in c.logprobs]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4, seed
        copied += row.stats.sources["suffix"]["cycles"]
    assert copied >= len(specs) and max(batch.histogram) >= 8
