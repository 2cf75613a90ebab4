"""``dflash-serve bench``: does DFlash help on this machine, and with which settings?

Loads a target and drafter (a preset, ``--config``, or ``--target``/``--draft``) exactly as the
server does (draft window, cost measurement), then decodes a few prompts (built in: code, math,
chat; or ``--prompt``/``--prompts``) with plain decoding and with DFlash at each block setting
(default: a fixed 16 and ``auto``), interleaved so that machine noise hits every mode alike.
Prints a table: decode tokens/s and the speedup over plain, tau, TTFT, the time split (prefill,
draft, verify, rollback per cycle), the share of tokens decoded plainly, the block sizes used,
and a verdict; ``--json`` prints the same as JSON for scripts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_server.cli_parser import Parser
from dflash_server.tools.bench_noise import ratio_cell, verdict

PROMPTS = {
    "code": "Write a Python function that parses an ISO 8601 date string into a datetime "
    "without using dateutil, with type hints, a docstring and doctests.",
    "math": "A train leaves at 9:40 and travels 210 km at 84 km/h, then 95 km at 76 km/h. "
    "When does it arrive? Reason step by step, then give the time.",
    "chat": "I have a week in Portugal in October. Suggest an itinerary with a few days in "
    "Lisbon and a couple of places outside it, and what to pack.",
}


DEFAULT_MODES = "plain,16,auto"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="dflash-serve bench",
        description="Plain decoding vs DFlash (fixed and auto block sizes) on this machine, on "
        "built-in prompts (code, math, chat) or your own.",
    )
    p.add_argument("--config", help="preset name or TOML/JSON settings file (as dflash-serve)")
    p.add_argument("--target", help="target model: hub id or local MLX folder")
    p.add_argument("--draft", help="DFlash drafter: hub id or local folder")
    p.add_argument("--prompt", action="append", default=[], help="your own prompt (repeatable)")
    p.add_argument("--prompts", type=Path, help="file of prompts: one per line, or .jsonl")
    p.add_argument("--no-builtin", action="store_true", help="only your own prompts")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per answer")
    p.add_argument(
        "--modes",
        default=DEFAULT_MODES,
        help="comma separated: plain, auto, or block sizes (default: plain,16,auto)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        help="runs per prompt and mode: medians and their range (default: 1; 3 with "
        "--concurrency, where each run is one burst of every prompt)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--draft-window", type=int, help="as dflash-serve --draft-window")
    p.add_argument("--raw", action="store_true", help="prompts as raw text, no chat template")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument(
        "--concurrency",
        metavar="N[,N...]",
        help="what N clients at once get (e.g. 1,4,8): the server's engine, N requests at a "
        "time, plain batched decoding vs speculation (modes default to plain,auto)",
    )
    return p


@dataclass
class Run:
    """One decode: what the table reports."""

    tokens: int
    decode_s: float
    ttft_s: float
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return max(self.tokens - 1, 0) / self.decode_s if self.decode_s > 0 else 0.0


def read_prompts(args: argparse.Namespace) -> dict[str, str]:
    prompts = {} if args.no_builtin else dict(PROMPTS)
    for i, text in enumerate(args.prompt, 1):
        prompts[f"own{i}"] = text
    if args.prompts is not None:
        for i, line in enumerate(args.prompts.read_text().splitlines(), 1):
            if not line.strip():
                continue
            text = line
            if args.prompts.suffix == ".jsonl":
                item = json.loads(line)
                text = item.get("prompt") or item.get("text") if isinstance(item, dict) else item
            prompts[f"file{i}"] = str(text)
    if not prompts:
        raise SystemExit("dflash-serve bench: error: no prompts (drop --no-builtin or add some)")
    return prompts


def encode(tokenizer: Any, text: str, raw: bool) -> list[int]:
    from dflash_server.generation.text import encode as encode_text

    if not raw and getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    return encode_text(tokenizer, text)


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    for m in modes:
        if m not in ("plain", "auto") and not m.isdigit():
            raise SystemExit(f"dflash-serve bench: error: unknown mode {m!r} (plain, auto, N)")
    return modes


def decode_once(models: Any, prompt: list[int], mode: str, args: argparse.Namespace) -> Run:
    from dflash_server.generation.request import GenerationRequest, block_policy, trained_block
    from dflash_server.generation.sampling import SamplingParams
    from dflash_server.generation.stream import generate

    draft = None if mode == "plain" else models.pair.draft
    request = GenerationRequest(
        tuple(prompt),
        args.max_tokens,
        SamplingParams(temperature=args.temperature),
        seed=0,
        block=block_policy(
            trained_block(draft), "auto" if mode == "auto" else _int(mode), clamp=True
        ),
    )
    start = time.perf_counter()
    first, tokens, last = None, 0, None
    for response in generate(models.pair, request):
        first = first or time.perf_counter()
        tokens += len(response.tokens)
        last = response
    end = time.perf_counter()
    stats = last.stats.as_dict() if last is not None and last.stats is not None else {}
    return Run(tokens, end - (first or end), (first or end) - start, stats)


def _int(mode: str) -> int | None:
    return int(mode) if mode.isdigit() else None


def profile_split(models: Any, prompt: list[int], mode: str, max_tokens: int) -> dict[str, float]:
    """Per-cycle milliseconds of each phase, from one profiled (phase-by-phase) run."""
    from dflash_server.generation.request import GenerationRequest, block_policy, trained_block
    from dflash_server.generation.stream import generate

    draft = None if mode == "plain" else models.pair.draft
    block = block_policy(trained_block(draft), "auto" if mode == "auto" else _int(mode), clamp=True)
    request = GenerationRequest(tuple(prompt), max_tokens, block=block)
    responses = list(generate(models.pair, request, profile=True))
    stats = responses[-1].stats if responses else None
    if stats is None or not stats.cycles:
        return {}
    return {k: round(1e3 * v / stats.cycles, 2) for k, v in (stats.timings or {}).items()}


def summarize(runs: dict[str, dict[str, list[Run]]], modes: list[str]) -> list[dict[str, Any]]:
    """One row per mode: medians over prompts and repeats (speedup: per prompt, then median),
    and each run's ratio to the plain run it was interleaved with (the run's noise)."""
    rows = []
    for mode in modes:
        per_prompt = runs[mode]
        all_runs = [r for rs in per_prompt.values() for r in rs]
        rate = {p: statistics.median(r.tokens_per_s for r in rs) for p, rs in per_prompt.items()}
        plain = runs.get("plain", {})
        speedups = [
            rate[p] / statistics.median(r.tokens_per_s for r in plain[p])
            for p in rate
            if plain.get(p)
        ]
        paired = [
            run.tokens_per_s / base.tokens_per_s
            for p, rs in per_prompt.items()
            for run, base in zip(rs, plain.get(p, []))
            if base.tokens_per_s > 0
        ]
        sizes: Counter[int] = Counter()
        for r in all_runs:
            sizes.update({b: n for b, n in enumerate(r.stats.get("block_size_histogram", []))})
        rows.append(
            {
                "mode": mode,
                "tokens_per_s": round(statistics.median(rate.values()), 2),
                "speedup": round(statistics.median(speedups), 3) if speedups else None,
                "speedup_by_prompt": {p: round(s, 3) for p, s in zip(rate, speedups)},
                "speedup_runs": [round(x, 3) for x in paired],
                "tau": round(statistics.median(r.stats.get("tau", 1.0) for r in all_runs), 3),
                "ttft_s": round(statistics.median(r.ttft_s for r in all_runs), 4),
                "plain_share": round(
                    statistics.median(r.stats.get("plain_share", 1.0) for r in all_runs), 3
                ),
                "block_sizes": {b: n for b, n in sorted(sizes.items()) if n},
            }
        )
    return rows


def table(result: dict[str, Any]) -> str:
    head = ["mode", "tok/s", "vs plain", "tau", "TTFT s", "plain %", "draft ms", "verify ms",
            "rollback ms", "step ms", "block sizes"]  # fmt: skip
    lines = [" | ".join(head), " | ".join("-" * len(h) for h in head)]
    for r in result["rows"]:
        split = result["split_ms"].get(r["mode"], {})
        sizes = ", ".join(f"{b}:{n}" for b, n in r["block_sizes"].items()) or "-"
        cells = [
            r["mode"], f"{r['tokens_per_s']:.1f}", ratio_cell(r), f"{r['tau']:.2f}",
            f"{r['ttft_s']:.3f}", f"{100 * r['plain_share']:.0f}",
            *(str(split.get(k, "-")) for k in ("draft", "verify", "rollback", "plain")), sizes,
        ]  # fmt: skip
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from dflash_server.config_files import SettingsError
    from dflash_server.engine.blas import blas_hint
    from dflash_server.engine.loader import (
        TARGET_PATTERNS,
        ModelLoadError,
        load_models,
        resolve_draft,
        resolve_model,
    )
    from dflash_server.settings import Settings

    if args.concurrency and args.modes == DEFAULT_MODES:
        args.modes = "plain,auto"
    if args.repeats is None:  # a burst mixes the prompts: only repeats show its noise
        args.repeats = 3 if args.concurrency else 1
    if args.repeats < 1:
        raise SystemExit(f"dflash-serve bench: error: --repeats {args.repeats}: give 1 or more")
    modes = parse_modes(args.modes)
    levels = None
    if args.concurrency:
        from dflash_server.tools.bench_clients import parse_levels

        levels = parse_levels(args.concurrency)
    prompts = read_prompts(args)
    if (hint := blas_hint()) is not None:  # the figures below would be MLX's slowest
        print(f"dflash-serve bench: warning: {hint}", file=sys.stderr)
    try:
        settings = Settings.load(config=args.config, target=args.target, draft=args.draft)
        target = resolve_model(str(settings.target), "target", TARGET_PATTERNS)
        draft = resolve_draft(settings.drafter)
        window = args.draft_window if args.draft_window is not None else settings.draft_window
        models = load_models(str(target), draft, draft_window=window,
                             target_label=settings.target, draft_label=settings.drafter,
                             calibration_cache=settings.calibration_folder)  # fmt: skip
    except (SettingsError, ModelLoadError, ValueError) as exc:
        print(f"dflash-serve bench: error: {exc}", file=sys.stderr)
        return 2
    from huggingface_hub.utils import tqdm

    if models.pair.draft is not None:  # fixed widths as they run: clamped to the drafter's block
        trained = int(models.pair.draft.config.block_size)
        modes = list(dict.fromkeys(m if not m.isdigit() else str(max(2, min(int(m), trained)))
                                   for m in modes))  # fmt: skip
    encoded = {
        name: encode(models.pair.tokenizer, text, args.raw) for name, text in prompts.items()
    }
    first = next(iter(encoded.values()))
    decode_once(models, first[:64], "auto", argparse.Namespace(**{**vars(args), "max_tokens": 8}))
    if levels is not None:
        return _bench_clients(models, list(encoded.values()), levels, modes, args, settings)
    runs: dict[str, dict[str, list[Run]]] = {m: {p: [] for p in encoded} for m in modes}
    total = len(modes) * len(encoded) * args.repeats
    with tqdm(total=total, desc="bench", unit="run", file=sys.stderr, leave=False) as bar:
        for _ in range(args.repeats):
            for name, ids in encoded.items():
                for mode in modes:  # interleaved: noise hits every mode alike
                    bar.set_postfix_str(f"{name} {mode}")
                    runs[mode][name].append(decode_once(models, ids, mode, args))
                    bar.update()
    split = {m: profile_split(models, first, m, min(args.max_tokens, 64)) for m in modes}
    summary = models.summary
    result = {
        "target": summary.target,
        "draft": summary.draft,
        "draft_family": summary.draft_family or "DFlash",
        "draft_window": summary.draft_window,
        "cycle_costs": summary.cycle_costs,
        "max_tokens": args.max_tokens,
        "prompts": list(encoded),
        "rows": summarize(runs, modes),
        "split_ms": split,
    }
    result["verdict"] = verdict(result["rows"])
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"target {result['target']} + {result['draft_family']} drafter {result['draft']}")
    print(f"{result['cycle_costs']}")
    print(f"prompts: {', '.join(result['prompts'])}; {args.max_tokens} tokens each, "
          f"{'greedy' if args.temperature == 0 else f'temperature {args.temperature}'}")  # fmt: skip
    print(table(result))
    print(result["verdict"])
    return 0


def _bench_clients(
    models: Any, prompts: list[list[int]], levels: list[int], modes: list[str],
    args: argparse.Namespace, settings: Any,
) -> int:  # fmt: skip
    from dflash_server.tools.bench_clients import clients_table, clients_verdict, run_clients

    rows = run_clients(models, prompts, levels, modes, args, settings)
    summary = models.summary
    result = {"target": summary.target, "draft": summary.draft, "max_tokens": args.max_tokens,
              "rows": rows, "verdict": clients_verdict(rows)}  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"target {summary.target} + drafter {summary.draft}; {args.max_tokens} tokens per "
          f"client, {len(prompts)} prompts in turn, batching {settings.batching}, up to "
          f"{rows[0]['max_active']} at once (the rest queue)")  # fmt: skip
    print(clients_table(rows))
    print(result["verdict"])
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
