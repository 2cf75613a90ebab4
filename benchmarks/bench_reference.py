"""dflash-server vs the reference ``dflash.model_mlx`` (z-lab/dflash), side by side, same pair.

The reference is imported from a checkout given on the command line (its code is never copied
here): ``--reference /path/to/z-lab/dflash`` (the folder holding ``dflash/model_mlx.py``). Both
sides load the same target folder (two instances: the reference patches its model's layers) and
the same drafter weights, decode the same prompt greedily with a fixed block, and must commit
identical tokens. Runs are interleaved (reference, ours, reference, ...) and medians reported.

Acceptance is forced like ``bench_dflash.py``: ``--tau T`` wraps the drafter on both sides so each
cycle commits T tokens (the drafter's real pass still runs, so its cost is paid); ``--tau 0``
means the random drafter as is (tau ~1).

    python benchmarks/bench_reference.py --reference /path/to/dflash --tau 0 1 2 4 8
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step

from common import PROMPT, bench_target, decode_rate, published_drafter, write_json
from dflash_server import load, stream_generate
from dflash_server.testing import ReplayDrafter


def reference_module(path: Path):
    sys.path.insert(0, str(path))
    return importlib.import_module("dflash.model_mlx")


def reference_drafter(ref, ours, model, replay: list[int] | None, pattern: int):
    """The reference's DFlashDraftModel with our drafter's weights; with ``replay``, planted
    logits like ``ReplayDrafter`` (the real pass still runs)."""
    c = ours.config
    config = ref.DFlashConfig(
        hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim, intermediate_size=c.intermediate_size, vocab_size=c.vocab_size,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings, block_size=c.block_size,
        target_layer_ids=tuple(c.target_layer_ids), num_target_layers=c.num_target_layers,
        mask_token_id=c.mask_token_id,
    )  # fmt: skip

    class Replayed(ref.DFlashDraftModel):
        def __call__(self, inputs, target_hidden, cache):
            real = super().__call__(inputs, target_hidden, cache)
            if replay is None:
                return real
            anchor = cache[0].offset  # context positions = index of block position 0
            vocab = real.shape[-1]
            planted = [
                (replay[anchor + j] if anchor + j < len(replay) else 0) + (j > pattern)
                for j in range(inputs.shape[1])
            ]
            rows = mx.array(planted) % vocab
            logits = mx.where(mx.arange(vocab) == rows[:, None], 30.0, -30.0)[None]
            return logits + 0 * real

    draft = Replayed(config)
    draft.load_weights(list(tree_flatten(ours.parameters())))
    mx.eval(draft.parameters())
    return draft.bind(model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--reference", type=Path, required=True, help="z-lab/dflash checkout")
    ap.add_argument("--target", help="mlx-lm target (default: a random ~100M qwen3_5)")
    ap.add_argument("--tau", type=int, nargs="*", default=[0, 2, 4, 8])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    ref = reference_module(args.reference)

    tmp = tempfile.TemporaryDirectory()
    path = args.target or bench_target(Path(tmp.name) / "t")
    ours_model, tokenizer = load(str(path))
    ref_model, _ = load(str(path))
    prompt = tokenizer.encode(PROMPT)
    reference = [t for t, _ in generate_step(mx.array(prompt), ours_model, max_tokens=args.tokens)]
    inner = published_drafter(ours_model, block_size=args.block_size)
    rows = []
    for tau in args.tau:
        replay = None if tau == 0 else prompt + reference
        pattern = max(0, tau - 1)
        ours = inner if tau == 0 else ReplayDrafter(replay, [pattern], inner)
        theirs = reference_drafter(ref, inner, ref_model, replay, pattern)
        times: dict[str, list[float]] = {"reference": [], "ours": []}
        outputs = {}
        for _ in range(args.repeats + 1):  # the first round warms up both
            for name in ("reference", "ours"):
                if name == "reference":
                    gen = ref.stream_generate(
                        ref_model, theirs, tokenizer, prompt, args.block_size, args.tokens
                    )
                else:
                    if isinstance(ours, ReplayDrafter):
                        ours.cycle = 0
                    gen = stream_generate(
                        ours_model, ours, tokenizer, prompt, args.block_size, args.tokens
                    )
                tokens, rate = decode_rate(gen)
                outputs[name] = tokens[: args.tokens]
                times[name].append(rate)
        same = outputs["reference"] == outputs["ours"]
        med = {k: statistics.median(v[1:]) for k, v in times.items()}
        row = {
            "tau": tau or "random",
            "reference_tok_s": round(med["reference"], 2),
            "ours_tok_s": round(med["ours"], 2),
            "ratio": round(med["ours"] / med["reference"], 3),
            # per round (machine load drifts between rounds), then the median
            "paired_ratio": round(
                statistics.median(o / r for o, r in zip(times["ours"][1:], times["reference"][1:])),
                3,
            ),
            "identical_tokens": same,
            "runs": {k: [round(x, 2) for x in v[1:]] for k, v in times.items()},
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
