"""The KV memory budget: peak memory of concurrent long requests with and without it.

On the ~100M fp32 ``qwen3_5`` benchmark target (``common.bench_target``; plain decoding, so the
target's caches are what grows; ``--tiny``: the tests' 4-layer one, where the caches dwarf the
weights and the activations), ``--streams`` requests of ``--prompt`` tokens and ``--tokens``
new ones are submitted together to the engine (batched, ``--streams`` may run at once), once with
``--max-kv-memory`` set to what ``--fit`` of them reserve together and once without a budget
(``0``). Reported per run: MLX's peak memory over the run (``mx.get_peak_memory``), the weights
(MLX's active memory after loading), the budget, the most requests running at once, the most
KV memory reserved, and the wall time. A third run, one request alone, gives the peak that is not
KV (the weights, one prefill chunk's activations: logits and attention scores).

    LD_PRELOAD=/lib/x86_64-linux-gnu/libopenblas.so.0 \\
        python benchmarks/bench_kv_budget.py --json /tmp/kv_budget.json
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from common import bench_target, write_json
from dflash_server.engine.jobs import Finished, Job
from dflash_server.engine.kv_budget import build_ledger
from dflash_server.engine.loader import LoadedModels, load_models
from dflash_server.engine.worker import Engine
from dflash_server.generation.request import PLAIN, GenerationRequest
from dflash_server.generation.sampling import SamplingParams
from dflash_server.testing import build_target

MB = 2**20


def run(
    models: LoadedModels, args: argparse.Namespace, budget: int, streams: int
) -> dict[str, Any]:
    """``streams`` requests at once on an engine with ``budget`` (0: none); what memory they
    took."""
    engine = Engine(
        lambda: models,
        max_active=streams,
        max_queue=streams,
        prefill_step_size=args.chunk,
        max_kv_memory=budget,
    )
    engine.start()
    assert engine.wait_ready(600)
    assert engine.batch is not None
    most = {"rows": 0, "reserved": 0}
    vocab = models.summary.vocab_size or 256
    step = engine.rows.step

    def observed() -> Any:  # the most rows and reserved KV memory at any step
        outcomes = step()
        assert engine.batch is not None
        most["rows"] = max(most["rows"], len(engine.batch.rows))
        most["reserved"] = max(most["reserved"], (engine.kv_memory or {}).get("in_use_bytes", 0))
        return outcomes

    engine.rows.step = observed  # type: ignore[method-assign]

    async def main() -> list[list[int]]:
        jobs = []
        for i in range(streams):
            prompt = tuple((i * 131 + j * 7) % (vocab - 10) + 10 for j in range(args.prompt))
            request = GenerationRequest(prompt, args.tokens, SamplingParams(), block=PLAIN)
            jobs.append(Job(request))
        for job in jobs:
            engine.submit(job)
        counts = []
        for job in jobs:
            events = []
            while batch := await job.next_events(timeout=600):
                events.extend(batch)
            assert isinstance(events[-1], Finished), events[-1]
            counts.append(events[-1].completion_tokens)
        return counts

    mx.clear_cache()
    mx.reset_peak_memory()
    start = time.perf_counter()
    try:
        counts = asyncio.run(main())
    finally:
        engine.stop(60)
    wall = time.perf_counter() - start
    return {
        "budget_mb": round(budget / MB, 1),
        "peak_mb": round(mx.get_peak_memory() / MB, 1),
        "most_rows": most["rows"],
        "most_reserved_mb": round(most["reserved"] / MB, 1),
        "completion_tokens": counts,
        "wall_s": round(wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=Path, help="a target folder (default: bench_target)")
    parser.add_argument(
        "--tiny", action="store_true", help="the tests' tiny hybrid target (KV dominates)"
    )
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--fit", type=int, default=2, help="requests the budget holds at once")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.target or (build_target if args.tiny else bench_target)(Path(tmp) / "t")
        models = load_models(str(path), None, measure=False)
        mx.eval(models.pair.model.parameters())
    weights = mx.get_active_memory()
    ledger = build_ledger(models, 2**50, 0, padded=True)
    assert ledger is not None
    size = args.prompt + args.tokens
    budget = ledger.need([size] * args.fit)
    result: dict[str, Any] = {
        "weights_mb": round(weights / MB, 1),
        "per_request_mb": round(ledger.alone(size) / MB, 1),
        "streams": args.streams,
        "prompt": args.prompt,
        "tokens": args.tokens,
    }
    runs = (("alone", 0, 1), ("budget", budget, args.streams), ("no_budget", 0, args.streams))
    for name, limit, streams in runs:
        result[name] = run(models, args, limit, streams)
        print(name, result[name], flush=True)
    b, n = result["budget"], result["no_budget"]
    result["budget_plus_weights_mb"] = round((budget + weights) / MB, 1)
    result["peak_within_budget_plus_weights"] = b["peak_mb"] <= result["budget_plus_weights_mb"]
    print({k: v for k, v in result.items() if k not in ("alone", "budget", "no_budget")})
    print(f"peak with budget {b['peak_mb']} MB, without {n['peak_mb']} MB")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
