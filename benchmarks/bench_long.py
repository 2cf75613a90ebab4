"""Long prompts: our cold prefill against mlx-lm's, and the "auto" controller at long contexts.

On the ~100M fp32 ``qwen3_5`` benchmark target (``common.bench_target``) with a published-shape
drafter (random weights: its pass costs what a real one's does):

* ``prefill``: time to first token for a ``--lengths`` prompt: mlx-lm's own ``generate_step``
  (plain prefill, its 2048-token chunks) against ours (the same chunks, plus the drafter's taps
  and context) and, with ``--split``, the target alone through our loop. The kinds take turns
  chunk by chunk (``side_by_side``); paired ratios (mlx-lm's time / ours) are reported.
* ``decode``: at each ``--contexts`` length the prompt is prefilled once and every mode decodes
  ``--tokens`` greedy tokens from a copy of that state (so each mode pays the same context, not
  the prefill): plain, each fixed width, and ``auto`` as the server runs it (the pair's measured
  costs, which include the growth per context token), with the replaying test double at
  ``--tau`` (its full blocks commit tau tokens); every mode's tokens equal plain decoding's.
  Reported: decode tokens/s, auto / plain, auto / the best fixed width.
* ``busy``: the batched pass costs and the cycle costs as a busy CPU measures them
  (``--busy-factor`` x dearer for speculative passes and drafted cycles), then 4 streams at
  tau 8 as the engine runs them: when each pass ran, its width, and the time until the batch
  speculates again (real passes correct the costs), against a run with the true costs.

    LD_PRELOAD=/lib/x86_64-linux-gnu/libopenblas.so.0 \\
        python benchmarks/bench_long.py --json /tmp/long.json
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step

from common import bench_target, published_drafter, write_json
from dflash_server import load
from dflash_server.adaptive.controller import BlockController, SharedPrior
from dflash_server.adaptive.policy import FixedBlock
from dflash_server.drafters.window import DEFAULT_WINDOW
from dflash_server.engine.prefix_cache import PrefixCache
from dflash_server.generation.calibrate import measure_costs
from dflash_server.generation.prefill import prefill_steps
from dflash_server.generation.row import Row
from dflash_server.generation.sampling import SamplingParams, TokenSampler
from dflash_server.generation.speculative import SpeculativeDecoder
from dflash_server.generation.target import TargetModel
from dflash_server.testing import ReplayDrafter


def prompt_of(length: int, vocab: int = 30000) -> list[int]:
    """A deterministic prompt of ``length`` ordinary token ids."""
    return [(7 * i * i + 3 * i) % vocab + 100 for i in range(length)]


def prefill(
    model: Any, draft: Any, lengths: list[int], rounds: int, split: bool = True
) -> list[dict]:
    rows = []
    side_by_side(model, draft, prompt_of(64), split)  # first calls pay one-off set-up
    for n in lengths:
        prompt = prompt_of(n)
        runs = [side_by_side(model, draft, prompt, split) for _ in range(rounds)]
        ratio = statistics.median(r["mlx_lm"] / r["ours"] for r in runs)
        row = {
            "tokens": n,
            **{f"{k}_tok_s": round(n / statistics.median(r[k] for r in runs), 1) for k in runs[0]},
            "ours_vs_mlx_lm": round(ratio, 3),
        }
        rows.append(row)
        print(json.dumps({"prefill": row}), flush=True)
    return rows


def side_by_side(model: Any, draft: Any, prompt: list[int], split: bool) -> dict[str, float]:
    """Seconds to the first token, chunk by chunk in turns: mlx-lm's own ``generate_step`` (its
    progress callback marks each chunk) and our rows (with the drafter; ``split``: also the
    target alone), who goes first alternating (m0 o0 o1 m1 m2 o2 ...), so a noisy moment on
    shared cores slows both alike (a chunk's time moves by up to 20 % from run to run)."""
    ours = {"ours": _chunk_steps(model, draft, prompt)}
    if split:
        ours["target"] = _chunk_steps(model, None, prompt)
    seconds = dict.fromkeys(["mlx_lm", *ours], 0.0)
    turns = {"mlx": 0, "ours": 0}  # chunks done by mlx-lm, by each of our rows
    mark = time.perf_counter()

    def our_turn(done: int, total: int) -> None:  # mlx-lm's progress callback
        nonlocal mark
        seconds["mlx_lm"] += time.perf_counter() - mark
        turns["mlx"] += done > 0
        m = turns["mlx"]
        until = m + m % 2 if done < total else None  # None: to the end
        while until is None or turns["ours"] < until:
            kinds = list(ours) if turns["ours"] % 2 == 0 else list(ours)[::-1]
            finished = [_timed(ours[k], seconds, k) for k in kinds]
            turns["ours"] += 1
            if all(finished):
                break
        mark = time.perf_counter()

    next(generate_step(mx.array(prompt), model, max_tokens=1, prompt_progress_callback=our_turn))
    seconds["mlx_lm"] += time.perf_counter() - mark
    return seconds


def _chunk_steps(model: Any, draft: Any, prompt: list[int]) -> Iterator[None]:
    """Our prefill (with the drafter's taps and context; ``draft=None``: the target alone through
    our loop), one chunk per step, the last one through to the first token."""
    ids = tuple(draft.config.target_layer_ids) if draft is not None else ()
    row = Row(TargetModel(model, ids), draft, TokenSampler(SamplingParams()), FixedBlock(1))
    row.begin(prompt, 1)
    steps = prefill_steps(row)
    while True:
        try:
            next(steps)
        except StopIteration as end:
            row.read(end.value)
            return
        yield


def _timed(steps: Iterator[None], seconds: dict[str, float], kind: str) -> bool:
    """Run one step of ``steps``, adding its time to ``seconds[kind]``; True once it is done."""
    start = time.perf_counter()
    done = next(steps, StopIteration) is StopIteration
    seconds[kind] += time.perf_counter() - start
    return done


def decode_once(model: Any, draft: Any, store: PrefixCache, prompt: list[int], drafter: Any,
                policy: Any, tokens: int) -> tuple[list[int], float]:  # fmt: skip
    """Greedy ``tokens`` after ``prompt`` (its prefill restored from ``store`` when there):
    the tokens and the decode tokens/s, timed from the first token."""
    taps = tuple(draft.config.target_layer_ids) if drafter is not None else ()
    sampler = TokenSampler(SamplingParams())
    row = Row(TargetModel(model, taps), drafter, sampler, policy, prefix=store)
    out, start = [], None
    for commit in SpeculativeDecoder(row).generate(prompt, tokens):
        start = start or time.perf_counter()  # after the prefill
        out.extend(commit.tokens)
    return out, (len(out) - 1) / (time.perf_counter() - start)


def decode(model: Any, draft: Any, contexts: list[int], taus: list[int], n: int,
           widths: list[int], rounds: int) -> list[dict]:  # fmt: skip
    costs = measure_costs(model, draft)
    print(costs.describe(), flush=True)
    rows = []
    for length in contexts:
        prompt = prompt_of(length)
        # Each kind of row (plain; with the drafter's taps) prefills the context once; every
        # later run restores it from the prefix cache and feeds only the last prompt token.
        run = functools.partial(decode_once, model, draft, PrefixCache(1 << 40), prompt)
        reference, _ = run(None, FixedBlock(1), n + 16)  # plain greedy: every mode's output
        for tau in taus:
            replay = ReplayDrafter(prompt + reference, [tau - 1], draft)
            run(replay, FixedBlock(2), 2)  # the drafter's kind of row prefills the context
            # "auto" as the server runs it: the pair's costs and acceptance prior, shared by its
            # requests; the first request (a prior from nothing) is reported on its own.
            prior = SharedPrior()
            first = run(replay, BlockController(16, costs.copy(), prior=prior), n)[1]
            modes: dict[str, Any] = {"plain": None, **{f"fixed {w}": w for w in widths}}
            modes["auto"] = "auto"
            rates: dict[str, list[float]] = {m: [] for m in modes}
            for _ in range(rounds):
                for mode, width in modes.items():
                    if width is None:
                        tokens, rate = run(None, FixedBlock(1), n)
                    elif width == "auto":
                        policy = BlockController(16, costs.copy(), prior=prior)
                        tokens, rate = run(replay, policy, n)
                    else:
                        tokens, rate = run(replay, FixedBlock(width), n)
                    rates[mode].append(rate)
                    assert tokens == reference[:n], f"{mode} at {length}: output differs"
            med = {m: statistics.median(v) for m, v in rates.items()}
            best = max((m for m in modes if m.startswith("fixed")), key=lambda m: med[m])
            row_out = {
                "context": length,
                "tau": tau,
                "tok_s": {m: round(v, 2) for m, v in med.items()},
                "first_auto_vs_plain": round(first / med["plain"], 3),
                "auto_vs_plain": round(statistics.median(
                    a / p for a, p in zip(rates["auto"], rates["plain"])), 3),
                "best_fixed": best,
                "auto_vs_best": round(statistics.median(
                    a / b for a, b in zip(rates["auto"], rates[best])), 3),
            }  # fmt: skip
            rows.append(row_out)
            print(json.dumps({"decode": row_out}), flush=True)
    return rows


def busy(model: Any, draft: Any, factor: float, n: int) -> dict:
    """Time from the first pass until the batch speculates, with costs a busy CPU measured."""
    import math

    from dflash_server.generation.batch import BatchDecoder
    from dflash_server.generation.calibrate_passes import measure_pass_costs

    target = TargetModel(model, draft.config.target_layer_ids)
    costs = measure_costs(model, draft)
    passes = measure_pass_costs(target, draft, growth=costs)
    out = {}
    for label, inflate in (("true costs", 1.0), (f"{factor:g}x dearer", factor)):
        cycle, pass_costs = costs.copy(), copy.deepcopy(passes)
        cycle.shared = None
        for width in [w for w in cycle.verify if w > 1]:
            cycle.residual[width] = cycle.residual.get(width, 0.0) + math.log(inflate)
        pass_costs.spec_drift = math.log(inflate)
        batch = BatchDecoder(target, costs=pass_costs)
        rows = []
        for i in range(4):
            prompt = prompt_of(64 + i)
            reference = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n + 16)]
            replay = ReplayDrafter(prompt + reference, [7], draft)
            row = Row(
                target, replay, TokenSampler(SamplingParams()), BlockController(16, cycle.copy())
            )
            batch.add(row, prompt, n)
            rows.append(row)
        start, timeline = time.perf_counter(), []
        while batch.busy:
            before = batch.passes
            batch.step()
            if batch.passes > before:
                rows_, verified = batch.last_pass
                timeline.append((time.perf_counter() - start, verified // rows_))
        wall = time.perf_counter() - start
        wide = [t for t, w in timeline if w > 1]
        # Recovered: from the first pass after which most passes are speculative.
        settled = next((t for i, (t, _) in enumerate(timeline)
                        if sum(w > 1 for _, w in timeline[i:]) > 0.8 * len(timeline[i:])),
                       None)  # fmt: skip
        out[label] = {
            "passes": len(timeline),
            "speculative_passes": len(wide),
            "seconds_to_settle": None if settled is None else round(settled, 2),
            "tok_s": round(4 * n / wall, 1),
        }
        print(json.dumps({"busy": label, **out[label]}), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", help="mlx-lm model (default: build a random ~100M qwen3_5)")
    ap.add_argument("--lengths", type=int, nargs="*", default=[2048, 8192, 32768])
    ap.add_argument("--contexts", type=int, nargs="*", default=[16384, 32768])
    ap.add_argument("--tau", type=int, nargs="*", default=[1, 4, 8])
    ap.add_argument("--widths", type=int, nargs="*", default=[2, 4, 8, 16])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--split",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the target alone through our loop (--no-split: faster)",
    )
    ap.add_argument("--busy-factor", type=float, default=20.0, help="0: skip the busy part")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    tmp = tempfile.TemporaryDirectory()
    path = args.target or bench_target(Path(tmp.name) / "t")
    model, _ = load(str(path))
    draft = published_drafter(model, block_size=16)
    draft.set_window(DEFAULT_WINDOW)  # as the server runs it: sinks + the newest positions
    result: dict[str, Any] = {}
    if args.lengths:
        result["prefill"] = prefill(model, draft, args.lengths, args.rounds, args.split)
    if args.contexts:
        result["decode"] = decode(model, draft, args.contexts, args.tau, args.tokens,
                                  args.widths, args.rounds)  # fmt: skip
    if args.busy_factor:
        result["busy"] = busy(model, draft, args.busy_factor, 4 * args.tokens)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
