"""Compile MLX's CPU kernels once, before any test times a server start.

On the CPU backend MLX compiles each fused graph with the system's C++ compiler the first time
it runs, and keeps the library in its folder under the temporary directory. A fresh machine (or
``TMPDIR``) therefore pays about a minute of compiling on the first load, which a test server's
start limit would count. ``tests/conftest.py`` runs this once per temporary directory, before
the test workers start: it loads the tiny pair as a server does (the cycle and batched-pass
measurements), then decodes a few requests of each kind, and leaves a marker beside MLX's
kernels (docs/development.md, "Tests").

Run by hand: ``python tests/warm_kernels.py`` (idempotent; it prints what it took).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"


def marker() -> Path:
    """Where a finished warm-up is recorded: next to MLX's kernel folder, in the temporary
    directory, so a fresh one starts cold again."""
    import mlx.core as mx

    return Path(tempfile.gettempdir()) / f"dflash-server-kernels-{mx.__version__}"


def warm() -> float:
    import mlx.core as mx

    from dflash_server import stream_generate
    from dflash_server.adaptive.policy import FixedBlock
    from dflash_server.engine.loader import load_models, make_batch
    from dflash_server.generation.row import Row
    from dflash_server.generation.sampling import SamplingParams, TokenSampler
    from dflash_server.testing import build_target

    sys.path.insert(0, str(Path(__file__).parent))
    from server_fixtures import build_draft

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        target = build_target(Path(folder) / "target", arch="qwen3_5")
        draft = build_draft(Path(folder) / "draft", target)
        models = load_models(str(target), str(draft), suffix_tokens=32)  # the cycle costs
        batch = make_batch(models, None)  # the batched passes' costs
        pair = models.pair
        ids = pair.tokenizer.encode("def fibonacci(n):\n    return n")
        sampled = {"temperature": 0.8, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05}
        for block, kw in (("auto", {}), (8, sampled), (None, {"logprobs": 3})):
            draft_model = pair.draft if block is not None else None
            for _ in stream_generate(pair.model, draft_model, pair.tokenizer, ids, block,
                                     max_tokens=24, **kw):  # fmt: skip
                pass
        for width in (1, 4):  # batched passes of two rows, plain and drafted
            for _ in range(2):
                draft_model = pair.draft if width > 1 else None
                row = Row(
                    pair.target, draft_model, TokenSampler(SamplingParams()), FixedBlock(width)
                )
                batch.add(row, ids, 12)
            while batch.busy:
                batch.step()
        mx.clear_cache()
    return time.perf_counter() - start


def main() -> int:
    seconds = warm()
    marker().write_text(f"{seconds:.1f}\n")
    print(f"MLX kernels warmed in {seconds:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
