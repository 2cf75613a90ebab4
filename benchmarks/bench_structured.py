"""Cost of a JSON schema under DFlash: tokens/s and tau with and without the grammar.

Same setup as bench_dflash.py (a random ~100M fp32 qwen3_5 target, a random drafter of the
published shape for real draft cost, and a replay test double fixing tau), run twice: free text,
and constrained by a JSON schema through llguidance. The replay reference of each run is that
run's own greedy output, so tau is the same and the difference is the grammar's cost per cycle:
the extra host sync for the drafted path, the masks along it, and applying them.

    python benchmarks/bench_structured.py --replay-tau 4 8
    python benchmarks/bench_structured.py --tokenizer path/to/qwen3   # mask cost at a real vocab
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from common import PROMPT, bench_target, published_drafter, write_json
from dflash_server import load
from dflash_server.adaptive.policy import FixedBlock
from dflash_server.chat.structured import GrammarConstraint, response_format_grammar
from dflash_server.generation.row import Row
from dflash_server.generation.sampling import SamplingParams, TokenSampler
from dflash_server.generation.speculative import SpeculativeDecoder
from dflash_server.generation.target import TargetModel
from dflash_server.models.target_parts import find_target_parts
from dflash_server.testing import ReplayDrafter

# Long enough to keep a random model busy for a few hundred tokens, bounded so it ends.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "items": {
            "type": "array",
            "maxItems": 12,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 30},
                    "qty": {"type": "integer", "minimum": 0, "maximum": 999},
                    "kind": {"enum": ["fruit", "tool", "book"]},
                },
                "required": ["name", "qty", "kind"],
            },
        },
    },
    "required": ["title", "items"],
}


def decode(model, tokenizer, draft, prompt, n, block, grammar):
    """(tokens, tokens/s excluding prefill, stats, seconds spent in the grammar)."""
    layers = draft.config.target_layer_ids if draft is not None else ()
    constraint = GrammarConstraint(tokenizer, grammar) if grammar else None
    spent = [0.0]
    if constraint is not None:  # time the host-side mask work (llguidance + unpacking)
        allowed = constraint.allowed

        def timed_allowed(drafts):
            start = time.perf_counter()
            out = allowed(drafts)
            spent[0] += time.perf_counter() - start
            return out

        constraint.allowed = timed_allowed
    sampler = TokenSampler(SamplingParams(temperature=0.0), seed=0)
    decoder = SpeculativeDecoder(
        Row(
            TargetModel(model, layers),
            draft,
            sampler,
            FixedBlock(block if draft else 1),
            constraint=constraint,
        )
    )
    eos = set(tokenizer.eos_token_ids)
    start, tokens = None, []
    for commit in decoder.generate(prompt, n, eos):
        if start is None:
            start = time.perf_counter()
        tokens.extend(commit.tokens)
    tps = (len(tokens) - 1) / (time.perf_counter() - start)
    return tokens, tps, decoder.stats.as_dict(), spent[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--replay-tau", type=int, nargs="*", default=[4, 8])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--tokenizer", help="tokenizer folder to use instead of the tiny BPE")
    ap.add_argument("--json", type=Path, help="write results here")
    args = ap.parse_args()

    tmp = tempfile.TemporaryDirectory()
    path = bench_target(Path(tmp.name) / "target")
    if args.tokenizer:  # a real vocabulary: mask cost scales with it
        for f in Path(args.tokenizer).glob("tokenizer*.json"):
            (path / f.name).write_bytes(f.read_bytes())
    model, tokenizer = load(path)
    if args.tokenizer and len(tokenizer.vocab) > find_target_parts(model).vocab_size:
        raise SystemExit("that tokenizer is larger than the benchmark target's 32k vocabulary")
    prompt = tokenizer.encode(PROMPT)
    grammar = response_format_grammar(
        {"type": "json_schema", "json_schema": {"name": "b", "schema": SCHEMA}}
    )
    inner = published_drafter(model, block_size=args.block_size)
    rows = []
    for label, g in (("free text", None), ("json schema", grammar)):
        reference, plain_tps, _, plain_g = decode(model, tokenizer, None, prompt, args.tokens, 1, g)
        row = {
            "output": label,
            "tokens": len(reference),
            "plain_tokens_per_s": round(plain_tps, 1),
            "plain_grammar_ms_per_token": round(1e3 * plain_g / len(reference), 3),
        }
        for tau in args.replay_tau:
            draft = ReplayDrafter(prompt + reference, [tau - 1], inner=inner)
            tokens, tps, stats, spent = decode(
                model, tokenizer, draft, prompt, args.tokens, args.block_size, g
            )
            row[f"tau{tau}"] = {
                "tokens_per_s": round(tps, 1),
                "tau": stats["tau"],
                "speedup": round(tps / plain_tps, 2),
                "grammar_ms_per_cycle": round(1e3 * spent / max(stats["cycles"], 1), 3),
                "lossless": tokens == reference,
            }
        rows.append(row)
        print(json.dumps(row))
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
