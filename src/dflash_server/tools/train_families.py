"""What ``dflash-serve train`` trains (``--family``): each family's start, loss and saved layout,
and the checks that a command line's flags belong to the family it names."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from dflash_server.drafters.dflash import DFlashDraftModel
from dflash_server.models.loading import flat_arrays
from dflash_server.tools.common import model_card, save_drafter
from dflash_server.tools.train_dspark import init_dspark, make_dspark_loss, save_dspark
from dflash_server.tools.train_eagle3 import (
    DEFAULT_TTT,
    GAMMA,
    init_eagle3,
    make_eagle3_loss,
    save_eagle3,
)
from dflash_server.tools.train_forward import default_gamma, loss_and_metrics
from dflash_server.tools.train_init import init_drafter
from dflash_server.tools.train_mtp import init_mtp, mtp_loss, save_mtp

# (args, the target, its tokenizer, the training windows) -> (drafter, config.json, save dtype)
Init = Callable[[argparse.Namespace, nn.Module, Any, np.ndarray], tuple[Any, dict[str, Any], str]]
# (drafter, --out, its config.json, the README's lines, the dtype to cast to, the target)
Save = Callable[[Any, Path, dict[str, Any], list[str], mx.Dtype, nn.Module], None]


@dataclass(frozen=True)
class TrainFamily:
    name: str  # as --family spells it
    title: str  # its model card's
    init: Init  # (drafter bound to the target, its config.json, the dtype to save in)
    make_loss: Callable[[argparse.Namespace, nn.Module], Any]  # (draft, batch, weights) -> ...
    save: Save
    final: bool = False  # its loss reads the target's final hidden states
    gamma: Callable[[int], float] = default_gamma  # draft j's weight exp(-j/gamma), by block

    def card(self, lines: list[str], config: dict[str, Any]) -> list[str]:
        """The saved folder's README: a title, ``lines`` (how it was trained), how to serve it."""
        if self.name == "dflash":  # the card convert writes too
            return model_card(self.title, lines, config)
        serve = "Serve with `dflash-serve --target <target> --draft <this folder>`."
        return [f"# {self.title}", "", *lines, "", serve]


def _save_dflash(
    draft: Any, out: Path, config: dict[str, Any], card: list[str], dtype: mx.Dtype, _: Any
) -> None:
    export = DFlashDraftModel(draft.config)
    export.load_weights(flat_arrays(draft.parameters()))
    export.set_dtype(dtype)
    save_drafter(export, out, config, card)


def _save_mtp(
    head: Any, out: Path, config: dict[str, Any], card: list[str], dtype: mx.Dtype, _: Any
) -> None:
    save_mtp(head, out, config, card, dtype)


FAMILIES = {
    "dflash": TrainFamily(
        "dflash", "DFlash drafter", lambda args, model, tok, _: init_drafter(args, model, tok),
        lambda args, model: loss_and_metrics, _save_dflash,
    ),
    "dspark": TrainFamily(
        "dspark", "DSpark drafter", init_dspark, make_dspark_loss, save_dspark, final=True
    ),
    "eagle3": TrainFamily(
        "eagle3", "EAGLE-3 head", init_eagle3, make_eagle3_loss, save_eagle3, final=True,
        gamma=lambda _: GAMMA,
    ),
    "mtp": TrainFamily(
        "mtp", "MTP head", lambda args, model, tok, _: init_mtp(args, model),
        lambda args, model: mtp_loss, _save_mtp,
    ),
}  # fmt: skip
# Flags that only one family reads, checked so a mistaken --family fails loudly.
ONLY = {
    "dspark": ("markov_rank", "markov_kind", "no_confidence_head", "ce_weight", "tv_weight"),
    "eagle3": ("ttt_steps", "draft_vocab"),
}
# Of those, the ones that shape a fresh drafter (an --init folder has its own).
FRESH = ("markov_rank", "markov_kind", "no_confidence_head", "draft_vocab")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def resolve_family(args: argparse.Namespace) -> TrainFamily:
    """The family ``args`` ask for, with its defaults filled in; a ValueError naming the flag
    and the fix when flags contradict it."""
    if args.mtp and args.family not in (None, "mtp"):
        raise ValueError(f"--mtp is --family mtp: it cannot go with --family {args.family}")
    name = args.family or ("mtp" if args.mtp else "dflash")
    args.family, args.mtp = name, name == "mtp"
    for family, flags in ONLY.items():
        for flag in flags:
            if family != name and getattr(args, flag) not in (None, False):
                raise ValueError(f"{_flag(flag)} is a --family {family} flag, not {name}'s")
    fresh = args.init == "new"
    if not fresh and Path(args.init).suffix == ".json" and name != "dflash":
        raise ValueError(
            f"--init {args.init}: a JSON config sets up a DFlash drafter; for --family {name} "
            "give 'new' and the flags, or a folder to fine-tune"
        )
    if not fresh and (given := [_flag(f) for f in FRESH if getattr(args, f) not in (None, False)]):
        raise ValueError(
            f"{', '.join(given)} shape a fresh drafter; --init {args.init} brings its own: "
            "drop them or use --init new"
        )
    if args.layers is None:
        args.layers = 1 if name == "eagle3" else 5
    if name == "dspark":
        _dspark_defaults(args)
    elif name == "eagle3":
        _eagle3_defaults(args, fresh)
    elif name == "dflash" and args.block_size is None:
        args.block_size = 16
    return FAMILIES[name]


def _dspark_defaults(args: argparse.Namespace) -> None:
    if args.block_size is None:
        args.block_size = 8  # DeepSpec's block 7: 7 proposals, verified 8 wide
    if args.block_size < 2:
        raise ValueError(f"--block-size {args.block_size}: DSpark needs >= 2 (1 proposal)")
    if args.markov_rank is not None and args.markov_rank < 0:
        raise ValueError(f"--markov-rank {args.markov_rank}: must be >= 0 (0: no Markov head)")
    if args.markov_rank == 0 and args.markov_kind is not None:
        raise ValueError("--markov-kind with --markov-rank 0: there is no Markov head to shape")
    weights = [w for w in (args.ce_weight, args.tv_weight) if w is not None]
    if any(w < 0 for w in weights) or (len(weights) == 2 and not sum(weights)):
        raise ValueError("--ce-weight and --tv-weight: >= 0, and not both 0")


def _eagle3_defaults(args: argparse.Namespace, fresh: bool) -> None:
    steps, block = args.ttt_steps, args.block_size
    if steps is not None and block is not None and block != steps + 1:
        raise ValueError(
            f"--block-size {block} and --ttt-steps {steps}: an EAGLE-3 head drafts one token per "
            "TTT step, so --block-size is --ttt-steps + 1; give one of them"
        )
    if steps is not None:
        block = steps + 1
    elif block is None and fresh:  # a folder keeps its own speculative_tokens
        block = DEFAULT_TTT + 1
    if block is not None and block < 2:
        raise ValueError(f"--ttt-steps {block - 1}: must be >= 1")
    args.block_size = block
