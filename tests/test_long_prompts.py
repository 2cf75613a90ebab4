"""Long prompts: a prefill that stops part-way (the client gave up and will retry) is kept."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from dflash_server.engine.jobs import Failed, Finished, TextChunk
from dflash_server.engine.loader import LoadedModels, load_models
from dflash_server.engine.prefix_cache import PrefixCache
from dflash_server.generation.cycle import PREFILL_CHUNK
from dflash_server.generation.prefill import prefill_chunks
from dflash_server.generation.request import BlockPolicy, GenerationRequest
from dflash_server.generation.stream import generate
from server_fixtures import drain, make_job, start_engine

CHUNK = 16


@pytest.fixture(scope="module")
def models(tiny_hybrid_path: Path, draft_path: Path) -> LoadedModels:
    return load_models(str(tiny_hybrid_path), str(draft_path))


@pytest.mark.parametrize("batching", ["interleave", "batched"])
def test_a_cancelled_prefill_is_kept_and_the_retry_resumes(
    models: LoadedModels, batching: str
) -> None:
    """Cancel a 400-token prefill after 6 of its chunks; the same request again restores at
    least those chunks and answers as a cold run does."""
    prompt = [(13 * i) % 300 + 5 for i in range(400)]
    cache = PrefixCache(1 << 30)
    engine = start_engine(
        models, None, prefix_cache=cache, prefill_step_size=CHUNK, batching=batching
    )
    chunks, enough = 0, threading.Event()
    step = engine.rows.step

    def counted() -> Any:  # count the long prompt's chunks as the engine steps its rows
        nonlocal chunks
        outcomes = step()
        chunks += sum(1 for o in outcomes.values() if o is PREFILL_CHUNK)
        if chunks >= 6:
            enough.set()
        return outcomes

    engine.rows.step = counted

    async def main() -> tuple[list[Any], list[Any]]:
        first = make_job(prompt, 12, block_size=4)
        engine.submit(first)
        await asyncio.to_thread(enough.wait, 30)
        first.cancel()
        cancelled = await drain(first)
        retry = make_job(prompt, 12, block_size=4)
        engine.submit(retry)
        return cancelled, await drain(retry)

    try:
        cancelled, events = asyncio.run(main())
    finally:
        engine.stop()
    assert not any(isinstance(e, TextChunk) for e in cancelled)
    assert isinstance(cancelled[-1], Failed) or cancelled == []
    done = events[-1]
    assert isinstance(done, Finished), done
    assert done.cached_tokens >= 6 * CHUNK
    request = GenerationRequest(tuple(prompt), 12, block=BlockPolicy(4))
    cold = list(generate(models.pair, request, prefill_step_size=CHUNK))
    text = "".join(e.text for e in events if isinstance(e, TextChunk))
    assert text == "".join(r.text for r in cold)
    assert cache.stats()["entries"] >= 1 and cache.nbytes <= cache.budget


def test_prefill_chunks_end_where_a_cold_run_ends_them() -> None:
    """Chunks end at absolute multiples of the step, at the checkpoints and just before the last
    token, so a prefill resumed at a kept position computes exactly a cold run's other chunks."""
    cold = prefill_chunks(0, 10, 4, {6})
    assert cold == [(0, 4), (4, 6), (6, 8), (8, 9), (9, 10)]
    assert prefill_chunks(6, 10, 4, {6}) == cold[2:]
    assert prefill_chunks(0, 1, 4, set()) == [(0, 1)]


# -- costs that know the context, and that stay true ------------------------------------------


def test_costs_grow_with_the_context(tiny_hybrid: Any) -> None:
    """The load-time measure gives each width's growth per context token; a long context
    makes wide cycles dearer, so the controller narrows them there."""
    from dflash_server.adaptive.controller import BlockController
    from dflash_server.generation.calibrate import measure_costs
    from dflash_server.testing import random_drafter

    model, _ = tiny_hybrid
    measured = measure_costs(model, random_drafter(model), long_context=512, calibrate=False)
    assert set(measured.slope) >= {1, 2, 16} and measured.draft_slope >= 0
    assert list(measured.slope.values()) == sorted(measured.slope.values())  # never shrinking
    assert measured.cycle(16, context=50_000) >= measured.cycle(16)

    # Synthetic: a verify of 16 costs 1.8 plain steps at the short context, and each context
    # token adds 2e-6 plain steps per verified position: at 50k tokens 16 wide is 2x dearer.
    from test_adaptive import costs

    steep = costs()
    steep.slope = {w: 2e-6 * w for w in (1, 2, 4, 8, 16)}
    near = BlockController(16, steep.copy())
    near.acceptance.rate, near.acceptance.tried = 0.85, [0.0] * 15
    far = BlockController(16, steep.copy())
    far.acceptance.rate, far.acceptance.tried = 0.85, [0.0] * 15
    wide = near.choose(100, None, context=64).size
    assert wide >= 8 and 1 <= far.choose(100, None, context=50_000).size < wide


def test_growth_is_fitted_as_a_line_in_the_width() -> None:
    """A verify reads the context once per position, so growth is a line in the width: a line
    is kept as measured, and one noisy width (here 2, at 8x its neighbours') moves little."""
    from dflash_server.generation.calibrate import _linear_in_width

    line = {w: 1e-6 + 5e-7 * w for w in (1, 2, 4, 8, 16)}
    assert _linear_in_width(line) == pytest.approx(line)
    noisy = _linear_in_width({**line, 2: 8 * line[2]})
    assert noisy[2] < 4 * line[2] and noisy[16] < 1.5 * line[16]  # not 8x, nor 8x at 16
    assert list(noisy.values()) == sorted(noisy.values())  # never shrinking
    assert _linear_in_width({1: -1e-6, 2: -2e-6}) == {1: 0.0, 2: 0.0}  # noise below zero


def test_a_windowed_drafter_stops_growing_at_its_window(tiny_hybrid: Any) -> None:
    """Past its window a drafter reads no more context: its share of a cycle (and of a batched
    pass) stops growing there, while the target's attention keeps growing."""
    from dflash_server.adaptive.costs import CostModel
    from dflash_server.adaptive.pass_costs import PassCosts
    from dflash_server.generation.calibrate import _reach as context_reach
    from dflash_server.testing import random_drafter

    model, _ = tiny_hybrid
    draft = random_drafter(model)
    assert context_reach(draft) is None  # full attention over all of it
    draft.set_window(256)
    assert context_reach(draft) == 256
    costs = CostModel(
        0.01, {2: 0.02, 16: 0.03}, {2: 0.01, 16: 0.02}, draft_slope=1e-6, draft_reach=256
    )
    assert costs.base(16, context=128) < costs.base(16, context=512) == costs.base(16, context=9999)
    costs.slope = {1: 1e-7, 16: 1e-6}
    assert costs.base(16, context=9999) > costs.base(16, context=512)
    passes = PassCosts({1: 0.01}, {16: 0.03}, slope={1: 0.0, 16: 0.0}, draft_slope=1e-6,
                       draft_reach=256)  # fmt: skip
    assert passes.base(1, 16, [512]) == passes.base(1, 16, [9999]) > passes.base(1, 16, [64])
    assert passes.base(1, 1, [9999]) == passes.base(1, 1, [64])  # a plain pass drafts nothing


def test_the_pairs_costs_learn_from_every_request() -> None:
    """A request's cycles also refine the pair's model, which the next request starts from."""
    from test_adaptive import costs

    pair = costs(refine=True)
    first = pair.copy()
    for _ in range(40):  # cycles of 16 take three times what the load-time measure said
        first.observe(16, 3 * first.base(16))
    assert first.cycle(16) > 2.5 * pair.base(16)
    assert pair.cycle(16) > 1.5 * pair.base(16)  # the pair's model moved too, more slowly
    assert pair.copy().cycle(16) == pytest.approx(pair.cycle(16))


def test_a_long_context_is_timed_without_prefilling_it(tiny_hybrid: Any) -> None:
    """The calibration's long context copies a short prompt's keys, values and drafter
    features (a pass reading copies costs what one reading a real prompt does); caches it
    cannot lengthen so are prefilled instead."""
    from mlx_lm.models.cache import RotatingKVCache

    from dflash_server.generation.calibrate import _fill, _Pieces
    from dflash_server.generation.target import TargetModel
    from dflash_server.testing import random_drafter

    model, _ = tiny_hybrid
    draft = random_drafter(model)
    target = TargetModel(model, draft.config.target_layer_ids)
    filled = _Pieces(target, draft, 700, 16, 2, None, prefill=64)
    real = _Pieces(target, draft, 700, 16, 2, None)
    assert [c.offset for c in filled.cache if c.is_trimmable()] == [700] * sum(
        c.is_trimmable() for c in real.cache
    )
    assert [c.size for c in filled.draft_cache] == [c.size for c in real.draft_cache]
    assert filled.verify(16)() > 0 and filled.drafting(16)() > 0
    assert not _fill([RotatingKVCache(max_size=32)], 700)


def _inflated(measured: Any, factor: float) -> Any:
    """Drafted cycles as a busy moment would have measured them: ``factor`` x dearer."""
    import math

    busy = measured.copy()
    busy.shared = None
    for width in [w for w in busy.verify if w > 1]:
        busy.residual[width] = busy.residual.get(width, 0.0) + math.log(factor)
    return busy


MS = 1e-3


def _true_costs() -> tuple[Any, Any]:
    """What cycles (one row) and batched passes cost on a made-up machine: a plain pass 1 ms
    plus 0.1 ms per row, a drafted one 2 ms (drafter pass included) plus 0.1 ms per verified
    position."""
    from dflash_server.adaptive.costs import CostModel
    from dflash_server.adaptive.pass_costs import PassCosts

    verify = {w: (1.5 + 0.1 * w) * MS for w in (2, 4, 8, 16)}
    cycles = CostModel(plain=1.1 * MS, verify=verify, draft={2: 0.5 * MS, 16: 0.5 * MS})
    plain = {r: (1 + 0.1 * r) * MS for r in (1, 2, 4, 8, 16)}
    passes = PassCosts(plain, {p: (2 + 0.1 * p) * MS for p in (4, 8, 16, 32, 64, 128)})
    return cycles, passes


class PassClock:
    """The time the engine reads, as that machine would take it: each target forward moves it
    by its pass's cost (``delays``: more for the next drafted passes, a busy moment). Real
    timings made these tests depend on the runner: on a loaded one a 4 x 8 pass measured 90
    plain passes' time, and going plain was then right. bench_long.py's busy part measures
    the recovery on real timings."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, target: Any, true: Any) -> None:
        from types import SimpleNamespace

        from dflash_server.generation import batch, row

        self.now = 0.0
        self.delays: list[float] = []
        forward = target.forward

        def timed(tokens: mx.array, *args: Any, **kwargs: Any) -> Any:
            rows, width = tokens.shape
            self.now += true.cost(rows, width)
            if width > 1 and self.delays:
                self.now += self.delays.pop(0)
            return forward(tokens, *args, **kwargs)

        monkeypatch.setattr(target, "forward", timed)
        clock = SimpleNamespace(perf_counter=lambda: self.now)
        for module in (batch, row):
            monkeypatch.setattr(module, "time", clock)


@pytest.mark.slow
def test_a_busy_calibration_recovers_alone(
    tiny_hybrid: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drafted cycles measured 5x dearer than they are: the request starts plain, its probes
    come in far cheaper than estimated, so it probes again soon and soon speculates."""
    from dflash_server.adaptive.controller import BlockController
    from dflash_server.testing import ReplayDrafter, random_drafter
    from test_batching import make_decoder, plain_greedy, tokens_of

    model, tokenizer = tiny_hybrid
    inner = random_drafter(model, block_size=8)
    prompt = list(tokenizer.encode("def fibonacci(n):"))
    reference = plain_greedy(model, prompt, 600)
    cycles, passes = _true_costs()
    policy = BlockController(8, _inflated(cycles, 5.0))
    run = make_decoder(model, ReplayDrafter(prompt + reference, [7], inner), 8, policy=policy)
    PassClock(monkeypatch, run.row.target, passes)
    commits = list(run.generate(prompt, 600))
    assert tokens_of(commits) == reference
    assert commits[1].drafted == 0  # plain at first: the calibration said so
    drafted = [c.drafted for c in commits[-40:]]
    assert sum(drafted) > 100, drafted  # the last 40 commits are mostly full drafter blocks


@pytest.mark.slow
@pytest.mark.parametrize("rows_busy", [False, True])
def test_a_busy_calibration_recovers_in_a_batch(
    tiny_hybrid: Any, monkeypatch: pytest.MonkeyPatch, rows_busy: bool
) -> None:
    """Batched passes measured 20x dearer than they are: the budget lets the first drafted
    pass through to check the calibration, finds it far cheaper and lifts the cap, even when
    that first pass is slow; every row still equals its lone run. ``rows_busy``: the rows' own
    cycle costs were measured 20x dearer too (they probe early while no real cycle has checked
    them)."""
    import math

    from dflash_server.adaptive.controller import BlockController
    from dflash_server.generation.batch import BatchDecoder
    from dflash_server.generation.target import TargetModel
    from dflash_server.testing import ReplayDrafter, random_drafter
    from test_batching import make_decoder, plain_greedy, step_rows, tokens_of

    model, tokenizer = tiny_hybrid
    inner = random_drafter(model, block_size=8)
    target = TargetModel(model, inner.config.target_layer_ids)
    cycles, passes = _true_costs()
    busy = replace(passes, spec_residual={8 * r: math.log(20.0) for r in (1, 2, 4, 8)})
    batch = BatchDecoder(target, costs=busy)
    prompts = [list(tokenizer.encode(p)) for p in ("def fib(n):", "The quick", "import os", "x =")]
    rows = {}
    for i, prompt in enumerate(prompts):
        reference = plain_greedy(model, prompt, 300)
        draft = ReplayDrafter(prompt + reference, [7], inner)
        policy = BlockController(8, (_inflated(cycles, 20.0) if rows_busy else cycles).copy())
        rows[i] = (make_decoder(model, draft, 8, policy=policy).row, prompt, 300)
    widths: list[int] = []
    step = batch.step

    def recorded() -> Any:
        passes = batch.passes
        out = step()
        if batch.passes > passes:
            widths.append(batch.last_pass[1] // batch.last_pass[0])
        return out

    batch.step = recorded  # type: ignore[method-assign]
    # The first drafted pass is slow (a first pass allocating its buffers, a busy moment): in
    # 2 of 3 clean-clone CI runs one such pass sent every row to plain decoding for good.
    PassClock(monkeypatch, target, passes).delays.append(0.5)
    out = step_rows(batch, rows)
    for i, prompt in enumerate(prompts):
        assert tokens_of(out[i]) == plain_greedy(model, prompt, 300), i
    first = next(i for i, w in enumerate(widths) if w > 1)
    assert first <= 20, str(widths)  # an early pass checked the calibration (the rows' too)
    # Then speculation resumes and holds (but for the pass with the rows' last tokens). The
    # busy rows' own first probe met the slow pass, so their next one waits out a longer gap.
    resumed = next(i for i in range(len(widths)) if all(w > 1 for w in widths[i:-1]))
    assert resumed <= (80 if rows_busy else 10), str(widths)


@pytest.mark.parametrize("checkpoints", [(), (150, 260)])
def test_a_windowed_drafter_skips_what_it_never_reads(
    tiny_hybrid: Any, monkeypatch: pytest.MonkeyPatch, checkpoints: tuple[int, ...]
) -> None:
    """A 400-token prompt, a drafter window of 32 (4 sinks): only the positions it reads are
    projected (sinks, the window before the end and before each checkpoint), and its context
    (and a snapshot's windows) equal a prefill that projected every position."""
    from dflash_server.adaptive.policy import FixedBlock
    from dflash_server.generation import prefill as prefill_module
    from dflash_server.generation.row import Row
    from dflash_server.generation.sampling import SamplingParams, TokenSampler
    from dflash_server.generation.target import TargetModel
    from dflash_server.testing import random_drafter

    model, _ = tiny_hybrid
    draft = random_drafter(model, block_size=4)
    draft.set_window(32)
    prompt = [(11 * i) % 300 + 5 for i in range(400)]
    projected: list[int] = []
    append = draft.append_context

    def counted(taps: Any, cache: Any, tokens: Any = None) -> None:
        projected.append(taps.shape[1])
        append(taps, cache, tokens)

    def prefill(skip: bool) -> Row:
        if not skip:
            monkeypatch.setattr(prefill_module, "prompt_reads", lambda *a: None)
        target = TargetModel(model, draft.config.target_layer_ids)
        row = Row(target, draft, TokenSampler(SamplingParams()), FixedBlock(4),
                  prefill_step_size=64, prefix=PrefixCache(1 << 30), checkpoints=checkpoints)  # fmt: skip
        row.begin(prompt, 4)
        prefill_module.prefill(row)
        monkeypatch.undo()
        return row

    monkeypatch.setattr(draft, "append_context", counted)
    skipping = prefill(skip=True)
    assert sum(projected) <= 4 + 28 * (1 + len(checkpoints)) + 64  # reads, plus chunk edges
    projected.clear()
    monkeypatch.setattr(draft, "append_context", counted)
    full = prefill(skip=False)
    assert sum(projected) == 400
    for a, b in zip(skipping.draft_cache, full.draft_cache):
        assert a.offset == b.offset == 400
        (ka, va), (kb, vb) = a.fetch(), b.fetch()
        assert mx.allclose(ka, kb, atol=1e-5).item() and mx.allclose(va, vb, atol=1e-5).item()
    snaps = [next(iter(r.prefix._entries.values())).snapshot for r in (skipping, full)]
    for p in checkpoints:  # the windows a snapshot keeps at each checkpoint match too
        for wa, wb in zip(snaps[0].checkpoints[p].draft, snaps[1].checkpoints[p].draft):
            assert all(mx.allclose(x, y, atol=1e-5).item() for x, y in zip(wa, wb))


@pytest.mark.slow
def test_a_client_that_times_out_and_retries_gets_its_answer(
    tiny_hybrid_path: Path, draft_path: Path
) -> None:
    """The Anthropic SDK with a timeout shorter than a long prompt's prefill: each attempt is
    cancelled part-way, keeps its chunks, and a retry resumes there until one completes."""

    import anthropic
    import httpx

    from server_fixtures import make_app, run_server

    app = make_app(tiny_hybrid_path, draft_path, served_model_name="tiny", prefill_step_size=32)

    def words(tag: str) -> str:
        return " ".join(f"{tag}{i % 97}" for i in range(3000))

    with run_server(app) as srv:
        # How long a cold prefill of such a prompt takes here (other prompts: nothing cached;
        # the faster of two, so a slow first one, kernels compiling, does not set the timeout).
        times = []
        for tag in ("u", "v"):
            body = {"model": "tiny", "max_tokens": 1,
                    "messages": [{"role": "user", "content": words(tag)}]}  # fmt: skip
            begin = time.monotonic()
            httpx.post(f"{srv.base_url}/v1/messages", json=body, timeout=300).raise_for_status()
            times.append(time.monotonic() - begin)
        cold = min(times)
        client = anthropic.Anthropic(
            base_url=srv.base_url, api_key="x", timeout=max(0.5, cold / 3), max_retries=20
        )
        reply = client.messages.create(
            model="tiny", max_tokens=4, messages=[{"role": "user", "content": words("w")}]
        )
    assert reply.stop_reason in ("max_tokens", "end_turn")
    assert reply.usage.cache_read_input_tokens > 0  # resumed from an earlier attempt
