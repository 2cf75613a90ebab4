"""Plain decoding vs DFlash on one target: tokens/s, tau, time split, efficiency vs ideal.

Without trained weights, ``--replay-tau T`` drives the loop with a drafter that replays the
target's own greedy tokens and plants a mistake so every cycle commits exactly T tokens, while a
random DFlash drafter of the published shape runs alongside so draft cost is real.

    ideal tokens/s = tau / (t(draft) + t(verify block))      (each timed alone)
    efficiency     = measured DFlash tokens/s / ideal

Example (a ~100M fp32 qwen3_5 target, OpenBLAS preloaded as in scripts/test.sh):
    python benchmarks/bench_dflash.py --replay-tau 4 8
    python benchmarks/bench_dflash.py --target <mlx model> --draft <drafter>   # real pair
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step

from common import PROMPT, bench_target, published_drafter, timed, write_json
from dflash_server import load, load_draft
from dflash_server.adaptive.policy import FixedBlock
from dflash_server.generation.row import Row
from dflash_server.generation.sampling import SamplingParams, TokenSampler
from dflash_server.generation.speculative import SpeculativeDecoder
from dflash_server.generation.target import TargetModel
from dflash_server.models.target_parts import find_target_parts
from dflash_server.testing import ReplayDrafter


def plain_tokens(model, prompt: list[int], n: int, repeats: int) -> tuple[list[int], float]:
    """mlx-lm's own greedy decode (median of ``repeats`` runs): baseline and replay reference."""
    runs = []
    for _ in range(repeats):
        start, tokens = None, []
        for i, (tok, _) in enumerate(generate_step(mx.array(prompt), model, max_tokens=n)):
            tokens.append(tok)
            if i == 0:
                start = time.perf_counter()  # exclude prefill
        runs.append((n - 1) / (time.perf_counter() - start))
    return tokens, statistics.median(runs)


def component_times(
    model, draft, prompt: list[int], context: int, block: int, tau: int
) -> dict[str, float]:
    """t(plain step), t(draft), t(verify block), each alone at a context of ``context`` tokens.

    t(draft) includes adding ``tau`` committed positions to the drafter's context, as each cycle
    does, then restores the context so every repeat sees the same one.
    """
    target = TargetModel(model, draft.config.target_layer_ids)
    ids = mx.array((prompt * (context // len(prompt) + 1))[:context])[None]
    cache = target.make_cache()
    _, taps = target.forward(ids, cache, slice(-1, None))
    dcache = draft.make_cache()
    draft.append_context(taps, dcache)
    mx.eval([c.state for c in cache], [c.state for c in dcache])
    rollback = target.make_rollback(cache)

    def forward_alone(n: int, repeats: int = 7) -> float:
        """Median time of an n-token target forward (logits for all rows), rolled back after each."""
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            with rollback.recording():
                logits, t = target.forward(ids[:, :n], cache, slice(None))
            mx.eval(mx.argmax(logits, axis=-1), t)
            times.append(time.perf_counter() - start)
            rollback.rollback(keep=0, fed=n)  # back to the same context for the next repeat
            mx.eval([c.state for c in cache])
        return statistics.median(times[1:])  # the first run warms up

    block_ids = mx.array([[1] + [draft.config.mask_token_id] * (block - 1)])

    new_context = taps[:, :tau]
    saved = [c.snapshot() for c in dcache]

    def run_draft():
        mx.eval(mx.argmax(draft(block_ids, new_context, dcache, logits_start=1), axis=-1))
        for c, s in zip(dcache, saved):  # back to the same context for the next repeat
            c.restore(s)

    return {
        "plain_step": forward_alone(1),
        "verify_block": forward_alone(block),
        "draft": timed(run_draft),
    }


def run_dflash(model, draft, prompt, n, block, repeats) -> tuple[list[int], float, dict]:
    target = TargetModel(model, draft.config.target_layer_ids)
    sampler = TokenSampler(SamplingParams(), seed=0)
    runs = []
    for _ in range(repeats):
        if isinstance(draft, ReplayDrafter):
            draft.cycle = 0
        decoder = SpeculativeDecoder(Row(target, draft, sampler, FixedBlock(block)))
        start, tokens = None, []
        for commit in decoder.generate(prompt, n):
            if start is None:
                start = time.perf_counter()  # exclude prefill, as for plain decoding
            tokens.extend(commit.tokens)
        runs.append((len(tokens) - 1) / (time.perf_counter() - start))
    profiled = SpeculativeDecoder(Row(target, draft, sampler, FixedBlock(block), profile=True))
    if isinstance(draft, ReplayDrafter):
        draft.cycle = 0
    for _ in profiled.generate(prompt, n):
        pass
    return tokens, statistics.median(runs), profiled.stats.as_dict()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", help="mlx-lm model (default: build a random ~100M qwen3_5)")
    ap.add_argument("--draft", help="DFlash drafter (default: random drafter + replay)")
    ap.add_argument("--replay-tau", type=int, nargs="*", default=[4, 8])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="medians over N runs")
    ap.add_argument("--json", type=Path, help="write results here")
    args = ap.parse_args()

    tmp = tempfile.TemporaryDirectory()
    model, tokenizer = load(args.target or bench_target(Path(tmp.name) / "target"))
    prompt = tokenizer.encode(PROMPT)
    parts = find_target_parts(model)
    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(
        f"target: {params / 1e6:.1f}M parameters, {parts.num_layers} layers, H={parts.hidden_size}"
    )

    reference, plain_tps = plain_tokens(model, prompt, args.tokens, args.repeats)
    results = {"plain_tokens_per_s": round(plain_tps, 2), "runs": []}
    print(f"plain (mlx-lm generate_step): {plain_tps:.1f} tok/s")

    if args.draft:
        draft = load_draft(args.draft, target=model)
        runs = [("real drafter", draft)]
    else:
        inner = published_drafter(model, block_size=args.block_size)
        runs = [
            (f"replay tau={tau}", ReplayDrafter(prompt + reference, [tau - 1], inner=inner))
            for tau in args.replay_tau
        ]
    for name, draft in runs:
        block = args.block_size
        tau = draft.pattern[0] + 1 if isinstance(draft, ReplayDrafter) else 4
        comp = component_times(model, draft, prompt, len(prompt) + args.tokens // 2, block, tau)
        tokens, tps, stats = run_dflash(model, draft, prompt, args.tokens, block, args.repeats)
        tau = stats["tau"]
        ideal = tau / (comp["draft"] + comp["verify_block"])
        row = {
            "name": name,
            "tokens_per_s": round(tps, 2),
            "speedup": round(tps / plain_tps, 3),
            "tau": tau,
            "ideal_tokens_per_s": round(ideal, 2),
            "efficiency": round(tps / ideal, 3),
            "t_plain_step_ms": round(1e3 * comp["plain_step"], 3),
            "t_draft_ms": round(1e3 * comp["draft"], 3),
            "t_verify_block_ms": round(1e3 * comp["verify_block"], 3),
            "profiled_split_s": stats.get("timings"),
            "lossless": tokens == reference[: len(tokens)],
        }
        results["runs"].append(row)
        print(json.dumps(row))
    write_json(args.json, results)


if __name__ == "__main__":
    main()
