"""What the benchmark scripts share: the prompt, the benchmark target, the published-shape random
drafter, timing helpers, and JSON results that say which commit, machine and date they come from.

The scripts import it as ``from common import ...``: Python puts a script's own folder first on
``sys.path``, so ``python benchmarks/bench_x.py`` finds it from any directory.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step

from dflash_server.drafters.dflash import DFlashDraftModel
from dflash_server.testing import build_target, random_drafter

PROMPT = "def fibonacci(n: int) -> int:\n    # return the n-th Fibonacci number\n"


def bench_target(folder: Path) -> Path:
    """The benchmark target: a random ~100M-parameter fp32 ``qwen3_5`` (hybrid: Gated DeltaNet
    and full attention; hidden 768, 12 layers, 32k vocabulary) written to ``folder``."""
    return build_target(folder, hidden_size=768, num_hidden_layers=12, vocab_size=32000)


def published_drafter(
    model: Any, block_size: int = 16, mask_id: int | None = None
) -> DFlashDraftModel:
    """A random drafter of the published shape (5 layers, taps spread over the target), bound to
    ``model``: it accepts ~nothing, but its pass costs what a real drafter's does."""
    return random_drafter(model, shape="published", block_size=block_size, mask_id=mask_id)


def timed(fn: Callable[[], Any], repeats: int = 7) -> float:
    """Median seconds of ``repeats`` calls after a warm-up call (a per-call figure)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_rate(steps: Iterable[Any]) -> tuple[list[int], float]:
    """Tokens and decode tokens/s of a generator of commits or responses (each with ``.tokens``,
    or one ``.token`` as mlx-vlm's), timed from the first one on, so the prefill is excluded."""
    tokens: list[int] = []
    start = None
    for step in steps:
        if start is None:
            start = time.perf_counter()
        tokens.extend(step.tokens if hasattr(step, "tokens") else [step.token])
    return tokens, (len(tokens) - 1) / (time.perf_counter() - start)


def mlx_lm_plain(model: Any, prompt: list[int], n: int) -> tuple[list[int], float]:
    """mlx-lm's own greedy ``generate_step``: the reference tokens and its decode tokens/s."""
    tokens, start = [], None
    for i, (tok, _) in enumerate(generate_step(mx.array(prompt), model, max_tokens=n)):
        tokens.append(tok)
        if i == 0:
            start = time.perf_counter()  # exclude prefill
    return tokens, (n - 1) / (time.perf_counter() - start)


def paired(rates: dict[str, list[float]], a: str, b: str) -> float:
    """Median over rounds of a/b within a round (a shared machine's load drifts between rounds)."""
    return round(statistics.median(x / y for x, y in zip(rates[a], rates[b])), 3)


def run_info() -> dict[str, Any]:
    """Where a result comes from: commit (``+dirty`` with local changes), machine, date."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        try:
            out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        except OSError:
            return ""
        return out.stdout.strip() if out.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    preload = os.environ.get("LD_PRELOAD", "")
    return {
        "commit": commit,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores",
        "processor": _processor(),
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "openblas": "openblas" in preload,
    }


def _processor() -> str | None:
    """The CPU's name (``platform.processor()`` is empty on most Linux machines)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or None


def write_json(path: Path | None, result: Any) -> None:
    """Write ``result`` (a dict gains a ``run`` key; anything else goes under ``results``)."""
    if path is None:
        return
    body = (
        {"run": run_info(), **result}
        if isinstance(result, dict)
        else {
            "run": run_info(),
            "results": result,
        }
    )
    path.write_text(json.dumps(body, indent=2))
