"""Prefix cache on a replayed agent trace: TTFT cold vs cached, per turn and in total.

The trace: a long system prompt with tool definitions, then ``--turns`` user turns; each turn
resends the whole conversation (the client sends back only the answers' text, as OpenAI clients
do), so turn k shares turn k-1's prompt up to its generation prompt. Each turn runs twice in one
process, interleaved: without a prefix cache (cold) and with one (warm, carried across turns).

    ideal   = time to prefill only the new tokens on caches already holding the prefix
              (the same chunks, plain target + drafter calls: no cache bookkeeping)
    overhead = cached TTFT / ideal     (target: <= 1.25)
    speedup  = total cold trace time / total cached trace time     (target: >= 3)

Example (~100M fp32 qwen3_5 target, OpenBLAS preloaded as in scripts/test.sh):
    python benchmarks/bench_prefix_cache.py            # 2k system + 8 turns to ~8k tokens
    python benchmarks/bench_prefix_cache.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load

from common import bench_target, published_drafter, write_json
from dflash_server.chat.prompts import render_chat
from dflash_server.engine.prefix_cache import PrefixCache
from dflash_server.generation.pair import ModelPair
from dflash_server.generation.prefix import Checkpoint
from dflash_server.generation.request import BlockPolicy, GenerationRequest
from dflash_server.generation.stream import generate
from dflash_server.generation.target import TargetModel
from dflash_server.testing import mask_token_id

SENTENCE = (
    "the model reads files runs tests and edits code while the user waits for a short answer "
    "about the function that parses configuration values and reports errors to the caller"
)
WORDS = SENTENCE.split()


def text(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(n_words))


def tools(n: int) -> list[dict]:
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": text(40, i),
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string", "description": text(12, i + 1)}},
                },
            },
        }
        for i in range(n)
    ]


def trace(tokenizer, system_words: int, turns: int, turn_words: int) -> list:
    """The rendered prompt of each turn of one growing conversation."""
    messages = [{"role": "system", "content": text(system_words, 0)}]
    prompts = []
    for k in range(turns):
        messages.append({"role": "user", "content": text(turn_words, k + 1)})
        prompts.append(render_chat(tokenizer, messages, enable_thinking=True, tools=tools(6)))
        messages.append({"role": "assistant", "content": text(40, k + 100)})
    return prompts


def ttft(model, draft, tokenizer, prompt, cache, step: int) -> tuple[float, int]:
    """Seconds to the first token, and the prompt tokens the cache restored."""
    request = GenerationRequest(
        tuple(prompt.tokens),
        1,
        block=BlockPolicy(draft.config.block_size),
        checkpoints=prompt.checkpoints,
    )
    start = time.perf_counter()
    pair = ModelPair.of(model, tokenizer, draft)
    out = list(generate(pair, request, prefill_step_size=step, prefix=cache))
    return time.perf_counter() - start, out[-1].stats.cached_tokens


def ideal(model, draft, prompt, start: int, step: int) -> float:
    """Prefill ``prompt[start:]`` on live caches that already hold ``prompt[:start]``."""
    target = TargetModel(model, draft.config.target_layer_ids)
    cache, draft_cache = target.make_cache(), draft.make_cache()
    tokens = mx.array(prompt.tokens)[None]

    def feed(begin: int, end: int, rows) -> mx.array | None:
        logits = None
        for a in range(begin, end, step):
            b = min(end, a + step)
            logits, taps = target.forward(tokens[:, a:b], cache, rows if b == end else None)
            draft.append_context(taps, draft_cache)
            mx.eval([c.state for c in cache], [c.state for c in draft_cache])
        return logits

    feed(0, start, None)
    begin = time.perf_counter()
    logits = feed(start, len(prompt.tokens), slice(-1, None))
    mx.eval(mx.argmax(logits[0, -1]))
    return time.perf_counter() - begin


def checkpoint_formula(model) -> int:
    """Per Gated DeltaNet layer, recurrent state Hv*Dv*Dk fp32 plus the conv window
    (docs/design.md, "Prefix cache internals")."""
    args = model.args.text_config if hasattr(model.args, "text_config") else model.args
    cfg = args if isinstance(args, dict) else vars(args)
    gdn = sum(1 for layer in model.layers if hasattr(layer, "linear_attn"))
    hv, hk = cfg["linear_num_value_heads"], cfg["linear_num_key_heads"]
    dv, dk = cfg["linear_value_head_dim"], cfg["linear_key_head_dim"]
    conv_dim = 2 * hk * dk + hv * dv
    dtype_bytes = model.layers[0].linear_attn.in_proj_qkv.weight.dtype.size
    per_layer = hv * dv * dk * 4 + (cfg["linear_conv_kernel_dim"] - 1) * conv_dim * dtype_bytes
    return gdn * per_layer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--system-words", type=int, default=50, help="with the tools: ~2.3k tokens")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--turn-words", type=int, default=160, help="~700 tokens per turn")
    p.add_argument("--prefill-step", type=int, default=512)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = bench_target(Path(tmp) / "t")
        model, tokenizer = load(str(path))
        draft = published_drafter(model, mask_id=mask_token_id(path))
        prompts = trace(tokenizer, a.system_words, a.turns, a.turn_words)
        warm_cache = PrefixCache(1 << 34)
        rows, cold_total, warm_total = [], 0.0, 0.0
        ttft(model, draft, tokenizer, prompts[0], None, a.prefill_step)  # warm-up: kernels
        for k, prompt in enumerate(prompts):
            cold, _ = ttft(model, draft, tokenizer, prompt, None, a.prefill_step)
            warm, reused = ttft(model, draft, tokenizer, prompt, warm_cache, a.prefill_step)
            best = ideal(model, draft, prompt, reused, a.prefill_step) if reused else cold
            cold_total, warm_total = cold_total + cold, warm_total + warm
            rows.append(
                {
                    "turn": k + 1,
                    "prompt_tokens": len(prompt.tokens),
                    "reused": reused,
                    "new_tokens": len(prompt.tokens) - reused,
                    "ttft_cold_s": round(cold, 3),
                    "ttft_cached_s": round(warm, 3),
                    "ideal_new_only_s": round(best, 3),
                    "cached_over_ideal": round(warm / best, 3),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        checkpoint = Checkpoint.take(*_live_caches(model, draft, prompts[0]))
        measured = sum(x.nbytes for x in checkpoint.arrays())
        summary = {
            "total_cold_s": round(cold_total, 2),
            "total_cached_s": round(warm_total, 2),
            "speedup": round(cold_total / warm_total, 2),
            "checkpoint_bytes": measured,
            "checkpoint_bytes_formula": checkpoint_formula(model),
            "cache_bytes_end": warm_cache.nbytes,
            "cache_entries_end": warm_cache.stats()["entries"],
        }
        print(json.dumps(summary))
        write_json(a.json, {"turns": rows, "summary": summary})
    return 0


def _live_caches(model, draft, prompt) -> tuple[list, list]:
    target = TargetModel(model, draft.config.target_layer_ids)
    cache, draft_cache = target.make_cache(), draft.make_cache()
    _, taps = target.forward(mx.array(prompt.tokens[:64])[None], cache)
    draft.append_context(taps, draft_cache)
    return cache, draft_cache


if __name__ == "__main__":
    raise SystemExit(main())
