"""Quantized KV cache: peak memory of a prefill + 64-token decode, with and without --kv-bits.

For each ``--lengths`` prompt (random token ids) and each ``--bits`` setting ("none" = full
precision), two runs, each from ``mx.clear_cache()`` + ``mx.reset_peak_memory()``:

* ``dflash``: ours (``stream_generate``, a published-shape drafter, block 16, greedy, the
  server's default drafter window);
* ``mlx-lm``: mlx-lm's own ``generate_step`` with the same ``kv_bits``;

both with ``--kv-group-size`` and ``quantized_kv_start=0`` (quantized from the first chunk on)
and 2048-token prefill chunks. Reported: ``mx.get_peak_memory()`` (MB), what it adds over the
weights (and, for ours, the drafter), the attention KV the context holds at the end
(``bytes_per_position`` x tokens), wall time. ``--target small`` is the tiny hybrid test target
with 64-wide heads (fast enough for 32k on a CPU), else the ~100M fp32 benchmark target.

    LD_PRELOAD=/lib/x86_64-linux-gnu/libopenblas.so.0 \\
        python benchmarks/bench_kv_memory.py --lengths 8192 --json /tmp/kv.json
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step

from common import bench_target, published_drafter
from dflash_server.drafters.window import DEFAULT_WINDOW
from dflash_server.generation.kv_memory import bytes_per_position, kv_geometry
from dflash_server.generation.stream import stream_generate
from dflash_server.testing import build_target

MB = 1e6


def run(impl: str, model: Any, draft: Any, tokenizer: Any, ids: list[int], bits: int | None,
        group: int, decode: int) -> tuple[list[int], float, float]:  # fmt: skip
    """Tokens, peak memory (bytes) and seconds of one prefill + decode."""
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    start = time.perf_counter()
    if impl == "dflash":
        out = stream_generate(model, draft, tokenizer, ids, 16, max_tokens=decode, kv_bits=bits,
                              kv_group_size=group, quantized_kv_start=0)  # fmt: skip
        tokens = [t for r in out for t in r.tokens]
    else:
        steps = generate_step(mx.array(ids), model, max_tokens=decode, kv_bits=bits,
                              kv_group_size=group, quantized_kv_start=0)  # fmt: skip
        tokens = [int(t) for t, _ in steps]
    return tokens, mx.get_peak_memory(), time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", choices=["bench", "small"], default="bench")
    ap.add_argument("--lengths", type=int, nargs="*", default=[8192, 32768])
    ap.add_argument("--bits", nargs="*", default=["none", "8", "4"])
    ap.add_argument("--kv-group-size", type=int, default=64)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--impls", nargs="*", default=["dflash", "mlx-lm"])
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp()) / "target"
    if args.target == "bench":
        path = bench_target(folder)
    else:
        path = build_target(folder, text_overrides={"head_dim": 64})
    model, tokenizer = load(str(path))
    draft = published_drafter(model)
    draft.set_window(DEFAULT_WINDOW)  # as the server runs it: sinks + the newest positions
    mx.eval(model.parameters(), draft.parameters())
    weights = sum(v.nbytes for _, v in _leaves(model.parameters()))
    drafter = sum(v.nbytes for _, v in _leaves(draft.parameters()))
    geometry = kv_geometry(model)
    assert geometry is not None, "a target whose cache layout kv_memory.py knows"
    print(f"target {args.target}: weights {weights / MB:.0f} MB, drafter {drafter / MB:.0f} MB, "
          f"{geometry.kv_elements} K/V elements per position")  # fmt: skip
    warm = list(range(1, 300))
    for impl in args.impls:  # compile and allocate once before measuring
        for bits_text in args.bits:
            bits = None if bits_text == "none" else int(bits_text)
            run(impl, model, draft, tokenizer, warm, bits, args.kv_group_size, 4)
    rows = []
    for n in args.lengths:
        ids = mx.random.randint(0, 4000, (n,), key=mx.random.key(n)).tolist()
        reference: dict[str, list[int]] = {}
        for bits_text in args.bits:
            bits = None if bits_text == "none" else int(bits_text)
            for impl in args.impls:
                tokens, peak, seconds = run(impl, model, draft, tokenizer, ids, bits,
                                            args.kv_group_size, args.decode)  # fmt: skip
                held = weights + (drafter if impl == "dflash" else 0)
                per = bytes_per_position(geometry, kv_bits=bits, group_size=args.kv_group_size)
                kv = per * (n + args.decode)
                same = reference.setdefault(bits_text, tokens) == tokens
                row = {"tokens": n, "bits": bits_text, "impl": impl, "peak_mb": peak / MB,
                       "over_weights_mb": (peak - held) / MB, "kv_mb": kv / MB,
                       "seconds": seconds, "same_tokens": same}  # fmt: skip
                rows.append(row)
                print(f"{n:>6} bits {bits_text:>4} {impl:>7}: peak {peak / MB:8.0f} MB "
                      f"(+{(peak - held) / MB:7.0f} over weights), KV {kv / MB:6.1f} MB, "
                      f"{seconds:6.1f} s, tokens equal mlx-lm's: {same}", flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def _leaves(tree: Any) -> list[tuple[str, mx.array]]:
    from mlx.utils import tree_flatten

    return tree_flatten(tree)


if __name__ == "__main__":
    main()
