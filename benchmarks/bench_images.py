"""Images: time to first token of a one-image request, and decode speed on the text after it,
against mlx-vlm (plain vision-language decoding) on the same checkpoint and image.

The checkpoint is a random fp32 Qwen3.5 vision-language fixture (``dflash_server.testing.
vision``): the benchmark target's text model (hidden 768, 12 layers, 32k vocabulary) with a
vision tower of 6 blocks of 256; the image is 448x448 (196 image tokens) after a short
question.

* TTFT: from the PIL image and the rendered prompt to the first token: the processor, the
  tower, the prefill and the first sample. Ours through the Python API as the server runs one
  request alone: plain, and with the published-shape drafter (its prefill also feeds the
  drafter's context); mlx-vlm's ``stream_generate`` with ``max_tokens=1``.
* decode: tokens/s after the first token, greedy: mlx-vlm, ours plain, ours with DFlash (the
  replaying test double at ``--pattern`` acceptance beside the published-shape random drafter,
  whose pass runs for real, so the cost is a real drafter's).

Modes are interleaved round by round and reported as medians and paired ratios (median over
rounds of a/b within a round: a shared machine's load drifts). Every mode's greedy output must
equal mlx-vlm's.

    LD_PRELOAD=$(ldconfig -p | awk '/libopenblas.so.0 /{print $NF; exit}') \\
      .venv/bin/python benchmarks/bench_images.py --json /tmp/bench_images.json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from common import decode_rate, paired, published_drafter, write_json
from dflash_server import load, stream_generate
from dflash_server.generation.text import encode
from dflash_server.models.vision import expand_pads, load_vision
from dflash_server.testing import ReplayDrafter
from dflash_server.testing.vision import build_vision_target

QUESTION = "Describe this picture in detail, then list the objects you can see in it."


def first_token_seconds(steps: Any) -> tuple[float, int]:
    """Seconds until a generator's first item, and that item's first token."""
    start = time.perf_counter()
    first = next(steps)
    seconds = time.perf_counter() - start
    steps.close()
    return seconds, first.tokens[0] if hasattr(first, "tokens") else first.token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--pattern", type=int, nargs="+", default=[7], help="replayed accepts")
    parser.add_argument("--folder", type=Path, default=None, help="keep the checkpoint here")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from mlx_vlm.generate import stream_generate as vlm_stream
    from mlx_vlm.utils import load as vlm_load

    folder = args.folder or Path(tempfile.mkdtemp()) / "vl-bench"
    if not (folder / "config.json").exists():
        build_vision_target(folder, hidden_size=768, num_hidden_layers=12, vocab_size=32000,
                            vision_depth=6, vision_hidden_size=256, max_pixels=448 * 448)  # fmt: skip
    model, tokenizer = load(folder)
    vision = load_vision(folder)
    assert vision is not None
    vlm = vlm_load(str(folder))
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (448, 448, 3), dtype=np.uint8))
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    drafter = published_drafter(model)
    n = args.tokens

    def ours(draft: Any, **kw: Any) -> Any:
        return stream_generate(model, draft, tokenizer, text, max_tokens=n, images=[image],
                               vision=vision, **kw)  # fmt: skip

    def theirs(max_tokens: int = n) -> Any:
        return vlm_stream(*vlm, text, image=[image], max_tokens=max_tokens, temperature=0.0)

    reference = [r.token for r in theirs()][:n]
    picture = vision.prepare(image)
    ids = expand_pads(encode(tokenizer, text), vision.tokens.image, [vision.count(picture)])

    def dflash() -> Any:  # a fresh double per run: it counts its cycles
        return ReplayDrafter(ids + reference, args.pattern, drafter)

    ttft: dict[str, Callable[[], Any]] = {
        "mlx-vlm": lambda: theirs(1),
        "ours plain": lambda: ours(None),
        "ours + drafter": lambda: ours(drafter),
    }
    decode: dict[str, Callable[[], Any]] = {
        "mlx-vlm": theirs,
        "ours plain": lambda: ours(None),
        "ours DFlash": lambda: ours(dflash(), block_size=16),
    }
    times: dict[str, list[float]] = {k: [] for k in ttft}
    rates: dict[str, list[float]] = {k: [] for k in decode}
    for run in ttft.values():  # warm-up: compiled kernels, first allocations
        first_token_seconds(run())
    for _ in range(args.rounds):
        for name, run in ttft.items():
            seconds, token = first_token_seconds(run())
            assert token == reference[0], name
            times[name].append(seconds)
        for name, run in decode.items():
            tokens, rate = decode_rate(run())
            assert tokens[:n] == reference, name
            rates[name].append(rate)
    result = {
        "image_tokens": vision.count(picture),
        "prompt_tokens": len(ids),
        "ttft_ms": {k: round(1000 * statistics.median(v), 1) for k, v in times.items()},
        "ttft_speed_vs_mlx_vlm": {
            k: paired({"a": times["mlx-vlm"], "b": v}, "a", "b") for k, v in times.items()
        },
        "decode_tps": {k: round(statistics.median(v), 2) for k, v in rates.items()},
        "decode_vs_mlx_vlm": {k: paired(rates, k, "mlx-vlm") for k in rates},
        "decode_dflash_vs_ours_plain": paired(rates, "ours DFlash", "ours plain"),
        "tokens": n,
        "rounds": args.rounds,
        "pattern": args.pattern,
    }
    for key, value in result.items():
        print(f"{key}: {value}")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
