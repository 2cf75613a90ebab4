"""Every drafter family against plain decoding at 1, 4 and 8 streams, suffix drafts on and off,
and the same families on a memory-bound proxy target.

1. **Trained** (``--stages fit measure``): the distilled stdlib pair's target (``distill_stdlib.py``'s
   recipe, reused by import: a 1.1M qwen3 target trained on Python stdlib text with repeat tasks)
   and one drafter per family trained for it by ``dflash-serve train`` with the same time budget
   (``--train-seconds`` each): DFlash, DSpark, EAGLE-3 and the MTP head. Then, greedy, on
   held-out windows, at each of ``--streams`` concurrent streams (rows of the engine's
   ``BatchDecoder``, as the server runs them): plain decoding and each family under ``auto``;
   tau (committed tokens per target pass) and decode tok/s, with the ratio to plain paired
   within each repeat. Every family's tokens must equal plain decoding's.
2. **Suffix drafts on and off**: the server's default (DFlash + suffix drafts) against
   ``--no-suffix-drafts`` (DFlash alone) as two pairs with their own evidence, each serving the
   same sequence: copy-heavy requests (held-out lines, then "# now repeat it"), then requests
   with nothing to copy (held-out windows); tok/s of each part against plain, paired.
3. **A memory-bound proxy** (``--stages proxy``): on these cores a 16-token verify of the tiny
   target costs several 1-token passes, where on Apple GPUs it costs about one. A random
   Qwen3.5-shaped fp32 target (``--proxy-hidden``, ``--proxy-layers``) is measured first (the
   ratio of a 16-token verify to a 1-token pass is reported with its size), then each family's
   random drafter (random weights accept ~nothing: this measures what drafting costs when it
   does not pay, which ``auto`` must keep near plain) at 1 and 4 streams.

Modes alternate within each repeat; medians are reported. ``--reuse`` keeps WORK's trained
models (stages recorded in WORK/trained.json).

    LD_PRELOAD=/lib/x86_64-linux-gnu/libopenblas.so.0 python benchmarks/bench_families.py \\
        --work /tmp/families --json /tmp/families/result.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm

from bench_mtp import Runner, copy_workload, groups, run_stages
from common import write_json
from dflash_server.drafters.registry import load_drafter
from dflash_server.generation.request import BlockPolicy
from dflash_server.generation.target import TargetModel
from dflash_server.tools.train import train
from distill_stdlib import add_recipe_args, prepare_target, prompts_from, read, stdlib_files

FAMILIES = ("dflash", "dspark", "eagle3", "mtp")


# -- training -----------------------------------------------------------------------------------


def train_family(args: argparse.Namespace, family: str, target: Path, data: Path, out: Path):
    """``dflash-serve train --family F`` for ``--train-seconds``: the same budget for each."""
    argv = ["--target", str(target), "--data", str(data), "--out", str(out)]
    # The budget ends the run; --steps only sets the schedule: a short warm-up, then the peak
    # rate held (a cosine over 100000 steps barely moves in a few thousand).
    argv += ["--family", family, "--max-seconds", str(args.train_seconds)]
    argv += ["--steps", "100000", "--warmup", "20"]
    argv += ["--batch-size", str(args.draft_batch), "--seq-len", "256"]
    argv += ["--eval-prompts", "4", "--eval-tokens", "96"]
    if family in ("dflash", "dspark"):
        argv += ["--layers", str(args.draft_layers), "--anchors", str(args.anchors)]
        argv += ["--lr", str(args.draft_lr)]
    else:
        argv += ["--lr", str(args.head_lr)]
    if family == "dflash":
        argv += ["--block-size", str(args.block_size)]
    return train(argv)


def prepare(args: argparse.Namespace) -> dict:
    """WORK's target and one drafter per family, each stage recorded as it ends."""
    saved = args.work / "trained.json"
    result: dict = json.loads(saved.read_text()) if args.reuse and saved.exists() else {}
    target_dir, data_dir = args.work / "target", args.work / "data"
    stages: dict[str, Any] = {
        "target": lambda: prepare_target(
            args, stdlib_files(args.holdout_every)[0], target_dir, data_dir, result
        )
    }
    for family in FAMILIES:
        stages[family] = lambda f=family: result.update(
            {f: train_family(args, f, target_dir, data_dir, args.work / f)}
        )
    return run_stages(stages, result, saved)


# -- measuring ----------------------------------------------------------------------------------


def timed(runner: Runner, modes: dict, names: list[str], prompts, n: int, streams: int, rep: int):
    """Every prompt once, ``streams`` at a time, under each mode: each group of prompts runs
    under every mode at once, their passes in turn (``Runner.run_paired``), so a slow moment of
    the machine falls on all modes alike. Mode -> (outputs, totals)."""
    keys = ("tokens", "seconds", "committed", "cycles", "suffix")
    out = {m: ([[] for _ in prompts], dict.fromkeys(keys, 0.0)) for m in names}
    for g, group in enumerate(groups(prompts, streams)):
        paired = runner.run_paired(
            {m: modes[m] for m in names}, [prompts[i] for i in group], n, rep + g
        )
        for mode, (got_outs, got) in paired.items():
            outs, total = out[mode]
            for i, tokens in zip(group, got_outs):
                outs[i] = tokens
            for k in keys:
                total[k] += got[k]
    return out


def copy_prompts(held: list[str], model: Any, tokenizer: Any, n: int) -> list[list[int]]:
    """``n`` copy-heavy prompts (``bench_mtp.copy_workload``) whose greedy answer does not end
    at its first token (the tiny target ends some at once: those would time nothing)."""

    def ends(prompt: list[int]) -> bool:
        logits = model(mx.array([prompt]))[0, -1]
        return int(mx.argmax(logits).item()) in tokenizer.eos_token_ids

    return [p for p in copy_workload(held, tokenizer, 4 * n)[0] if not ends(p)][:n]


def row(streams: int, workload: str, mode: str, totals: list[dict], plain: list[dict]) -> dict:
    rates = [t["tokens"] / t["seconds"] for t in totals]
    base = [t["tokens"] / t["seconds"] for t in plain]
    ratios = [a / b for a, b in zip(rates, base)]
    return {
        "streams": streams,
        "workload": workload,
        "mode": mode,
        "tau": round(statistics.median(t["committed"] / t["cycles"] for t in totals), 3),
        "suffix_share": round(statistics.median(t["suffix"] / t["committed"] for t in totals), 3),
        "tok_s": round(statistics.median(rates), 1),
        "vs_plain": round(statistics.median(ratios), 3),
        "range": [round(min(ratios), 3), round(max(ratios), 3)],
    }


def measure_families(args, runner: Runner, prompts, widths: dict[str, int]) -> list[dict]:
    """Plain and each family (``auto``) at every stream count, alternating within repeats."""
    modes = {"plain": (None, BlockPolicy(1))}
    modes |= {f: (f, BlockPolicy(widths[f], auto=True)) for f in runner.pairs if f in widths}
    for name, block in modes.values():  # warm-up: kernels, allocations
        runner.run(name, block, prompts[:1], 16)
    reference: dict[int, list[int]] = {}
    sums: dict[tuple[int, str], list[dict]] = {}
    for rep in range(args.repeats):
        for streams in args.streams:
            results = timed(runner, modes, list(modes), prompts, args.gen_tokens, streams, rep)
            for mode, (outs, total) in results.items():
                for i, out in enumerate(outs):
                    assert out == reference.setdefault(i, out), f"{mode} changed the output"
                sums.setdefault((streams, mode), []).append(total)
        print(f"repeat {rep + 1}/{args.repeats} done", flush=True)
    rows = [row(s, "held-out", m, t, sums[(s, "plain")]) for (s, m), t in sums.items()]
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


def measure_suffix(args, runner: Runner, copies, fresh, width: int) -> list[dict]:
    """The default server (DFlash + suffix drafts) vs --no-suffix-drafts, each its own pair
    serving copy-heavy requests then nothing-to-copy ones, at 4 streams; plain alongside."""
    s = args.suffix
    modes = {
        "plain": (None, BlockPolicy(1)),
        "default": ("dflash", BlockPolicy(width, auto=True, suffix=s)),
        "no-suffix": ("dflash-no-suffix", BlockPolicy(width, auto=True)),
    }
    sums: dict[tuple[str, str], list[dict]] = {}
    for rep in range(args.repeats):
        for workload, (prompts, n) in (("copy", copies), ("nothing to copy", fresh)):
            for mode, (_, total) in timed(runner, modes, list(modes), prompts, n, 4, rep).items():
                sums.setdefault((workload, mode), []).append(total)
    rows = [row(4, w, m, t, sums[(w, "plain")]) for (w, m), t in sums.items()]
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


# -- the memory-bound proxy ---------------------------------------------------------------------


def verify_ratio(model: Any, width: int = 16, repeats: int = 5) -> dict[str, float]:
    """Seconds of a ``width``-token verify over those of a 1-token pass, both after a 200-token
    context, through the server's own target adapter (a verify records the recurrent states a
    rollback needs); best of ``repeats``."""
    target = TargetModel(model, ())

    def best(n: int) -> float:
        out = float("inf")
        for _ in range(repeats):
            cache = target.make_cache()
            mx.eval(target.forward(mx.array([list(range(1, 201))]), cache, slice(-1, None))[0])
            rollback = target.make_rollback(cache)
            start = time.perf_counter()
            with rollback.recording() if n > 1 else contextlib.nullcontext():
                logits, _ = target.forward(mx.array([list(range(5, 5 + n))]), cache, slice(None))
            mx.eval(logits, *[c.state for c in cache if c.state is not None])
            out = min(out, time.perf_counter() - start)
        return out

    one, wide = best(1), best(width)
    return {"one_ms": round(one * 1e3, 1), f"w{width}_ms": round(wide * 1e3, 1),
            "ratio": round(wide / one, 2)}  # fmt: skip


def proxy(args: argparse.Namespace) -> dict:
    """A random Qwen3.5-shaped fp32 target with its MTP head, and a random drafter of every
    family for it; the verify ratio, then each family at 1 and 4 streams vs plain."""
    from mlx.utils import tree_flatten

    from dflash_server.drafters.mtp import load_mtp
    from dflash_server.testing import build_target, random_drafter
    from dflash_server.testing.layouts import write_dspark, write_eagle3

    H, L = args.proxy_hidden, args.proxy_layers
    folder = args.work / f"proxy-{H}x{L}"
    if not (folder / "config.json").exists():
        heads = {"num_attention_heads": H // 128, "num_key_value_heads": max(1, H // 512),
                 "head_dim": 128, "linear_num_value_heads": H // 128,
                 "linear_num_key_heads": H // 256, "linear_key_head_dim": 128,
                 "linear_value_head_dim": 128}  # fmt: skip
        build_target(folder, arch="qwen3_5", hidden_size=H, num_hidden_layers=L,
                     vocab_size=8192, mtp=True, text_overrides=heads)  # fmt: skip
    model, tokenizer = mlx_lm.load(str(folder))
    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    out: dict[str, Any] = {"hidden": H, "layers": L, "params_m": round(params / 1e6, 1)}
    out["verify"] = verify_ratio(model)
    print("proxy:", json.dumps(out), flush=True)
    drafts = {
        "dflash": random_drafter(model, shape="published"),
        "dspark": load_drafter(write_dspark(args.work / "proxy-dspark", model, rank=256), model),
        "eagle3": load_drafter(write_eagle3(args.work / "proxy-eagle3", model), model),
        "mtp": load_mtp(folder, model),
    }
    widths = {f: d.config.block_size for f, d in drafts.items()}
    runner = Runner(model, tokenizer, drafts, args.suffix)
    text = read(stdlib_files(args.holdout_every)[1], 10**9)
    prompts = [p[:64] for p in prompts_from(text, tokenizer, 4, 64)]
    saved = args.streams, args.gen_tokens
    args.streams, args.gen_tokens = [1, 4], args.proxy_tokens
    out["rows"] = measure_families(args, runner, prompts, widths)
    args.streams, args.gen_tokens = saved
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/dflash-families"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--reuse", action="store_true", help="keep WORK's trained models")
    ap.add_argument(
        "--stages", nargs="*", default=["fit", "measure", "suffix", "proxy"],
        choices=["fit", "measure", "suffix", "proxy"],
        help="fit: train the target and the drafters; measure: the trained families; suffix: "
        "suffix drafts on and off; proxy: the memory-bound proxy",
    )  # fmt: skip
    add_recipe_args(ap)
    ap.add_argument("--train-seconds", type=float, default=600, help="training budget per family")
    ap.add_argument("--head-lr", type=float, default=3e-3, help="EAGLE-3 and MTP heads' lr")
    ap.add_argument("--copy-tokens", type=int, default=64, help="tokens per copy answer")
    ap.add_argument("--suffix", type=int, default=32, help="longest suffix copy verified")
    ap.add_argument("--streams", type=int, nargs="*", default=[1, 4, 8])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--proxy-hidden", type=int, default=2048)
    ap.add_argument("--proxy-layers", type=int, default=4)
    ap.add_argument("--proxy-tokens", type=int, default=32)
    ap.set_defaults(target_steps=600, regen=32, copy_share=0.25, prompts=8)
    args = ap.parse_args()
    mx.random.seed(0)
    result: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    if {"fit", "measure", "suffix"} & set(args.stages):
        result["trained"] = prepare(args)
    if "measure" in args.stages or "suffix" in args.stages:
        model, tokenizer = mlx_lm.load(str(args.work / "target"))
        drafts = {f: load_drafter(args.work / f, model) for f in FAMILIES}
        drafts["dflash-no-suffix"] = drafts["dflash"]  # a second pair: its own evidence
        widths = {f: d.config.block_size for f, d in drafts.items()}
        held = read(stdlib_files(args.holdout_every)[1], 10**9)
        fresh = prompts_from(held, tokenizer, args.prompts, args.prompt_len)
        copies = copy_prompts(held, model, tokenizer, args.prompts)
        runner = Runner(model, tokenizer, drafts, args.suffix)
        if "measure" in args.stages:
            result["families"] = measure_families(
                args, runner, fresh, {f: w for f, w in widths.items() if f in FAMILIES}
            )
    if "suffix" in args.stages:
        result["suffix"] = measure_suffix(
            args, runner, (copies, args.copy_tokens), (fresh, args.gen_tokens), widths["dflash"]
        )
    if "proxy" in args.stages:
        result["proxy"] = proxy(args)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
