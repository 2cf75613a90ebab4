"""Images: time to first token of a one-image request, and decode speed on the text after it,
against mlx-vlm (plain vision-language decoding) on the same checkpoint and image.

The checkpoint is a random fp32 Qwen3.5 vision-language fixture (``dflash_server.testing.
vision``): the benchmark target's text model (hidden 768, 12 layers, 32k vocabulary) with a
vision tower of 6 blocks of 256; the image is 448x448 (196 image tokens) before a short
question.

* TTFT (wall and CPU seconds): from the decoded PIL image and the rendered prompt to the first
  token: the processor, the tower, the prefill and the first sample. Ours as the server's engine
  runs a request alone (its ``Generation`` as a row of a ``BatchDecoder``, stepped until the
  row's first token): plain, and with the published-shape drafter (its prefill also feeds the
  drafter's context); mlx-vlm's ``stream_generate(max_tokens=1)``, its first result, also with
  its Gated DeltaNet prefill run as mlx-lm runs it on a CPU ("mlx-vlm, token by token"): on
  backends without a fused kernel mlx-vlm scans the recurrence in chunks and mlx-lm (whose
  language model the server runs) steps it token by token, a difference of the two libraries'
  text models that this mode takes out, leaving what the image path itself costs.
* decode: tokens/s after the first token, greedy: mlx-vlm, ours plain, ours with DFlash (the
  replaying test double at ``--pattern`` acceptance beside the published-shape random drafter,
  whose pass runs for real, so the cost is a real drafter's), through the Python API.

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
from dflash_server.generation.batch import BatchDecoder
from dflash_server.generation.cycle import PREFILL_CHUNK
from dflash_server.generation.pair import ModelPair
from dflash_server.generation.request import GenerationRequest, block_policy, trained_block
from dflash_server.generation.stream import Generation
from dflash_server.generation.text import encode
from dflash_server.models.vision import expand_pads, load_vision
from dflash_server.testing import ReplayDrafter
from dflash_server.testing.vision import build_vision_target

QUESTION = "Describe this picture in detail, then list the objects you can see in it."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--pattern", type=int, nargs="+", default=[7], help="replayed accepts")
    parser.add_argument("--folder", type=Path, default=None, help="keep the checkpoint here")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from mlx_vlm.generate import stream_generate as vlm_stream
    from mlx_vlm.models.qwen3_5 import gated_delta as recurrence
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

    def served_ttft(draft: Any) -> tuple[float, float, int]:
        """The engine's path: the request built from the image, its row stepped in a batch."""
        start, cpu = time.perf_counter(), time.process_time()
        pair = ModelPair.of(model, tokenizer, draft, vision)
        picture = vision.prepare(image)
        ids = expand_pads(encode(tokenizer, text), vision.tokens.image, [vision.count(picture)])
        request = GenerationRequest(tuple(ids), n, block=block_policy(trained_block(draft), None),
                                    images=(picture,))  # fmt: skip
        run = Generation(pair, request, prefill_step_size=512)
        batch = BatchDecoder(pair.target)
        batch.add(run.row, run.prompt, n, run.eos_ids)
        while (outcome := batch.step()[run.row]) is PREFILL_CHUNK:
            pass
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        batch.remove(run.row)
        return seconds, cpu, outcome.tokens[0]

    def theirs(max_tokens: int = n) -> Any:
        return vlm_stream(*vlm, text, image=[image], max_tokens=max_tokens, temperature=0.0)

    def their_ttft(stepped: bool = False) -> tuple[float, float, int]:
        chunked = recurrence.gated_delta_chunked
        if stepped:  # mlx-lm's CPU recurrence: token by token
            recurrence.gated_delta_chunked = lambda q, k, v, g, beta, state, mask=None: (
                recurrence.gated_delta_ops(q, k, v, g, beta, state, mask)
            )
        try:
            start, cpu = time.perf_counter(), time.process_time()
            steps = theirs(1)
            token = next(steps).token
            seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
            steps.close()
        finally:
            recurrence.gated_delta_chunked = chunked
        return seconds, cpu, token

    def ours(draft: Any, **kw: Any) -> Any:
        return stream_generate(model, draft, tokenizer, text, max_tokens=n, images=[image],
                               vision=vision, **kw)  # fmt: skip

    reference = [r.token for r in theirs()][:n]
    picture = vision.prepare(image)
    ids = expand_pads(encode(tokenizer, text), vision.tokens.image, [vision.count(picture)])

    def dflash() -> Any:  # a fresh double per run: it counts its cycles
        return ReplayDrafter(ids + reference, args.pattern, drafter)

    ttft: dict[str, Callable[[], tuple[float, float, int]]] = {
        "mlx-vlm": their_ttft,
        "mlx-vlm, token by token": lambda: their_ttft(stepped=True),
        "ours plain": lambda: served_ttft(None),
        "ours + drafter": lambda: served_ttft(drafter),
    }
    decode: dict[str, Callable[[], Any]] = {
        "mlx-vlm": theirs,
        "ours plain": lambda: ours(None),
        "ours DFlash": lambda: ours(dflash(), block_size=16),
    }
    times: dict[str, list[float]] = {k: [] for k in ttft}
    cpu_times: dict[str, list[float]] = {k: [] for k in ttft}
    rates: dict[str, list[float]] = {k: [] for k in decode}
    for measure in ttft.values():  # warm-up: compiled kernels, first allocations
        measure()
    for _ in range(args.rounds):
        for name, measure in ttft.items():
            seconds, cpu, token = measure()
            assert token == reference[0], name
            times[name].append(seconds)
            cpu_times[name].append(cpu)
        for name, run in decode.items():
            tokens, rate = decode_rate(run())
            assert tokens[:n] == reference, name
            rates[name].append(rate)
    result = {
        "image_tokens": vision.count(picture),
        "prompt_tokens": len(ids),
        "ttft_ms": {k: round(1000 * statistics.median(v), 1) for k, v in times.items()},
        # speed = 1 / time: mlx-vlm's time over ours, within each round
        "ttft_speed_vs_mlx_vlm": {k: paired(times, "mlx-vlm", k) for k in times},
        "ttft_speed_vs_token_by_token": {
            k: paired(times, "mlx-vlm, token by token", k) for k in times
        },
        # the same in CPU seconds of this process: less sensitive to other jobs on the machine
        "ttft_cpu_ms": {k: round(1000 * statistics.median(v), 1) for k, v in cpu_times.items()},
        "ttft_cpu_speed_vs_mlx_vlm": {k: paired(cpu_times, "mlx-vlm", k) for k in cpu_times},
        "ttft_cpu_speed_vs_token_by_token": {
            k: paired(cpu_times, "mlx-vlm, token by token", k) for k in cpu_times
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
