"""``dflash-serve train``: distil a drafter for an mlx-lm target, or fine-tune one.

``--family`` picks what trains (``train_families``): a DFlash drafter (default; ``train_forward``
for the batched objective), a DSpark drafter (``train_dspark``), an EAGLE-3 head
(``train_eagle3``) or the target's MTP head (``train_mtp``). Only the drafter's own parameters
train; the target's embedding and lm_head are borrowed frozen through ``bind``, exactly as at
inference. Each step samples sequences (and K anchors per sequence for the block families).
Checkpoints use each family's published layout (what ``load_drafter`` loads for serving) plus
``training/`` (fp32 master weights and optimizer state, step, history) for ``--resume``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_unflatten

from dflash_server.drafters.protocol import Drafter
from dflash_server.engine.blas import blas_hint
from dflash_server.engine.loader import TARGET_PATTERNS, ModelLoadError, resolve_model
from dflash_server.generation.target import TargetModel
from dflash_server.models.loading import flat_arrays, load_arrays
from dflash_server.tools.common import check_out, decode
from dflash_server.tools.train_args import build_parser
from dflash_server.tools.train_data import (
    DiskCache,
    OnTheFly,
    estimate_cache_bytes,
    load_documents,
    make_windows,
)
from dflash_server.tools.train_families import resolve_family
from dflash_server.tools.train_forward import TrainBatch, position_weights

# Kept in a subfolder: load_draft reads every *.safetensors at the checkpoint's top level.
STATE_DIR, STATE_JSON, STATE_WEIGHTS = "training", "trainer_state.json", "state.safetensors"


def _schedule(args: argparse.Namespace) -> Any:
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 25)
    decay = optim.cosine_decay(args.lr, max(1, args.steps - warmup), args.lr * args.min_lr_ratio)
    return optim.join_schedules([optim.linear_schedule(0.0, args.lr, warmup), decay], [warmup])


def _validate(args: argparse.Namespace) -> None:
    checks = [
        ("--steps", args.steps >= 1, ">= 1"),
        ("--batch-size", args.batch_size >= 1, ">= 1"),
        ("--anchors", args.anchors >= 1, ">= 1"),
        ("--lr", args.lr > 0, "> 0"),
        ("--max-seconds", args.max_seconds is None or args.max_seconds > 0, "> 0"),
        ("--eval-prompts", args.eval_prompts >= 0, ">= 0"),
    ]
    for flag, ok, rule in checks:
        if not ok:
            raise ValueError(f"{flag} must be {rule}")
    if not args.resume:
        check_out(Path(args.out).expanduser(), args.force, " (--resume continues that run)")


def _eval_tau(model: nn.Module, draft: Drafter, prompts: np.ndarray, n: int) -> float:
    return decode(model, draft, [p.tolist() for p in prompts], n).tau


class Trainer:
    def __init__(self, args: argparse.Namespace, log: Any = print):
        from dflash_server.models.loading import load

        self.family = resolve_family(args)
        _validate(args)
        self.args, self.log, self.out = args, log, Path(args.out).expanduser()
        self.model, self.tokenizer = load(
            str(resolve_model(args.target, "target", TARGET_PATTERNS))
        )
        docs = load_documents(args.data, self.tokenizer)
        eos = self.tokenizer.eos_token_id
        windows = make_windows(docs, args.seq_len, eos)
        n_eval = args.eval_prompts
        if len(windows) < n_eval + 1:
            tokens = sum(len(d) for d in docs)
            raise ValueError(
                f"not enough training text in --data {args.data}: {len(docs)} document(s), "
                f"{tokens} tokens make {len(windows)} window(s) of --seq-len {args.seq_len}; "
                f"need at least {n_eval + 1} ({n_eval} held out for --eval-prompts)"
            )
        self.train_windows = windows[: len(windows) - n_eval]
        eval_len = min(args.eval_prompt_len, args.seq_len)
        self.eval_prompts = windows[len(windows) - n_eval :, :eval_len]
        mx.random.seed(args.seed)  # fresh weights are a function of --seed: runs are repeatable
        self.draft: Any  # the family's drafter (a DFlash or DSpark drafter, a head)
        self.draft, self.config, self.init_dtype = self.family.init(
            args, self.model, self.tokenizer, self.train_windows
        )
        cfg = self.draft.config
        self.B = cfg.block_size
        if args.seq_len < self.B + 1:
            raise ValueError(f"--seq-len {args.seq_len} must be > the block size {self.B}")
        self.K = min(args.anchors, args.seq_len - self.B)
        self.target = TargetModel(self.model, cfg.target_layer_ids)
        use_target, final = args.labels == "target", self.family.final
        if args.hidden_states == "cache":
            folder = Path(args.cache_dir or self.out / "hidden_cache").expanduser()
            self.source: Any = DiskCache(folder, self.train_windows, use_target, final=final)
            rows = len(cfg.target_layer_ids) + final  # the final state is one more row
            size = estimate_cache_bytes(self.train_windows, rows, cfg.hidden_size)
            log(f"hidden-state cache: {folder} ({size / 2**20:.1f} MiB)")
            if self.source.build(self.target, str(args.target)):
                log("hidden-state cache built")
        else:
            self.source = OnTheFly(self.target, self.train_windows, use_target, final)
        gamma = args.loss_gamma if args.loss_gamma is not None else self.family.gamma(self.B)
        self.weights = position_weights(self.B, gamma)
        self.optimizer = optim.AdamW(learning_rate=_schedule(args), weight_decay=args.weight_decay)
        self.optimizer.init(self.draft.trainable_parameters())
        self.step = 0
        self.history: dict[str, list[dict[str, Any]]] = {"eval": [], "train": []}
        if args.resume:
            self._load_state()

    # -- state --------------------------------------------------------------------------------

    def _load_state(self) -> None:
        meta_file = self.out / STATE_DIR / STATE_JSON
        if not meta_file.exists():
            raise FileNotFoundError(f"--resume: no {STATE_DIR}/{STATE_JSON} in {self.out}")
        meta = json.loads(meta_file.read_text())
        if meta.get("family", "mtp" if "text" in meta["config"] else "dflash") != self.family.name:
            raise ValueError(
                f"--resume: --out holds a --family {meta.get('family')} run, not {self.family.name}"
            )
        if meta["config"] != self.config:
            old, new = meta["config"], self.config
            keys = sorted(k for k in {*old, *new} if old.get(k) != new.get(k))
            raise ValueError(
                f"--resume: the drafter config in --out differs from this run's in {keys}: "
                "resume with the flags that started it"
            )
        arrays = load_arrays(self.out / STATE_DIR / STATE_WEIGHTS)
        params = [(k[6:], v) for k, v in arrays.items() if k.startswith("param.")]
        trainable = {k for k, _ in flat_arrays(self.draft.trainable_parameters())}
        if {k for k, _ in params} != trainable:
            raise ValueError(f"--resume: the state in {self.out} is not of this drafter's shape")
        self.draft.load_weights(params, strict=False)  # frozen copies come with --init
        opt = [(k[4:], v) for k, v in arrays.items() if k.startswith("opt.")]
        self.optimizer.state = tree_unflatten(opt)
        self.step, self.history = meta["step"], meta["history"]
        self.log(f"resumed at step {self.step}")

    def save(self) -> None:
        """The published layout of the family (config.json, weights, a card) in ``--out``."""
        save_dtype = self.args.save_dtype or self.init_dtype
        args, family, evals = self.args, self.family, self.history["eval"]
        lines = [
            f"Trained with `dflash-serve train --family {family.name}` for target "
            f"`{args.target}` on `{args.data}`: {self.step} steps, labels from the {args.labels}.",
        ]
        if evals:
            lines.append(f"Held-out greedy tau: {evals[0]['tau']:.2f} -> {evals[-1]['tau']:.2f}.")
        config = {**self.config, "torch_dtype": save_dtype}
        card = family.card(lines, config)
        family.save(self.draft, self.out, config, card, getattr(mx, save_dtype), self.model)
        self._save_state()

    def _save_state(self) -> None:
        """The fp32 trainable weights, optimizer state, step and history (``--resume``)."""
        arrays = {f"param.{k}": v for k, v in flat_arrays(self.draft.trainable_parameters())}
        arrays.update({f"opt.{k}": v for k, v in flat_arrays(self.optimizer.state)})
        (self.out / STATE_DIR).mkdir(exist_ok=True)
        mx.save_safetensors(str(self.out / STATE_DIR / STATE_WEIGHTS), arrays)
        meta = {"step": self.step, "family": self.family.name, "config": self.config,
                "history": self.history}  # fmt: skip
        (self.out / STATE_DIR / STATE_JSON).write_text(json.dumps(meta, indent=1))

    # -- loop ---------------------------------------------------------------------------------

    def _batch(self, step: int) -> TrainBatch:
        """Deterministic in (seed, step), so a resumed run sees the batches it would have seen."""
        rng = np.random.default_rng([self.args.seed, step])
        n, T = self.train_windows.shape
        if isinstance(self.source, DiskCache):
            rows = self.source.shard_rows(rng, self.args.batch_size)
        else:
            rows = rng.choice(n, size=self.args.batch_size, replace=n < self.args.batch_size)
        anchors = np.stack(
            [1 + rng.choice(T - self.B, size=self.K, replace=False) for _ in rows]
        ).astype(np.int32)
        tokens, labels, taps, final = self.source.batch(rows)
        return TrainBatch(tokens, labels, taps, mx.array(anchors), final)

    def evaluate(self) -> float | None:
        if not len(self.eval_prompts):
            return None
        tau = _eval_tau(self.model, self.draft, self.eval_prompts, self.args.eval_tokens)
        self.history["eval"].append({"step": self.step, "tau": round(tau, 4)})
        self.log(f"step {self.step}: held-out tau {tau:.3f}")
        return tau

    def run(self) -> dict[str, Any]:
        args = self.args
        loss_grad = nn.value_and_grad(self.draft, self.family.make_loss(args, self.model))
        if self.step == 0 or not self.history["eval"]:
            self.evaluate()
        bar = None
        if not args.quiet:
            from tqdm import tqdm

            bar = tqdm(total=args.steps, initial=self.step, desc="train", file=sys.stderr)
        start, tokens, loss_v = time.perf_counter(), 0, float("nan")
        paused = 0.0  # seconds of evaluations and checkpoints: not training time
        window_loss: list[float] = []
        while self.step < args.steps:
            batch = self._batch(self.step)
            (loss, acc, accepted), grads = loss_grad(self.draft, batch, self.weights)
            grads, _ = optim.clip_grad_norm(grads, args.grad_clip)
            self.optimizer.update(self.draft, grads)
            mx.eval(self.draft.parameters(), self.optimizer.state, loss, acc, accepted)
            self.step += 1
            tokens += batch.tokens.size
            loss_v = loss.item()
            window_loss.append(loss_v)
            rate = tokens / (time.perf_counter() - start)
            if bar is not None:
                bar.set_postfix(
                    loss=f"{loss_v:.3f}", acc=f"{acc.item():.2f}",
                    acc_len=f"{accepted.item():.2f}", tok_s=f"{rate:.0f}",
                )  # fmt: skip
                bar.update(1)
            spent = time.perf_counter() - start - paused
            out_of_time = args.max_seconds is not None and spent >= args.max_seconds
            done = self.step == args.steps or out_of_time
            if self.step % 10 == 0 or done:
                self.history["train"].append(
                    {"step": self.step, "loss": round(float(np.mean(window_loss)), 4),
                     "acc": round(acc.item(), 4), "accepted": round(accepted.item(), 4)}
                )  # fmt: skip
                window_loss.clear()
            if done:  # the final evaluation and checkpoint follow
                break
            mark = time.perf_counter()
            if args.eval_every and self.step % args.eval_every == 0:
                self.evaluate()
            if args.save_every and self.step % args.save_every == 0:
                self.save()
            paused += time.perf_counter() - mark
        if bar is not None:
            bar.close()
        seconds = time.perf_counter() - start
        if not self.history["eval"] or self.history["eval"][-1]["step"] != self.step:
            self.evaluate()
        self.save()
        evals = self.history["eval"]
        return {
            "steps": self.step,
            "train_seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
            "final_loss": round(loss_v, 4),
            "tau_before": evals[0]["tau"] if evals else None,
            "tau_after": evals[-1]["tau"] if evals else None,
            "out": str(self.out),
        }


def train(argv: Sequence[str], log: Any = print) -> dict[str, Any]:
    """Parse ``argv`` like the CLI and train; returns the summary (raises on bad input)."""
    return Trainer(build_parser().parse_args(list(argv)), log).run()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        trainer = Trainer(args)  # checks --out, loads the target and the data
        if (hint := blas_hint()) is not None:  # a step runs about 3x slower without it
            print(f"dflash-serve train: warning: {hint}", file=sys.stderr)
        summary = trainer.run()
    except (ValueError, FileNotFoundError, ModelLoadError) as exc:
        print(f"dflash-serve train: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=1))
    return 0
