"""Batched speculation: every row's output equals the same request run alone."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from dflash_server.adaptive.policy import Choice, FixedBlock
from dflash_server.generation import row as row_module
from dflash_server.generation.batch import BatchDecoder
from dflash_server.generation.cycle import PREFILL_CHUNK, Commit
from dflash_server.generation.prefill import prefill
from dflash_server.generation.row import Row
from dflash_server.generation.sampling import SamplingParams, TokenSampler
from dflash_server.generation.speculative import SpeculativeDecoder
from dflash_server.generation.target import TargetModel
from dflash_server.testing import ReplayDrafter, random_drafter

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "<|im_start|>user\nhi<|im_end|>\n"]


@pytest.fixture(params=["tiny_hybrid", "tiny_attn"])
def target(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    return request.getfixturevalue(request.param)


def plain_greedy(model: Any, ids: list[int], n: int) -> list[int]:
    return [t for t, _ in generate_step(mx.array(ids), model, max_tokens=n)]


class Scripted(FixedBlock):
    """A block policy that follows a fixed list of widths (then repeats the last)."""

    def __init__(self, widths: list[int]) -> None:
        super().__init__(max(widths))
        self.widths, self.i = widths, 0

    def choose(self, room: int, proposal: Any = None, context: int = 0) -> Choice:
        w = self.widths[min(self.i, len(self.widths) - 1)]
        self.i += 1
        return Choice.width(max(1, min(w, room)))


def make_decoder(model: Any, draft: Any, block: int, **kw: Any) -> SpeculativeDecoder:
    taps = draft.config.target_layer_ids if draft is not None else ()
    sampler = TokenSampler(kw.pop("sampling", SamplingParams()), kw.pop("seed", None))
    policy = kw.pop("policy", None) or FixedBlock(block)
    return SpeculativeDecoder(Row(TargetModel(model, tuple(taps)), draft, sampler, policy, **kw))


def tokens_of(commits: Any) -> list[int]:
    return [t for c in commits for t in c.tokens]


def step_rows(
    batch: BatchDecoder, specs: dict[Any, tuple], start: dict[Any, int] | None = None
) -> dict[Any, list[Commit]]:
    """specs: key -> (row, prompt, max_tokens); each row joins at its ``start`` round (default
    0), then the batch steps until every row is done, as the engine runs it. Key -> commits."""
    start = start or {}
    waiting, keys = dict(specs), {}
    out: dict[Any, list[Commit]] = {k: [] for k in specs}
    rounds = 0
    while waiting or batch.busy:
        for key in [k for k in waiting if start.get(k, 0) <= rounds]:
            row, prompt, n = waiting.pop(key)
            keys[row] = key
            batch.add(row, prompt, n)
        for row, outcome in batch.step().items():
            assert not isinstance(outcome, Exception), outcome
            if outcome is not PREFILL_CHUNK:
                out[keys[row]].append(outcome)
        rounds += 1
    return out


def new_batch(model: Any, max_verify: int | None = None) -> BatchDecoder:
    inner = random_drafter(model)
    return BatchDecoder(TargetModel(model, tuple(inner.config.target_layer_ids)), max_verify)


def run_batched(model: Any, specs: dict[str, tuple], start: dict[str, int] | None = None):
    """specs: key -> (decoder factory, prompt, max_tokens); returns key -> tokens, and the batch."""
    batch = new_batch(model)
    rows = {k: (make().row, prompt, n) for k, (make, prompt, n) in specs.items()}
    commits = step_rows(batch, rows, start)
    return {k: tokens_of(c) for k, c in commits.items()}, batch


def test_rows_joining_and_leaving_equal_lone_runs(target: tuple[Any, Any]) -> None:
    model, tokenizer = target
    inner = random_drafter(model)
    ids = [list(tokenizer.encode(p)) for p in PROMPTS]
    long = list(tokenizer.encode(" ".join(PROMPTS) * 3))
    refs = [plain_greedy(model, p, 60) for p in [*ids, long]]

    def replay(i: int, pattern: list[int]) -> Any:
        prompt = [*ids, long][i]
        return ReplayDrafter(prompt + refs[i], pattern, inner)

    specs = {
        "a": (lambda: make_decoder(model, replay(0, [0, 3, 1, 2]), 4), ids[0], 40),
        "b": (lambda: make_decoder(model, replay(1, [7, 0, 5]), 8), ids[1], 25),
        "plain": (lambda: make_decoder(model, None, 1), ids[2], 30),
        "long": (lambda: make_decoder(model, replay(3, [15, 2]), 16, prefill_step_size=5),
                 long, 50),
        "widths": (lambda: make_decoder(model, replay(0, [3, 0, 2, 1, 5]), 8,
                   policy=Scripted([1, 1, 4, 8, 2, 1, 6, 8, 3])), ids[0], 45),
    }  # fmt: skip
    out, batch = run_batched(model, specs, start={"b": 3, "long": 2, "widths": 6})
    for key, (make, prompt, n) in specs.items():
        assert out[key] == tokens_of(make().generate(prompt, n)), key
    assert out["a"] == refs[0][:40] and out["long"] == refs[3][:50]
    assert batch.rows == [] and max(batch.histogram) >= 4  # rows overlapped


def collect(model: Any, specs: dict[str, tuple], start: dict[str, int] | None = None):
    """Like ``run_batched`` but keeps the commits (for logprobs)."""
    rows = {k: (make().row, prompt, n) for k, (make, prompt, n) in specs.items()}
    return step_rows(new_batch(model), rows, start)


def test_logprobs_penalties_and_constraints_per_row(tiny_hybrid: tuple[Any, Any]) -> None:
    """Rows with logprobs, penalties and a grammar next to free rows: each as alone."""
    from test_logprobs_constraints import NoMultipleOfThree

    model, tokenizer = tiny_hybrid
    inner = random_drafter(model)
    vocab = model.model.embed_tokens.weight.shape[0]
    ids = [list(tokenizer.encode(p)) for p in PROMPTS]
    penalties = SamplingParams(repetition_penalty=1.3, presence_penalty=0.7)
    specs = {
        "logprobs": (lambda: make_decoder(model, inner, 16, logprobs=3), ids[0], 30),
        "penalties": (lambda: make_decoder(model, inner, 4, sampling=penalties), ids[1], 30),
        "grammar": (lambda: make_decoder(model, inner, 8, logprobs=0,
                    constraint=NoMultipleOfThree(vocab, ids[2][-1])), ids[2], 30),
        "free": (lambda: make_decoder(model, None, 1, logprobs=2), ids[1], 20),
    }  # fmt: skip
    out = collect(model, specs, start={"grammar": 1})
    for key, (make, prompt, n) in specs.items():
        lone = list(make().generate(prompt, n))
        assert tokens_of(out[key]) == tokens_of(lone), key
        if lone[0].logprobs is None:
            continue
        got = [lp for c in out[key] for lp in c.logprobs]
        want = [lp for c in lone for lp in c.logprobs]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4, key
        if lone[0].top_logprobs is not None:
            for a, b in zip(out[key], lone):
                for x, y in zip(a.top_logprobs, b.top_logprobs):
                    assert [i for i, _ in x] == [i for i, _ in y]
                    assert max(abs(u - v) for (_, u), (_, v) in zip(x, y)) < 1e-4
    tokens = tokens_of(out["grammar"])
    assert all((a + b) % 3 for a, b in zip([ids[2][-1], *tokens], tokens))


def test_cancelled_row_leaves_and_others_go_on(target: tuple[Any, Any]) -> None:
    model, tokenizer = target
    inner = random_drafter(model)
    ids = [list(tokenizer.encode(p)) for p in PROMPTS]
    batch = new_batch(model)
    makes = [lambda: make_decoder(model, inner, 4), lambda: make_decoder(model, inner, 8),
             lambda: make_decoder(model, None, 1)]  # fmt: skip
    rows = [make().row for make in makes]
    for row, p in zip(rows, ids):
        batch.add(row, p, 40)
    out: list[list[int]] = [[], [], []]
    rounds = 0
    while batch.busy:
        if rounds == 5:  # the client went away: its row leaves mid-stream
            batch.remove(rows[1])
            assert len(batch.rows) == 2
        for row, commit in batch.step().items():
            assert not isinstance(commit, Exception), commit
            out[rows.index(row)].extend(commit.tokens)
        rounds += 1
    for i in (0, 2):
        assert out[i] == tokens_of(makes[i]().generate(ids[i], 40))
    assert batch.rows == []


def test_prefix_cache_hit_restores_into_a_row(tiny_hybrid: tuple[Any, Any]) -> None:
    from dflash_server.engine.prefix_cache import PrefixCache

    model, tokenizer = tiny_hybrid
    inner = random_drafter(model)
    system = list(tokenizer.encode(PROMPTS[2] * 4))
    prompts = [system + list(tokenizer.encode(p)) for p in PROMPTS[:2]]
    cache = PrefixCache(1 << 30)
    cut = (len(system),)

    def make(prefix: Any) -> Any:
        return lambda: make_decoder(model, inner, 8, prefix=prefix, checkpoints=cut,
                                    prefill_step_size=16)  # fmt: skip

    cold = [tokens_of(make(None)().generate(p, 30)) for p in prompts]
    list(make(cache)().generate(prompts[0], 1))  # leaves the shared system prompt cached
    specs = {"hit": (make(cache), prompts[1], 30), "other": (make(None), prompts[0], 30)}
    decoders: dict[str, Any] = {}

    def keep(key: str, factory: Any) -> Any:
        def build() -> Any:
            decoders[key] = factory()
            return decoders[key]

        return build

    specs = {k: (keep(k, f), p, n) for k, (f, p, n) in specs.items()}
    out, _ = run_batched(model, specs)
    assert out["hit"] == cold[1] and out["other"] == cold[0]
    assert decoders["hit"].stats.cached_tokens >= len(system)


def test_sampled_rows_equal_their_lone_runs(tiny_hybrid: tuple[Any, Any]) -> None:
    """A sampled row draws from its own seeded stream: batched or alone, the same tokens."""
    model, tokenizer = tiny_hybrid
    inner = random_drafter(model)
    ids = list(tokenizer.encode(PROMPTS[0]))
    params = SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.1)
    specs = {
        seed: (lambda s=seed: make_decoder(model, inner, 2 + s % 7, sampling=params, seed=s),
               ids, 24)
        for seed in range(6)
    }  # fmt: skip
    specs[99] = (lambda: make_decoder(model, None, 1), ids, 24)  # a greedy row alongside
    out, _ = run_batched(model, specs)
    for key, (make, prompt, n) in specs.items():
        assert out[key] == tokens_of(make().generate(prompt, n)), key


@pytest.mark.slow
def test_sampled_rows_follow_the_target_law(tiny_hybrid: tuple[Any, Any]) -> None:
    """Joint law of 3 tokens per row, rows batched 8 at a time, against the exact law."""
    from collections import Counter

    from test_sampling import exact_law, total_variation, tv_tolerance

    model, tokenizer = tiny_hybrid
    prompt = list(tokenizer.encode("The quick brown"))
    params = SamplingParams(temperature=1.5, top_k=2, repetition_penalty=1.2)
    inner = random_drafter(model, block_size=4)
    exact = exact_law(model, prompt, params)
    best = max(exact, key=exact.get)
    n, counts = 480, Counter()
    for first in range(0, n, 8):
        specs = {}
        for seed in range(first, first + 8):
            draft = ReplayDrafter(prompt + list(best) + [0] * 8, [3], inner)
            width = 4 if seed % 2 else 2
            specs[seed] = (lambda d=draft, s=seed, w=width: make_decoder(
                model, d, w, sampling=params, seed=s), prompt, 3)  # fmt: skip
        out, _ = run_batched(model, specs)
        counts.update(tuple(tokens) for tokens in out.values())
    assert total_variation(counts, exact, n) < tv_tolerance(len(exact), n, factor=2.0)


def test_one_drafter_pass_equals_each_row_alone(tiny_hybrid: tuple[Any, Any]) -> None:
    """Rows with different context lengths and widths, drafted together: each row's draft
    distribution (log q) and drafts equal its own pass; the context caches end the same."""
    from dflash_server.drafters.protocol import DraftRow

    model, _ = tiny_hybrid
    draft = random_drafter(model, block_size=8)
    draft.set_window(10, sinks=2)  # the server's sink window: rows drop context
    features = len(draft.config.target_layer_ids) * 64
    params = SamplingParams(temperature=0.8)
    mask = draft.config.mask_token_id

    def rows() -> list[DraftRow]:
        out = []
        for i, (context, width) in enumerate([(5, 8), (23, 3), (9, 6)]):
            cache = draft.make_cache()
            taps = mx.random.normal((1, context, features), key=mx.random.key(i))
            draft.append_context(taps[:, :-2], cache)  # some context cached, some new
            draft.append_context(taps[:, -2:], cache)
            block = mx.array([[7 + i] + [mask] * (width - 1)])
            out.append(DraftRow(block, cache, TokenSampler(params, i)))
        return out

    together, apart = rows(), rows()
    got = draft.propose(together)
    want = [draft.propose([r])[0] for r in apart]
    for (d1, q1), (d2, q2), a, b in zip(got, want, together, apart):
        assert d1.tolist() == d2.tolist()
        assert mx.allclose(q1, q2, atol=1e-4).item()
        assert [c.offset for c in a.cache] == [c.offset for c in b.cache]


def test_verify_budget_caps_widths_where_the_batch_gains(tiny_hybrid: tuple[Any, Any]) -> None:
    from dflash_server.adaptive.controller import BlockController
    from dflash_server.adaptive.costs import CostModel
    from dflash_server.adaptive.pass_costs import PassCosts, choose_widths
    from dflash_server.adaptive.policy import Choice

    model, _ = tiny_hybrid
    inner = random_drafter(model)
    one = CostModel(plain=0.01, verify={2: 0.011, 16: 0.02}, draft={2: 0.002, 16: 0.004})

    def row(rate: float) -> Row:
        policy = BlockController(16, one.copy())
        policy.acceptance.rate = rate
        policy.acceptance.tried = [0.0] * 15
        return make_decoder(model, inner, 16, policy=policy).row

    fixed = make_decoder(model, inner, 8).row
    rows = [row(0.9), row(0.9), fixed, make_decoder(model, None, 1).row]
    wanted = [16, 12, 8, 1]
    choices = [Choice.width(w) for w in wanted]
    # Compute-bound passes: wide verifies cost rows x width, so plain rows win (the fixed row
    # keeps its width: a fixed block is the request's own choice).
    steep = PassCosts({1: 0.01, 4: 0.04}, {4: 0.04, 16: 0.16, 64: 0.64})
    assert choose_widths(rows, choices, steep) == [8, 8, 8, 1]
    # Memory-bound passes: a wide verify costs little more than a plain one; keep the widths.
    flat = PassCosts({1: 0.01, 4: 0.011}, {4: 0.012, 16: 0.0125, 64: 0.013})
    assert choose_widths(rows, choices, flat) == wanted
    assert flat.rows_supported() == 16 and steep.rows_supported() == 1


def test_prompts_prefilled_together_equal_lone_prefills(target: tuple[Any, Any]) -> None:
    """One right-padded forward for prompts of different lengths: each request's first token,
    logprobs, target caches and drafter context as after its lone prefill."""
    from mlx_lm.models.cache import ArraysCache

    from dflash_server.generation.prefill import prefill, prefill_together

    def kv(c: Any) -> list[mx.array]:
        return [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]

    model, tokenizer = target
    inner = random_drafter(model)
    prompts = [list(tokenizer.encode(p)) for p in [*PROMPTS, "x"]]
    lone = [make_decoder(model, inner, 8, logprobs=2).row for _ in prompts]
    together = [make_decoder(model, inner, 8, logprobs=2).row for _ in prompts]
    for row, p in zip([*lone, *together], [*prompts, *prompts]):
        row.begin(p, 8)
    want = [prefill(row) for row in lone]
    got = prefill_together(together[0].target, together)
    for a, b, la, lb in zip(got, want, together, lone):
        assert a.result.tolist() == b.result.tolist()
        assert mx.allclose(a.logprobs[0], b.logprobs[0], atol=1e-4).item()
        for ca, cb in zip(la.cache, lb.cache):
            xs, ys = (c.cache if isinstance(c, ArraysCache) else kv(c) for c in (ca, cb))
            assert [x.shape for x in xs] == [y.shape for y in ys]
            assert all(mx.allclose(x, y, atol=1e-4).item() for x, y in zip(xs, ys))
        for ca, cb in zip(la.draft_cache, lb.draft_cache):
            assert ca.offset == cb.offset
            xs, ys = ca.snapshot()[:2], cb.snapshot()[:2]
            assert all(mx.allclose(x, y, atol=1e-4).item() for x, y in zip(xs, ys))


def test_prefilled_together_with_a_prefix_cache(tiny_hybrid: tuple[Any, Any]) -> None:
    """Cold prompts prefilled together keep their checkpoints: a later request restoring one
    (a hit, which prefills alone) gives the cold tokens; long prompts still go chunk by chunk."""
    from dflash_server.engine.prefix_cache import PrefixCache

    model, tokenizer = tiny_hybrid
    inner = random_drafter(model)
    system = list(tokenizer.encode(PROMPTS[2] * 2))
    prompts = [system + list(tokenizer.encode(p)) for p in PROMPTS[:2]]
    long = list(tokenizer.encode(" ".join(PROMPTS) * 4))
    cut = (len(system),)
    cache = PrefixCache(1 << 30)

    def make(prefix: Any, step: int = 512) -> Any:
        return lambda: make_decoder(model, inner, 8, prefix=prefix, checkpoints=cut,
                                    prefill_step_size=step)  # fmt: skip

    cold = [tokens_of(make(None)().generate(p, 30)) for p in [*prompts, long]]
    specs = {"a": (make(cache), prompts[0], 30), "b": (make(cache), prompts[1], 30),
             "long": (make(cache, 16), long, 30)}  # fmt: skip
    out, batch = run_batched(model, specs)
    assert [out["a"], out["b"], out["long"]] == cold
    assert batch.prefilled_together == 2  # the long prompt prefilled alone, in chunks
    hit = make(cache)()
    assert tokens_of(hit.generate(prompts[1] + [5, 6], 30)) == tokens_of(
        make(None)().generate(prompts[1] + [5, 6], 30)
    )
    assert hit.stats.cached_tokens >= len(system)


def test_more_waiting_prompts_than_one_prefill_holds(target: tuple[Any, Any]) -> None:
    """Prompts that do not all fit one chunk of padded tokens wait for later steps (in arrival
    order) and still equal their lone runs."""
    model, tokenizer = target
    inner = random_drafter(model)
    prompts = [list(tokenizer.encode(p))[:9] for p in [*PROMPTS, PROMPTS[0] + " x"]]
    specs = {
        i: (lambda: make_decoder(model, inner, 4, prefill_step_size=20), p, 12)
        for i, p in enumerate(prompts)
    }
    out, batch = run_batched(model, specs)
    for key, (make, prompt, n) in specs.items():
        assert out[key] == tokens_of(make().generate(prompt, n)), key
    assert batch.prefilled_together == len(prompts)  # two at a time: 2 x 9 <= 20 < 3 x 9
    assert batch.waiting == []


def test_one_token_prompts_prefill_together_with_a_prefix_cache(target: tuple[Any, Any]) -> None:
    """A one-token prompt prefilled with other new prompts while the prefix cache is on: no
    empty first segment (it failed every request of the group), each row as alone."""
    from dflash_server.engine.prefix_cache import PrefixCache

    model, tokenizer = target
    inner = random_drafter(model)
    prompts = [[5], list(tokenizer.encode(PROMPTS[0])), [7]]

    def make(prefix: Any) -> Any:
        return lambda: make_decoder(model, inner, 4, prefix=prefix)

    cache = PrefixCache(1 << 30)
    specs = {i: (make(cache), p, 12) for i, p in enumerate(prompts)}
    out, batch = run_batched(model, specs)
    for i, p in enumerate(prompts):
        assert out[i] == tokens_of(make(None)().generate(p, 12)), i
    assert batch.prefilled_together == len(prompts)


def test_seeded_rows_keep_their_widths_under_max_verify(tiny_hybrid: tuple[Any, Any]) -> None:
    """With the verify cap set, a seeded sampled row's answer does not depend on the rows
    beside it (its block is not narrowed); the other rows are, and stay exact."""
    model, tokenizer = tiny_hybrid
    inner = random_drafter(model)
    ids = [list(tokenizer.encode(p)) for p in PROMPTS]
    params = SamplingParams(temperature=1.0, top_p=0.9)

    def seeded() -> Any:
        return make_decoder(model, inner, 8, sampling=params, seed=11)

    alone = tokens_of(seeded().generate(ids[0], 24))
    for neighbours in (1, 3):
        batch = new_batch(model, max_verify=8)
        rows = {"seeded": (seeded().row, ids[0], 24)}
        for k in range(neighbours):
            rows[k] = (make_decoder(model, inner, 8).row, ids[1 + k % 2], 24)
        out = step_rows(batch, rows)
        assert tokens_of(out["seeded"]) == alone, neighbours
        for k in range(neighbours):
            assert tokens_of(out[k]) == tokens_of(make_decoder(model, inner, 8).generate(
                ids[1 + k % 2], 24)), k  # fmt: skip


def test_held_rows_keep_the_drafters_context_in_pieces(
    tiny_hybrid: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows held to plain give the drafter their taps every ``FLUSH`` steps, evaluated with
    the step: it then holds what a prefill of the same tokens gives, drafting resumes on it,
    and the tokens stay plain decoding's, alone and batched."""
    monkeypatch.setattr(row_module, "FLUSH", 3)
    model, tokenizer = tiny_hybrid
    draft = random_drafter(model)
    prompt = list(tokenizer.encode(PROMPTS[0]))
    ref = plain_greedy(model, prompt, 24)
    held = [1] * 8 + [4, 1, 1, 1, 1, 1, 1, 1, 6]  # plain runs past FLUSH, then a draft

    def make() -> SpeculativeDecoder:
        return make_decoder(model, draft, 8, policy=Scripted(held))

    alone = make()
    assert tokens_of(alone.generate(prompt, 24)) == ref
    out, _ = run_batched(model, {"a": (make, prompt, 24), "b": (make, prompt, 20)})
    assert out["a"] == ref and out["b"] == ref[:20]

    # Eight plain steps: two flushes of three; the last two steps' taps still wait.
    row = make().row
    steps = row_steps(row, prompt, 8)
    flushed = [bool(c.upkeep) for c in steps]  # the prompt's context, then every third step
    assert flushed == [True, False, False, True, False, False, True, False, False]
    fresh = make().row
    prefill_only = prompt + ref[:6]  # the positions flushed so far: the prompt and six steps
    list(SpeculativeDecoder(fresh).generate(prefill_only, 1))
    for mine, theirs in zip(row.draft_cache, fresh.draft_cache):
        assert mine.offset == theirs.offset == len(prefill_only)
        for a, b in zip(mine.fetch(), theirs.fetch()):
            assert mx.allclose(a, b, atol=1e-4).item()


def row_steps(row: Row, prompt: list[int], n: int) -> list[Any]:
    """The prefill's cycle and ``n`` plain steps of ``row`` alone, each read as the lone
    decoder reads it."""
    decoder = SpeculativeDecoder(row)
    row.begin(prompt, n + 1)
    cycles = [prefill(row)]
    row.read(cycles[0])
    for _ in range(n):
        cycles.append(decoder._queue(Choice.width(1), row.last))
        row.read(cycles[-1])
    return cycles
