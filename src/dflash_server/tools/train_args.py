"""``dflash-serve train``'s flags, in a module that imports nothing heavy: ``dflash-serve`` parses
them before it imports the training (``train.py``), so ``--help`` and a mistyped flag answer at
once."""

from __future__ import annotations

import argparse

from dflash_server.cli_parser import Parser

FAMILIES = ("dflash", "dspark", "eagle3", "mtp")
MARKOV_KINDS = ("vanilla", "gated", "rnn")  # drafters/dspark.py's, without importing mlx


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="dflash-serve train",
        description="Distil (or fine-tune) a drafter for an mlx-lm target model: DFlash (default), "
        "DSpark, EAGLE-3 or the target's MTP head.",
    )
    p.add_argument("--target", required=True, help="mlx-lm target: HF repo id or local folder")
    p.add_argument("--data", required=True, help="JSONL (messages/text), text file, or folder")
    p.add_argument("--out", required=True, help="output folder (checkpoints, logs)")
    p.add_argument("--force", action="store_true", help="start over in an --out that holds files")
    p.add_argument(
        "--family", choices=FAMILIES,
        help="what to train (default dflash): a DFlash drafter, a DSpark drafter (DeepSpec's "
        "layout), an EAGLE-3 head (speculators' layout) or the target's MTP head",
    )  # fmt: skip
    p.add_argument(
        "--init",
        default="new",
        help="'new' (fresh drafter from the flags below), a drafter folder/hub id to fine-tune, "
        "or (DFlash) a JSON file of drafter config keys over the defaults derived from the target",
    )
    p.add_argument(
        "--mtp", action="store_true",
        help="= --family mtp: the target's multi-token-prediction head (--init new, 'target': "
        "the head in the target's checkpoint, or an MTP folder); saves a split MTP export",
    )  # fmt: skip
    f = p.add_argument_group("fresh drafter (--init new or a JSON config)")
    f.add_argument("--layers", type=int, help="draft layers (5; EAGLE-3: 1)")
    f.add_argument(
        "--taps", help="target layer ids, comma separated (default: spread, 5 taps; EAGLE-3: "
        "its aux layers 2, L/2, L-3, as layer outputs)",
    )  # fmt: skip
    f.add_argument(
        "--block-size", type=int,
        help="the widest verify, anchor included (DFlash 16; DSpark 8, DeepSpec's block 7 "
        "counting proposals; EAGLE-3 --ttt-steps + 1; MTP 8)",
    )  # fmt: skip
    f.add_argument("--mask-id", type=int, help="mask token id (default: the tokenizer's spare row)")
    d = p.add_argument_group("DSpark (--family dspark)")
    d.add_argument(
        "--markov-rank", type=int,
        help="rank of the Markov head (256 as DeepSpec, at most the target's width; 0: none)",
    )  # fmt: skip
    d.add_argument("--markov-kind", choices=MARKOV_KINDS, help="Markov head kind (vanilla)")
    d.add_argument(
        "--no-confidence-head", action="store_true",
        help="leave out the confidence head (it predicts each draft's acceptance)",
    )  # fmt: skip
    d.add_argument("--ce-weight", type=float, help="cross-entropy weight (DeepSpec: 0.1)")
    d.add_argument(
        "--tv-weight", type=float, help="weight of |p_draft - p_target|_1 (DeepSpec: 0.9)"
    )
    g = p.add_argument_group("EAGLE-3 (--family eagle3)")
    g.add_argument(
        "--ttt-steps", type=int,
        help="training-time-test steps unrolled, each fed the layer's own output as drafting "
        "does; also the drafts per cycle (7, as DeepSpec)",
    )  # fmt: skip
    g.add_argument(
        "--draft-vocab", type=int,
        help="a draft vocabulary of the N most frequent target tokens in --data (d2t/t2d); "
        "default: the target's whole vocabulary",
    )  # fmt: skip
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=1000, help="total optimizer steps (1000)")
    t.add_argument(
        "--max-seconds", type=float,
        help="stop after this much training time (evaluations and checkpoints excluded), even "
        "before --steps; the learning-rate schedule still spans --steps",
    )  # fmt: skip
    t.add_argument("--batch-size", type=int, default=4, help="sequences per step (4)")
    t.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (512)")
    t.add_argument("--anchors", type=int, default=32, help="anchors (blocks) per sequence (32)")
    t.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (6e-4)")
    t.add_argument("--warmup", type=int, help="linear warm-up steps (default 4%% of --steps)")
    t.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor / peak (0.1)")
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--grad-clip", type=float, default=1.0)
    t.add_argument(
        "--loss-gamma", type=float,
        help="weight exp(-j/gamma) of draft j (DFlash 7 for B=16, DSpark 4, EAGLE-3 4.48)",
    )  # fmt: skip
    t.add_argument(
        "--labels", choices=["target", "data"], default="target",
        help="what the drafter learns: the target's greedy tokens (default) or the data's",
    )  # fmt: skip
    t.add_argument(
        "--hidden-states", choices=["on-the-fly", "cache"], default="on-the-fly",
        help="run the target every step (no disk) or once into --cache-dir (fast epochs)",
    )  # fmt: skip
    t.add_argument("--cache-dir", help="hidden-state cache folder (default: OUT/hidden_cache)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--resume", action="store_true", help="continue from the state in --out")
    t.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps")
    t.add_argument("--save-dtype", choices=["float32", "bfloat16", "float16"])
    e = p.add_argument_group("evaluation (real speculative loop, greedy, held-out data)")
    e.add_argument("--eval-every", type=int, default=0, help="tau every N steps (0: start/end)")
    e.add_argument("--eval-prompts", type=int, default=4, help="held-out prompts (0: no eval)")
    e.add_argument("--eval-prompt-len", type=int, default=64)
    e.add_argument("--eval-tokens", type=int, default=64)
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    return p
