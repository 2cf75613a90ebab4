"""Suffix drafts vs DFlash alone vs plain decoding, on workloads that copy and one that does not.

Small random targets never copy, so the setup step trains a tiny attention target (the offline
test builders' tokenizer and architecture, a short MLX training loop, cached under ``--cache``)
on synthetic code-like text mixed with repeat-and-edit tasks ("<block> # now repeat it with X
renamed to Y" or "with 12 changed to 40", followed by the edited copy), and reports how much of
the expected copy its greedy output reproduces. Then, per workload, tokens per target pass and
decode tok/s for: plain decoding, DFlash alone (a random drafter: no trained drafter fits this
target; ``auto`` block size), suffix drafts alone (no drafter), and both; on the greedy
workloads also DFlash alone (auto, and a fixed block of 16) and both with the replaying test
double standing in for a good drafter (``REPLAY_PATTERN``); "vs_dflash" compares with DFlash
alone at its best. Every run starts from an empty index of recent outputs (a trace
shares one across its requests), so nothing is copied from another mode's identical answer.
Rounds are interleaved and medians reported; greedy outputs of every mode must equal plain
decoding's.

* copy: the held-out repeat-and-edit prompts (greedy): the answer is mostly in the prompt;
* trace: each copy prompt, then the same prompt after a retry note (an agent asking again):
  the second answer repeats the first, which only the index of recent outputs holds;
* fresh: a new function header, sampled at temperature 1, with no earlier outputs to copy (its
  own output may still repeat itself: it is code);
* noise: the same at temperature 2 (near-random text: nothing to copy).

    /work/bin/wt-py benchmarks/bench_suffix.py --json /tmp/bench_suffix.json
"""

from __future__ import annotations

import argparse
import difflib
import json
import random
import re
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

from common import write_json
from dflash_server import load
from dflash_server.drafters.suffix import SharedSuffixIndex, SuffixProposer
from dflash_server.generation.pair import SUFFIX_INDEX_BYTES, ModelPair
from dflash_server.generation.request import BlockPolicy, GenerationRequest
from dflash_server.generation.sampling import SamplingParams
from dflash_server.generation.stream import generate
from dflash_server.testing import ReplayDrafter, build_target, random_drafter

NAMES = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "count",
    "total",
    "value",
    "index",
    "item",
    "result",
    "data",
    "size",
    "left",
    "right",
    "node",
    "key",
    "name",
    "path",
    "line",
    "text",
    "user",
    "items",
    "start",
    "end",
    "step",
    "limit",
    "buffer",
    "offset",
    "width",
    "height",
]
LINES = (
    "    {v} = {a} + {b}\n",
    "    {v} = {a} * {n}\n",
    "    if {a} > {b}:\n        {v} = {a} - {b}\n",
    "    for {v} in range({a}):\n        {b} += {v}\n",
    "    {a}.append({b})\n",
    "    print({a}, {b})\n",
    "    {v} = {f}({a}, {n})\n",
    "    while {a} < {n}:\n        {a} += {b}\n",
)


def block(rng: random.Random) -> tuple[str, list[str]]:
    """A small random function and the identifiers it uses."""
    f, a, b, v = rng.sample(NAMES, 4)
    body = "".join(
        rng.choice(LINES).format(a=a, b=b, v=v, f=f, n=rng.randint(1, 99))
        for _ in range(rng.randint(3, 5))
    )
    return f"def {f}({a}, {b}):\n{body}    return {v}\n", [f, a, b, v]


def repeat_task(rng: random.Random) -> tuple[str, str]:
    """(prompt, expected answer): a block, then the instruction to repeat it with a small
    change: one identifier renamed, or one number changed."""
    code, used = block(rng)
    numbers = re.findall(r"\b\d+\b", code)
    if numbers and rng.random() < 0.5:
        old = rng.choice(numbers)
        new = str(rng.choice([n for n in range(1, 100) if str(n) != old]))
        answer = re.sub(rf"\b{old}\b", new, code, count=1)
        return f"{code}# now repeat it with {old} changed to {new}\n", answer
    old = rng.choice(used)
    new = rng.choice([n for n in NAMES if n not in used])
    answer = re.sub(rf"\b{old}\b", new, code)
    return f"{code}# now repeat it with {old} renamed to {new}\n", answer


def corpus_text(rng: random.Random) -> str:
    """Training text: edited repeats, exact repeats (the easiest copies, which teach the
    model to look back), and fresh code."""
    kind = rng.random()
    if kind < 0.6:
        prompt, answer = repeat_task(rng)
        return prompt + answer + "\n"
    if kind < 0.85:
        code = block(rng)[0]
        return f"{code}# now repeat it\n{code}\n"
    return block(rng)[0] + "\n"


# -- setup: train a target that copies ----------------------------------------------------------


def train_target(cache: Path, steps: int, hidden: int, layers: int, seq: int, batch: int) -> Path:
    """Build and train the tiny target once; later runs reuse ``cache``."""
    done = cache / "trained.json"
    spec = {"steps": steps, "hidden": hidden, "layers": layers, "seq": seq, "batch": batch}
    spec["data"] = 3  # the version of corpus_text
    if done.exists() and json.loads(done.read_text()).get("spec") == spec:
        return cache
    from mlx_lm.utils import save_model

    build_target(cache, arch="qwen3", hidden_size=hidden, num_hidden_layers=layers, seed=1)
    model, tokenizer = load(str(cache))
    rng = random.Random(0)
    stream: list[int] = []

    def batch_tokens() -> mx.array:
        rows = []
        for _ in range(batch):
            while len(stream) < seq + 1:
                stream.extend(tokenizer.encode(corpus_text(rng)))
            rows.append(stream[: seq + 1])
            del stream[: seq + 1]
        return mx.array(rows)

    def loss_fn(model: nn.Module, x: mx.array) -> mx.array:
        logits = model(x[:, :-1])
        return nn.losses.cross_entropy(logits, x[:, 1:]).mean()

    schedule = optim.join_schedules(
        [optim.linear_schedule(1e-4, 3e-3, 50), optim.cosine_decay(3e-3, steps, 3e-4)], [50]
    )
    opt = optim.AdamW(learning_rate=schedule, weight_decay=0.01)
    step_fn = nn.value_and_grad(model, loss_fn)
    start, losses = time.perf_counter(), []
    for step in range(steps):
        loss, grads = step_fn(model, batch_tokens())
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        losses.append(loss.item())
        if step % 100 == 0 or step == steps - 1:
            print(f"  step {step}: loss {statistics.mean(losses[-50:]):.3f}", flush=True)
    save_model(cache, model)
    seconds = round(time.perf_counter() - start, 1)
    done.write_text(json.dumps({"spec": spec, "train_s": seconds, "loss": losses[-1]}))
    return cache


# -- measuring ----------------------------------------------------------------------------------


def run(pair: ModelPair, prompt: list[int], n: int, block: BlockPolicy, params: SamplingParams):
    request = GenerationRequest(tuple(prompt), n, sampling=params, block=block)
    start, tokens, stats, first = time.perf_counter(), [], None, None
    for i, r in enumerate(generate(pair, request)):
        tokens += r.tokens
        stats = r.stats
        if i == 0:
            first = time.perf_counter()
    assert stats is not None and first is not None
    seconds = time.perf_counter() - first
    return tokens, {
        "tokens_per_pass": (len(tokens) - 1) / max(stats.cycles, 1),
        "tok_s": (len(tokens) - 1) / seconds,
        "sources": {s: dict(c) for s, c in stats.sources.items()},
        "wall_s": seconds + (first - start),
    }


def copy_rate(model: Any, tokenizer: Any, tasks: list[tuple[str, str]]) -> dict[str, float]:
    """How well greedy output reproduces the expected edited copies: the share of answers
    reproduced exactly, of answer tokens before the first divergence, and of answer tokens
    matched in order (difflib's matching blocks)."""
    pair = ModelPair.of(model, tokenizer, None)
    exact = prefix = matched = want = 0
    for prompt, answer in tasks:
        expected = tokenizer.encode(answer)
        out, _ = run(pair, tokenizer.encode(prompt), len(expected), BlockPolicy(1), GREEDY)
        same = next((i for i, (a, b) in enumerate(zip(out, expected)) if a != b), len(expected))
        blocks = difflib.SequenceMatcher(None, out, expected, autojunk=False).get_matching_blocks()
        exact += out == expected
        prefix += same
        matched += sum(b.size for b in blocks)
        want += len(expected)
    return {
        "exact_answers": round(exact / len(tasks), 3),
        "prefix_tokens": round(prefix / want, 3),
        "matched_tokens": round(matched / want, 3),
    }


GREEDY = SamplingParams()
REPLAY_PATTERN = [3, 1, 6, 0, 2, 4]  # accepted drafts per cycle, cycled (mean 2.7)
RETRY = "# the last attempt failed: try again\n"


def proposer_cost(tokenizer: Any, context: int = 8000, cycles: int = 2000) -> dict[str, float]:
    """Host cost of suffix drafting: indexing a prompt, and one cycle (extend + propose) on a
    ``context``-token copy-heavy context (the corpus' own mix)."""
    rng = random.Random(7)
    tokens: list[int] = []
    while len(tokens) < context + cycles:
        tokens += tokenizer.encode(corpus_text(rng))
    start = time.perf_counter()
    proposer = SuffixProposer(tokens[:context])
    index_s = time.perf_counter() - start
    start, found = time.perf_counter(), 0
    for token in tokens[context : context + cycles]:
        proposer.extend([token])
        found += proposer.propose() is not None
    cycle_s = (time.perf_counter() - start) / cycles
    return {
        "index_us_per_prompt_token": round(1e6 * index_s / context, 2),
        "cycle_us": round(1e6 * cycle_s, 1),
        "cycles_with_a_proposal": round(found / cycles, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", default="/tmp/dflash_bench_suffix")
    ap.add_argument("--steps", type=int, default=900)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=192)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--json")
    args = ap.parse_args()

    t0 = time.perf_counter()
    path = train_target(
        Path(args.cache), args.steps, args.hidden, args.layers, args.seq, args.batch
    )
    setup = json.loads((path / "trained.json").read_text())
    model, tokenizer = load(str(path))
    rng = random.Random(12345)  # held out: training used seed 0
    tasks = [repeat_task(rng) for _ in range(args.prompts)]
    rate = copy_rate(model, tokenizer, tasks)
    print(f"setup {time.perf_counter() - t0:.1f} s (training {setup['train_s']} s); "
          f"greedy copies of held-out tasks: {rate}", flush=True)  # fmt: skip

    draft = random_drafter(model, block_size=16)
    pairs = {"plain": ModelPair.of(model, tokenizer, None)}
    pairs["dflash"] = pairs["both"] = ModelPair.of(model, tokenizer, draft)
    pairs["suffix"] = pairs["plain"]
    blocks = {
        "plain": BlockPolicy(1),
        "dflash": BlockPolicy(16, auto=True),
        "suffix": BlockPolicy(1, suffix=args.suffix),
        "both": BlockPolicy(16, auto=True, suffix=args.suffix),
        "dflash-replay": BlockPolicy(16, auto=True),
        # Fixed 16: the replaying drafter's blocks even where "auto" finds plain steps cheaper.
        "dflash16-replay": BlockPolicy(16),
        "both-replay": BlockPolicy(16, auto=True, suffix=args.suffix),
    }
    for p in set(map(id, pairs.values())):
        pair = next(q for q in pairs.values() if id(q) == p)
        print(pair.costs.get(args.suffix + 1).describe(), flush=True)
    fresh_rng = random.Random(999)
    fresh = [[tokenizer.encode(f"def {a}({b}, {c}):\n")] for a, b, c in
             (fresh_rng.sample(NAMES, 3) for _ in range(args.prompts))]  # fmt: skip
    copy = [tokenizer.encode(p) for p, _ in tasks]
    # A trace is requests run in order sharing one fresh index of recent outputs: the same
    # task asked again after a note (an agent retrying), whose answer is the first one's.
    workloads = {
        "copy": ([[ids] for ids in copy], GREEDY),
        "trace": ([[ids, tokenizer.encode(RETRY) + ids] for ids in copy], GREEDY),
        "fresh": (fresh, SamplingParams(temperature=1.0)),
        "noise": (fresh, SamplingParams(temperature=2.0)),
    }
    cost = proposer_cost(tokenizer)
    print("suffix drafting host cost:", cost, flush=True)
    report: dict[str, Any] = {
        "setup": setup,
        "copy_rate": rate,
        "proposer": cost,
        "workloads": {},
    }
    for name, (traces, params) in workloads.items():
        results: dict[str, list[dict]] = {m: [] for m in blocks}
        for _ in range(args.rounds):
            for trace in traces:
                references: list[list[int] | None] = [None] * len(trace)
                for mode, block in blocks.items():
                    if mode.endswith("replay") and not params.greedy:
                        continue  # the replay replays greedy output: greedy only
                    index = SharedSuffixIndex(SUFFIX_INDEX_BYTES)  # nothing from other runs
                    for i, prompt in enumerate(trace):
                        pair = pairs.get(mode, pairs["dflash"])
                        if mode.endswith("replay"):
                            # A drafter right for a fixed share of each block: the replay
                            # double with a fixed accept pattern.
                            reference = references[i]
                            assert reference is not None
                            replay = ReplayDrafter(prompt + reference, REPLAY_PATTERN, draft)
                            measured = pairs["dflash"].costs.get(args.suffix + 1)
                            pair = ModelPair.of(model, tokenizer, replay, measured=measured)
                        pair = replace(pair, suffix_index=index)
                        out, res = run(pair, prompt, args.tokens, block, params)
                        if params.greedy:
                            references[i] = references[i] or out
                            assert out == references[i], f"{mode} changed the greedy output"
                        results[mode].append(res)
        summary: dict[str, dict[str, Any]] = {}
        for mode, rows in results.items():
            if not rows:
                continue
            tokens = sum(r["sources"][s]["tokens"] for r in rows for s in r["sources"])
            summary[mode] = {
                "tokens_per_pass": round(statistics.median(r["tokens_per_pass"] for r in rows), 3),
                "tok_s": round(statistics.median(r["tok_s"] for r in rows), 1),
                "suffix_token_share": round(
                    sum(r["sources"]["suffix"]["tokens"] for r in rows) / max(tokens, 1), 3
                ),
            }
        for mode, bases in (
            ("suffix", ["dflash"]),
            ("both", ["dflash"]),
            ("both-replay", ["dflash-replay", "dflash16-replay"]),
        ):
            if mode in summary:  # against DFlash alone at its best (auto or fixed 16)
                best = max(summary[b]["tok_s"] for b in bases)
                summary[mode]["vs_dflash"] = round(summary[mode]["tok_s"] / best, 3)
        report["workloads"][name] = summary
        print(name, json.dumps(summary, indent=1), flush=True)
    write_json(Path(args.json) if args.json else None, report)


if __name__ == "__main__":
    main()
