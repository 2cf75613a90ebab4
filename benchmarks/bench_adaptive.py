"""block_size "auto" vs plain decoding vs fixed block sizes, at forced acceptance levels.

On one target (default: a random ~100M fp32 ``qwen3_5``, as ``bench_dflash.py``), for each
``--tau``: the replaying test double commits ``tau`` tokens per full cycle (tau 0: the random
published-shape drafter as is, tau ~1), with the real drafter pass paid. Modes: plain decoding
(ours; mlx-lm's ``generate_step`` once, for reference), fixed widths ``--fixed``, and the
controller: ``auto`` as the server runs it (each request starts from the acceptance the pair's
earlier requests saw), ``auto-cold`` from a fresh prior (a server's first request). Runs are
interleaved (one run of every mode, then the next round) and medians reported; every mode's
output must equal plain greedy.

    LD_PRELOAD=/lib/x86_64-linux-gnu/libopenblas.so.0 \\
        python benchmarks/bench_adaptive.py --tau 0 1 2 4 8 --json /tmp/adaptive.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from common import (
    PROMPT,
    bench_target,
    decode_rate,
    mlx_lm_plain,
    paired,
    published_drafter,
    write_json,
)
from dflash_server import load
from dflash_server.adaptive.controller import BlockController, SharedPrior
from dflash_server.adaptive.policy import FixedBlock
from dflash_server.generation.calibrate import measure_costs
from dflash_server.generation.row import Row
from dflash_server.generation.sampling import SamplingParams, TokenSampler
from dflash_server.generation.speculative import SpeculativeDecoder
from dflash_server.generation.target import TargetModel
from dflash_server.testing import ReplayDrafter


def ours(target, draft, prompt, n, mode, costs, prior) -> tuple[list[int], float, dict]:
    """Decode tokens/s of one mode: 'plain', a width, 'auto' (starting from the pair's shared
    prior, as the server runs it) or 'auto-cold' (a fresh prior: a first request)."""
    policy, width = None, 1
    if mode.startswith("auto"):
        shared = prior if mode == "auto" else None
        policy, width = BlockController(16, costs.copy(), prior=shared), 16
    elif mode != "plain":
        width = int(mode)
    decoder = SpeculativeDecoder(
        Row(
            target,
            None if mode == "plain" else draft,
            TokenSampler(SamplingParams(), 0),
            policy or FixedBlock(width),
        )
    )
    tokens, rate = decode_rate(decoder.generate(prompt, n))
    return tokens, rate, decoder.stats.as_dict()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", help="mlx-lm model (default: build a random ~100M qwen3_5)")
    ap.add_argument("--tau", type=int, nargs="*", default=[0, 1, 2, 4, 8])
    ap.add_argument("--fixed", type=int, nargs="*", default=[2, 4, 8, 16])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    tmp = tempfile.TemporaryDirectory()
    path = args.target or bench_target(Path(tmp.name) / "t")
    model, tokenizer = load(str(path))
    prompt = tokenizer.encode(PROMPT)
    inner = published_drafter(model, block_size=16)
    target = TargetModel(model, inner.config.target_layer_ids)
    costs = measure_costs(model, inner)
    print(costs.describe(), flush=True)
    reference, mlx_lm_rate = mlx_lm_plain(model, prompt, args.tokens)
    print(f"mlx-lm generate_step (plain, once): {mlx_lm_rate:.2f} tok/s", flush=True)
    modes = ["plain", *map(str, args.fixed), "auto", "auto-cold"]
    results = {"costs": costs.as_dict(), "mlx_lm_tok_s": round(mlx_lm_rate, 2), "rows": []}
    for tau in args.tau:
        draft = inner if tau == 0 else ReplayDrafter(prompt + reference, [tau - 1], inner)
        prior = SharedPrior()  # this pair's, across its requests
        for mode in modes:  # warm-up: kernels, allocations, compiled graphs (and the prior)
            ours(target, draft, prompt, 24, mode, costs, prior)
        rates: dict[str, list[float]] = {m: [] for m in modes}
        auto_stats = []
        for _ in range(args.repeats):
            for mode in modes:
                tokens, rate, stats = ours(target, draft, prompt, args.tokens, mode, costs, prior)
                if mode == "auto":
                    auto_stats.append(stats)
                assert tokens == reference, f"{mode} at tau {tau} differs from plain greedy"
                rates[mode].append(rate)
        med = {m: statistics.median(v) for m, v in rates.items()}
        plain = med["plain"]

        best_fixed = max(args.fixed, key=lambda b: med[str(b)])
        last = auto_stats[-1]
        row = {
            "tau": tau or "random",
            "tok_s": {m: round(v, 2) for m, v in med.items()},
            "auto_vs_plain": round(med["auto"] / plain, 3),
            "auto_cold_vs_plain": round(med["auto-cold"] / plain, 3),
            "best_fixed": best_fixed,
            "auto_vs_best_fixed": round(med["auto"] / med[str(best_fixed)], 3),
            "auto_cold_vs_best_fixed": round(med["auto-cold"] / med[str(best_fixed)], 3),
            "fixed16_vs_plain": round(med["16"] / plain, 3) if "16" in med else None,
            "auto_tau": last["tau"],
            "auto_plain_share": last["plain_share"],
            "auto_block_sizes": {b: n for b, n in enumerate(last["block_size_histogram"]) if n},
            "paired": {
                "auto_vs_plain": paired(rates, "auto", "plain"),
                "auto_cold_vs_plain": paired(rates, "auto-cold", "plain"),
                "auto_vs_best_fixed": paired(rates, "auto", str(best_fixed)),
                "fixed16_vs_plain": paired(rates, "16", "plain") if "16" in rates else None,
            },
            "runs": {m: [round(x, 2) for x in v] for m, v in rates.items()},
        }
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
