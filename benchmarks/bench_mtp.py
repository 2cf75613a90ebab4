"""The target's own MTP head vs DFlash vs plain decoding, and MTP + suffix drafts on a copy workload.

On the distilled stdlib pair's recipe (``distill_stdlib.py``, reused by import): a 1.1M qwen3
target trained on Python stdlib text mixed with repeat tasks (``--copy-share``: "<lines>
# now repeat it" then the same lines, so that it copies when asked), a DFlash drafter distilled
for it with ``dflash-serve train``, and an MTP head trained for it with ``dflash-serve train
--mtp`` (one decoder layer over the target's last hidden state and the next token). Then, at 1
and ``--streams`` concurrent streams (rows of the engine's ``BatchDecoder``, as the server runs
them), greedy, per workload:

* held-out: windows from the middle of held-out stdlib files (the model continues them);
  plain, DFlash (``auto``; fixed block 16), MTP (``auto``; fixed at the head's widest cycle);
* copy: held-out lines followed by "# now repeat it": plain, DFlash, MTP, suffix drafts
  alone, DFlash + suffix, MTP + suffix (``auto``; each run starts from an empty index of recent
  outputs, so nothing is copied from another mode's identical answer).

Every mode's tokens must equal plain decoding's. Modes alternate within each repeat (machine
noise hits all alike); medians of the repeats are reported: tau (committed tokens per target
pass, all streams' together) and decode tokens/s (all streams' tokens, from the moment every
stream has its first token). ``--reuse`` keeps WORK's trained target, drafter and head.

    LD_PRELOAD=/lib/x86_64-linux-gnu/libopenblas.so.0 python benchmarks/bench_mtp.py \\
        --work /tmp/mtp --draft-steps 200 --prompts 4 --json /tmp/mtp/result.json
"""

from __future__ import annotations

import argparse
import difflib
import json
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm

from common import write_json
from dflash_server import load_draft
from dflash_server.drafters.mtp import load_mtp
from dflash_server.drafters.suffix import SharedSuffixIndex
from dflash_server.generation.batch import BatchDecoder
from dflash_server.generation.calibrate_passes import measure_pass_costs
from dflash_server.generation.pair import SUFFIX_INDEX_BYTES, ModelPair
from dflash_server.generation.request import BlockPolicy, GenerationRequest
from dflash_server.generation.stream import Generation
from dflash_server.tools.train import train
from distill_stdlib import (
    COPY_MARK,
    add_recipe_args,
    copy_chunk,
    prepare_target,
    prompts_from,
    read,
    stdlib_files,
    train_drafter,
)


def train_mtp(args: argparse.Namespace, target_dir: Path, data_dir: Path, out: Path) -> dict:
    """``dflash-serve train --mtp``: a fresh MTP head for the target, on the drafter's data."""
    argv = ["--target", str(target_dir), "--data", str(data_dir), "--out", str(out), "--mtp"]
    argv += ["--steps", str(args.mtp_steps), "--batch-size", str(args.draft_batch)]
    argv += ["--seq-len", "256", "--lr", str(args.mtp_lr), "--eval-prompts", "4"]
    argv += ["--eval-tokens", "96"]
    return train(argv)


def prepare(args: argparse.Namespace) -> dict:
    """Train WORK's target (with its training data), DFlash drafter and MTP head, each stage
    recorded in WORK/trained.json as it ends; ``--reuse`` keeps the stages recorded there."""
    saved = args.work / "trained.json"
    result: dict = json.loads(saved.read_text()) if args.reuse and saved.exists() else {}
    target_dir, data_dir = args.work / "target", args.work / "data"
    stages = {
        "target": lambda: prepare_target(
            args, stdlib_files(args.holdout_every)[0], target_dir, data_dir, result
        ),
        "drafter": lambda: result.update(
            drafter=train_drafter(args, target_dir, data_dir, args.work / "draft", 0)
        ),
        "mtp": lambda: result.update(mtp=train_mtp(args, target_dir, data_dir, args.work / "mtp")),
    }
    return run_stages(stages, result, saved)


def run_stages(stages: dict[str, Any], result: dict, saved: Path) -> dict:
    """Run each stage not already in ``result``, timing it, and record ``result`` in
    ``saved`` as each ends (``--reuse`` then keeps what is there)."""
    for name, run in stages.items():
        if name not in result:
            start = time.perf_counter()
            run()
            result.setdefault(name, {})["wall_s"] = round(time.perf_counter() - start, 1)
            saved.write_text(json.dumps(result, indent=1))
    return result


# -- measuring ----------------------------------------------------------------------------------


def copy_workload(
    texts: list[str], tokenizer: Any, n: int
) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, expected answers): held-out lines followed by the repeat mark; the answer is
    the same lines."""
    rng, prompts, answers = random.Random(1), [], []
    for text in texts:
        chunk = copy_chunk(text, rng)
        if chunk is not None:
            prompts.append(tokenizer.encode(chunk + COPY_MARK))
            answers.append(tokenizer.encode(chunk))
        if len(prompts) == n:
            break
    return prompts, answers


def copy_rate(outputs: list[list[int]], answers: list[list[int]]) -> dict[str, float]:
    """How much of each expected copy greedy decoding reproduced: exactly, up to the first
    divergence, and matched in order (difflib's matching blocks)."""
    exact = prefix = matched = want = 0
    for out, expected in zip(outputs, answers):
        head = out[: len(expected)]
        same = next((i for i, (a, b) in enumerate(zip(head, expected)) if a != b), len(head))
        blocks = difflib.SequenceMatcher(None, head, expected, autojunk=False).get_matching_blocks()
        exact += head == expected
        prefix += same
        matched += sum(b.size for b in blocks)
        want += len(expected)
    return {
        "exact_answers": round(exact / len(answers), 3),
        "prefix_tokens": round(prefix / want, 3),
        "matched_tokens": round(matched / want, 3),
    }


class Runner:
    """The three pairs (no drafter, DFlash, MTP), each with the engine's batch, costs measured
    up front as the engine measures them at load."""

    def __init__(self, model: Any, tokenizer: Any, drafts: dict[str, Any], suffix: int) -> None:
        self.pairs: dict[str | None, ModelPair] = {}
        self.batches: dict[str | None, BatchDecoder] = {}
        for name, draft in {None: None, **drafts}.items():
            pair = ModelPair.build(model, tokenizer, draft)
            pair.costs.get(suffix + 1)  # cycle costs, up to the widest suffix copy
            pass_costs = None
            if draft is not None:
                pass_costs = measure_pass_costs(pair.target, draft, growth=pair.costs.measured)
            self.pairs[name], self.batches[name] = pair, BatchDecoder(pair.target, None, pass_costs)

    def run(
        self, drafter: str | None, block: BlockPolicy, prompts: list[list[int]], n: int
    ) -> tuple[list[list[int]], dict[str, float]]:
        """All ``prompts`` as concurrent rows; their tokens, and the run's committed tokens,
        target cycles (per row), suffix-copied tokens, decode seconds (``run_paired``'s, one
        mode)."""
        return self.run_paired({"run": (drafter, block)}, prompts, n)["run"]

    def run_paired(
        self,
        modes: dict[str, tuple[str | None, BlockPolicy]],
        prompts: list[list[int]],
        n: int,
        turn: int = 0,
    ) -> dict[str, tuple[list[list[int]], dict[str, float]]]:
        """``run`` under every mode at once (each its own batch): the batches step in turn, the
        first to step rotating from ``turn`` on, each step timed alone, so a slow moment of this
        shared machine falls on every mode alike. A mode's decode seconds are its own steps'
        after the one that gave its last stream its first token."""
        live = {}
        for mode, (drafter, block) in modes.items():
            # The pair seen with an empty index of recent outputs: nothing from other runs.
            pair = replace(self.pairs[drafter], suffix_index=SharedSuffixIndex(SUFFIX_INDEX_BYTES))
            runs = [Generation(pair, GenerationRequest(tuple(p), n, block=block)) for p in prompts]
            batch = self.batches[drafter]
            for g in runs:
                batch.add(g.row, g.prompt, n, g.eos_ids)
            live[mode] = (batch, _Steps(runs))
        assert len({id(b) for b, _ in live.values()}) == len(live), "one batch per mode"
        names = list(live)
        while any(batch.busy for batch, _ in live.values()):
            turn += 1
            for mode in names[turn % len(names) :] + names[: turn % len(names)]:
                batch, steps = live[mode]
                if batch.busy:
                    start = time.perf_counter()
                    out = batch.step()
                    steps.add(time.perf_counter() - start, out)
        return {mode: steps.result() for mode, (_, steps) in live.items()}


class _Steps:
    """One mode's steps in ``Runner.run_paired``: each stream's tokens and, per step, its
    seconds and the tokens it committed."""

    def __init__(self, runs: list[Generation]) -> None:
        self.runs = runs
        self.index = {g.row: i for i, g in enumerate(runs)}
        self.tokens: list[list[int]] = [[] for _ in runs]
        self.first: list[int | None] = [None] * len(runs)  # each stream's first token's step
        self.seconds: list[float] = []
        self.committed: list[int] = []

    def add(self, seconds: float, out: dict[Any, Any]) -> None:
        count = 0
        for row, commit in out.items():
            assert not isinstance(commit, Exception), commit
            if commit.tokens:
                i = self.index[row]
                if self.first[i] is None:
                    self.first[i] = len(self.seconds)
                self.tokens[i].extend(commit.tokens)
                count += len(commit.tokens)
        self.seconds.append(seconds)
        self.committed.append(count)

    def result(self) -> tuple[list[list[int]], dict[str, float]]:
        # Decode phase: the steps after every stream has its first token (a row may end at once).
        begin = max(f for f in self.first if f is not None) + 1
        stats = [g.row.stats for g in self.runs]
        return self.tokens, {
            "tokens": sum(self.committed[begin:]),
            "seconds": sum(self.seconds[begin:]),
            "committed": sum(s.accepted + s.cycles for s in stats),
            "cycles": sum(s.cycles for s in stats),
            "suffix": sum(s.sources["suffix"]["tokens"] for s in stats),
        }


def groups(prompts: list[list[int]], streams: int) -> list[list[int]]:
    """Prompt indices in groups of ``streams`` (cycling), covering every prompt once."""
    count = -(-len(prompts) // streams)
    return [[(g * streams + j) % len(prompts) for j in range(streams)] for g in range(count)]


def measure(args: argparse.Namespace, runner: Runner, work: dict[str, Any], widest: int) -> dict:
    """Every mode of every workload at each stream count, modes alternating within each
    repeat; medians over repeats of tau, decode tok/s and the paired ratio to plain."""
    s = args.suffix
    modes = {
        "held-out": {
            "plain": (None, BlockPolicy(1)),
            "dflash": ("dflash", BlockPolicy(16, auto=True)),
            "dflash16": ("dflash", BlockPolicy(16)),
            "mtp": ("mtp", BlockPolicy(widest, auto=True)),
            f"mtp{widest}": ("mtp", BlockPolicy(widest)),
        },
        "copy": {
            "plain": (None, BlockPolicy(1)),
            "dflash": ("dflash", BlockPolicy(16, auto=True)),
            "mtp": ("mtp", BlockPolicy(widest, auto=True)),
            "suffix": (None, BlockPolicy(1, suffix=s)),
            "dflash+suffix": ("dflash", BlockPolicy(16, auto=True, suffix=s)),
            "mtp+suffix": ("mtp", BlockPolicy(widest, auto=True, suffix=s)),
        },
    }
    for name, table in modes.items():  # warm-up: kernels, allocations
        for drafter, block in table.values():
            runner.run(drafter, block, work[name][0][:1], 16)
    reference: dict[tuple[str, int], list[int]] = {}
    sums: dict[tuple[int, str, str], list[dict[str, float]]] = {}
    for rep in range(args.repeats):
        for streams in args.streams:
            for name, (prompts, n) in work.items():
                names = list(modes[name])
                order = names[rep % len(names) :] + names[: rep % len(names)]
                for mode in order:
                    total = dict.fromkeys(
                        ("tokens", "seconds", "committed", "cycles", "suffix"), 0.0
                    )
                    for group in groups(prompts, streams):
                        drafter, block = modes[name][mode]
                        outs, got = runner.run(drafter, block, [prompts[i] for i in group], n)
                        for i, out in zip(group, outs):
                            ref = reference.setdefault((name, i), out)
                            assert out == ref, f"{mode} changed the greedy output ({name} {i})"
                        for k in total:
                            total[k] += got[k]
                    sums.setdefault((streams, name, mode), []).append(total)
        print(f"repeat {rep + 1}/{args.repeats} done", flush=True)
    rows = []
    for (streams, name, mode), totals in sums.items():
        rates = [t["tokens"] / t["seconds"] for t in totals]
        plain = [t["tokens"] / t["seconds"] for t in sums[(streams, name, "plain")]]
        rows.append(
            {
                "streams": streams,
                "workload": name,
                "mode": mode,
                "tau": round(statistics.median(t["committed"] / t["cycles"] for t in totals), 3),
                "tok_s": round(statistics.median(rates), 1),
                "vs_plain": round(statistics.median(a / b for a, b in zip(rates, plain)), 3),
                "suffix_share": round(
                    statistics.median(t["suffix"] / t["committed"] for t in totals), 3
                ),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    copies = [reference[("copy", i)] for i in range(len(work["copy"][0]))]
    return {"rows": rows, "copy_outputs": copies}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/dflash-mtp"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--reuse", action="store_true", help="keep WORK's trained models")
    add_recipe_args(ap)
    ap.add_argument("--mtp-steps", type=int, default=300)
    ap.add_argument("--mtp-lr", type=float, default=3e-3)
    ap.add_argument("--copy-tokens", type=int, default=64, help="tokens per copy-workload answer")
    ap.add_argument("--suffix", type=int, default=32, help="longest suffix copy verified")
    ap.add_argument("--streams", type=int, nargs="*", default=[1, 4])
    ap.add_argument("--repeats", type=int, default=3)
    # Shorter training than distill_stdlib's defaults: the whole run fits ~25 min of 2 cores.
    ap.set_defaults(target_steps=600, draft_steps=300, regen=32, copy_share=0.25)
    args = ap.parse_args()
    mx.random.seed(0)
    result: dict = {"args": {k: str(v) for k, v in vars(args).items()}, **prepare(args)}

    model, tokenizer = mlx_lm.load(str(args.work / "target"))
    drafts = {"dflash": load_draft(args.work / "draft", target=model)}
    drafts["mtp"] = load_mtp(args.work / "mtp", model)
    widest = drafts["mtp"].config.block_size
    _, held_files = stdlib_files(args.holdout_every)
    held = read(held_files, 10**9)
    copy_prompts, answers = copy_workload(held, tokenizer, args.prompts)
    work = {
        "held-out": (prompts_from(held, tokenizer, args.prompts, args.prompt_len), args.gen_tokens),
        "copy": (copy_prompts, args.copy_tokens),
    }
    runner = Runner(model, tokenizer, drafts, args.suffix)
    result["costs"] = {
        k: p.costs.measured.describe() for k, p in runner.pairs.items() if p.costs.measured
    }
    measured = measure(args, runner, work, widest)
    result["rows"] = measured["rows"]
    result["copy_rate"] = copy_rate(measured["copy_outputs"], answers)
    print("greedy copies of the held-out repeat tasks:", result["copy_rate"], flush=True)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
