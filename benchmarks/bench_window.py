"""The drafter's context window on long contexts: draft cost per cycle, and acceptance.

Cost (default): on a target (default: a random ~100M fp32 ``qwen3_5``) with a published-shape
random drafter, prefill a ``--context``-token prompt once, then time one drafter pass (a 16-token
block, as every cycle runs) over the drafter context at several lengths, with the whole context
and with each ``--windows`` size (4 sinks + newest). Medians of ``--repeats``.

Acceptance (``--draft`` given, e.g. the pair ``distill_stdlib.py`` trains): greedy-decode long
held-out prompts with the whole context and with each window, and report tau (output is
asserted identical to plain decoding).

    LD_PRELOAD=/lib/x86_64-linux-gnu/libopenblas.so.0 python benchmarks/bench_window.py
    python benchmarks/bench_window.py --target /tmp/distill/target --draft /tmp/distill/draft \\
        --prompt-len 1024 --windows 128 256 512
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from common import PROMPT, bench_target, published_drafter, write_json
from dflash_server import load, load_draft
from dflash_server.generation.target import TargetModel
from dflash_server.tools.common import decode


def draft_cost(model, tokenizer, args) -> dict:
    draft = published_drafter(model, block_size=16)
    target = TargetModel(model, draft.config.target_layer_ids)
    ids = tokenizer.encode(PROMPT * (args.context // 16 + 1))[: args.context]
    start = time.perf_counter()
    cache, taps = target.make_cache(), []
    for i in range(0, len(ids), 2048):  # chunked prefill, keeping every position's taps
        _, t = target.forward(mx.array(ids[i : i + 2048])[None], cache, None)
        mx.eval(t, [c.state for c in cache])
        taps.append(t)
    taps = mx.concatenate(taps, axis=1)
    prefill_s = time.perf_counter() - start
    block = mx.array([[ids[-1]] + [draft.config.mask_token_id] * 15])
    rows = []
    lengths = sorted({n for n in (512, 2048, args.context) if n <= args.context})
    for length in lengths:
        for window in [0, *args.windows]:
            draft.set_window(window)
            dcache = draft.make_cache()
            draft.append_context(taps[:, :length], dcache)
            mx.eval([c.state for c in dcache])

            def run(dcache=dcache):
                mx.eval(mx.argmax(draft(block, None, dcache, logits_start=1), axis=-1))

            run()
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                run()
                times.append(time.perf_counter() - t0)
            rows.append(
                {
                    "context": length,
                    "window": window or "whole",
                    "draft_ms": round(1e3 * statistics.median(times), 2),
                    "keys_seen": int(dcache[0].fetch()[0].shape[2]),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return {"prefill_s": round(prefill_s, 1), "rows": rows}


def acceptance(model, tokenizer, args) -> dict:
    from distill_stdlib import prompts_from, read, stdlib_files

    draft = load_draft(args.draft, target=model)
    _, held = stdlib_files(10)
    prompts = prompts_from(read(held, 10**9), tokenizer, args.prompts, args.prompt_len)
    plain = decode(model, None, prompts, args.tokens)
    rows = []
    for window in [0, *args.windows]:
        draft.set_window(window)
        spec = decode(model, draft, prompts, args.tokens)
        assert spec.tokens == plain.tokens, "windowed DFlash differs from plain greedy"
        rows.append({"window": window or "whole", "tau": round(spec.tau, 3)})
        print(json.dumps(rows[-1]), flush=True)
    return {"prompts": len(prompts), "prompt_len": args.prompt_len, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", help="mlx-lm model (default: build a random ~100M qwen3_5)")
    ap.add_argument("--draft", help="a trained drafter: measure acceptance instead of cost")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--windows", type=int, nargs="*", default=[4096, 1024])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory()
    path = args.target or bench_target(Path(tmp.name) / "t")
    model, tokenizer = load(str(path))
    result = (acceptance if args.draft else draft_cost)(model, tokenizer, args)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
