"""What a drafter's rows cost a batch that decodes plainly, pass by pass (issue 42's residue).

On the families' trained pair (``bench_families.py --stages fit`` writes WORK), three batches
of the same ``--streams`` long rows run side by side: plain decoding (no drafter), the drafter's
rows held at width 1 (its upkeep alone: taps kept, context appended) and ``auto``. Their steps
alternate one by one, the first to step rotating, so a slow moment of this shared machine falls
on all three alike. Reported per mode: the median and mean seconds of its plain passes,
``auto``'s drafted passes (its probes) apart, and its tokens per second over all its passes
against plain decoding's (``whole_vs_plain``). EOS is ignored: every row runs ``--tokens``
tokens.

    LD_PRELOAD=/lib/x86_64-linux-gnu/libopenblas.so.0 python benchmarks/bench_pass_overhead.py \\
        --work /tmp/families --json /tmp/overhead.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path

import mlx_lm

from bench_families import FAMILIES
from bench_mtp import Runner
from common import write_json
from dflash_server.adaptive.policy import FixedBlock
from dflash_server.drafters.registry import load_drafter
from dflash_server.drafters.suffix import SharedSuffixIndex
from dflash_server.generation.batch import BatchDecoder
from dflash_server.generation.request import BlockPolicy, GenerationRequest
from dflash_server.generation.stream import Generation
from distill_stdlib import prompts_from, read, stdlib_files


def batches(runner: Runner, family: str, prompts: list[list[int]], n: int) -> dict:
    """Mode -> a batch holding one prefilled row per prompt, each wanting ``n`` tokens."""
    width = runner.pairs[family].draft.config.block_size
    modes = {
        "plain": (None, BlockPolicy(1), runner.batches[None]),
        "width 1": (family, BlockPolicy(width), BatchDecoder(runner.batches[family].target)),
        "auto": (family, BlockPolicy(width, auto=True), runner.batches[family]),
    }
    out = {}
    for mode, (name, block, batch) in modes.items():
        pair = replace(runner.pairs[name], suffix_index=SharedSuffixIndex(1 << 20))
        for prompt in prompts:
            run = Generation(pair, GenerationRequest(tuple(prompt), n, block=block))
            if mode == "width 1":  # (a request of width 1 runs no drafter: no upkeep either)
                run.row.policy = FixedBlock(1)
            batch.add(run.row, run.prompt, n, set())  # no EOS: every row runs n tokens
        while batch.prefilling or batch.waiting:  # (a prefilled row joins at its step's end)
            batch.step()
        out[mode] = batch
    return out


def measure(runner: Runner, family: str, prompts, n: int, rounds: int) -> dict:
    """Steps of the three batches alternating; seconds by mode and pass kind, and each mode's
    tokens per second over all its passes against plain decoding's (``whole_vs_plain``)."""
    times: dict[str, list[float]] = {}
    tokens: dict[str, int] = {}
    for _ in range(rounds):
        held = batches(runner, family, prompts, n)
        modes = list(held)
        while all(batch.busy for batch in held.values()):
            first = len(times.get("plain", [])) % len(modes)
            for mode in modes[first:] + modes[:first]:
                batch = held[mode]
                start = time.perf_counter()
                out = batch.step()
                seconds = time.perf_counter() - start
                tokens[mode] = tokens.get(mode, 0) + sum(len(c.tokens) for c in out.values())
                rows, positions = batch.last_pass
                kind = mode if positions <= rows else f"{mode} (drafted)"
                times.setdefault(kind, []).append(seconds)
        for batch in held.values():
            while batch.busy:
                batch.step()
    plain = statistics.median(times["plain"])

    def rate(mode: str) -> float:
        return tokens[mode] / sum(sum(v) for k, v in times.items() if k.startswith(mode))

    whole = {mode: round(rate(mode) / rate("plain"), 3) for mode in tokens if mode != "plain"}
    return {"whole_vs_plain": whole} | {
        kind: {
            "passes": len(v),
            "median_ms": round(1e3 * statistics.median(v), 3),
            "mean_ms": round(1e3 * statistics.mean(v), 3),
            "total_s": round(sum(v), 3),
            "median_vs_plain": round(statistics.median(v) / plain, 3),
        }
        for kind, v in sorted(times.items())
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/dflash-families"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--families", nargs="*", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--streams", type=int, nargs="*", default=[4, 8])
    ap.add_argument("--tokens", type=int, default=300, help="tokens per row")
    ap.add_argument("--rounds", type=int, default=2, help="fresh rows this many times")
    args = ap.parse_args()
    model, tokenizer = mlx_lm.load(str(args.work / "target"))
    drafts = {f: load_drafter(args.work / f, model) for f in args.families}
    runner = Runner(model, tokenizer, drafts, 32)
    prompts = prompts_from(read(stdlib_files(10)[1], 10**9), tokenizer, 8, 128)
    result: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": []}
    for family in args.families:
        for streams in args.streams:
            got = measure(runner, family, prompts[:streams], args.tokens, args.rounds)
            result["runs"].append({"family": family, "streams": streams, "modes": got})
            whole = ", ".join(f"{k} {v}x" for k, v in got["whole_vs_plain"].items())
            kinds = [(k, v) for k, v in got.items() if k != "whole_vs_plain"]
            line = ", ".join(f"{k} {v['median_ms']} ms ({v['passes']})" for k, v in kinds)
            line += f"; tok/s vs plain: {whole}"
            print(f"{family} x{streams}: {line}", flush=True)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
