"""Several models (``--models``): what loading one costs the streams already running on another,
and what switching models costs against starting a server cold.

Two chat models A and B (random ``qwen3_5`` targets of ``--hidden``/``--layers``, built offline,
no drafter) in a models file, served by the ``ModelSet`` that ``dflash-serve --models`` builds:

    stall   a stream runs on A while B loads (its first load, which measures B's costs, then
            reloads with them cached): the gaps between two of A's passes during B's load vs
            its normal gap (the median outside loads). Target: worst gap <= one pass of A plus
            one piece of B's load (a first load's pieces: about two of B's own plain steps,
            or two of its cycles), and never over A's own worst gap outside loads.
    switch  a budget (--max-model-memory) that holds one of them: with A loaded and idle, a
            request for B waits for A's unload and B's load; its time to first token vs a
            cold start: a new ``dflash-serve --target B`` process until its first token.

A's passes are timed on the worker (each of its rounds with a running stream is one pass),
not through HTTP. Example (tiny models; figures vary on a shared machine, so loads repeat):
    python benchmarks/bench_model_switch.py
    python benchmarks/bench_model_switch.py --hidden 256 --layers 8 --reloads 5 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx

from common import write_json
from dflash_server.engine.jobs import Failed, Finished, Job
from dflash_server.engine.models import ModelSet
from dflash_server.generation.request import GenerationRequest
from dflash_server.generation.sampling import SamplingParams
from dflash_server.models_file import read_models_file
from dflash_server.serve.models import build_models
from dflash_server.settings import Settings
from dflash_server.testing import build_target

PROMPT = tuple(range(5, 37))


def models_file(folder: Path, targets: dict[str, Path]) -> Path:
    path = folder / "models.toml"
    path.write_text(
        "".join(
            f'[[models]]\nid = "{name}"\ntarget = "{target}"\nmax_kv_memory = "16MiB"\n'
            for name, target in targets.items()
        )
    )
    return path


def model_set(path: Path, calibration: Path, budget: str) -> ModelSet:
    settings = Settings.load(
        models=str(path), prefix_cache=False, max_model_memory=budget,
        calibration_cache=str(calibration),
    )  # fmt: skip
    return build_models(settings, read_models_file(path, settings))


async def loaded(models: ModelSet, name: str) -> float:
    """Lease ``name`` until it is loaded; the seconds that took (the lease is kept)."""
    slot = models.find(name)
    assert slot is not None
    start = time.perf_counter()
    await models.wait_loaded(slot, models.lease(slot))
    return time.perf_counter() - start


async def first_token(models: ModelSet, name: str, max_tokens: int = 8) -> float:
    """A request for ``name`` from its arrival: seconds until its first token."""
    start = time.perf_counter()
    await loaded(models, name)
    slot = models.find(name)
    assert slot is not None and slot.engine is not None
    job = Job(GenerationRequest(PROMPT, max_tokens, SamplingParams(temperature=0.0)))
    slot.engine.submit(job)
    first = None
    while (events := await job.next_events()) and not any(
        isinstance(e, Finished | Failed) for e in events
    ):
        first = first or time.perf_counter()
    models.release(slot)
    return (first or time.perf_counter()) - start


class PassClock:
    """The end of each of a chat model's rounds (one pass with a running stream)."""

    def __init__(self, engine: Any) -> None:
        self.stamps: list[float] = []
        real = engine.round_once

        def timed() -> None:
            real()
            self.stamps.append(time.perf_counter())

        engine.round_once = timed

    def gaps(self, start: float = 0.0, end: float = float("inf")) -> list[float]:
        """Gaps between two passes that end inside [start, end]."""
        pairs = zip(self.stamps, self.stamps[1:])
        return [b - a for a, b in pairs if start <= b <= end]


async def keep_streaming(models: ModelSet, name: str, stop: asyncio.Event) -> None:
    """One request always running on ``name`` until ``stop``."""
    slot = models.find(name)
    assert slot is not None and slot.engine is not None
    while not stop.is_set():
        job = Job(GenerationRequest(PROMPT, 400, SamplingParams(temperature=0.0)))
        slot.engine.submit(job)
        while not stop.is_set() and (events := await job.next_events()):
            if any(isinstance(e, Finished | Failed) for e in events):
                break
        job.cancel()


async def stall(folder: Path, calibration: Path, reloads: int) -> dict[str, Any]:
    models = model_set(models_file(folder, TARGETS), calibration, "0")
    models.start()
    await loaded(models, "a")
    a, b = models.find("a"), models.find("b")
    assert a is not None and a.engine is not None and b is not None
    clock, stop = PassClock(a.engine), asyncio.Event()
    streaming = asyncio.create_task(keep_streaming(models, "a", stop))
    loads, windows = [], []
    try:
        await asyncio.sleep(1.0)
        for i in range(1 + reloads):
            begin = time.perf_counter()
            seconds = await loaded(models, "b")
            end = time.perf_counter()
            models.release(b)
            windows.append((begin, end))
            gaps = clock.gaps(begin, end + 0.001)
            loads.append(
                {
                    "load": "first (measures costs)" if i == 0 else "reload (costs cached)",
                    "load_s": round(seconds, 3),
                    "worst_gap_ms": round(1000 * max(gaps, default=0.0), 1),
                    "gaps": gaps,
                    "passes": len(gaps),
                }
            )
            assert models.ask_unload(b) is None
            await models.wait_unloaded(b)
            await asyncio.sleep(0.5)
    finally:
        stop.set()
        await streaming
        models.stop()
    outside = [
        b - a
        for a, b in zip(clock.stamps, clock.stamps[1:])
        if not any(start <= b <= end + 0.001 for start, end in windows)
    ]
    normal = statistics.median(outside)
    for row in loads:  # against A's normal gap, known once every load is over
        row["worst_over_normal"] = round(row["worst_gap_ms"] / (1000 * normal), 2)
        row["gaps_over_2x"] = sum(g > 2 * normal for g in row.pop("gaps"))
    return {
        "normal_gap_ms": round(1000 * normal, 1),
        "normal_p99_gap_ms": round(1000 * statistics.quantiles(outside, n=100)[-1], 1),
        "normal_worst_gap_ms": round(1000 * max(outside), 1),
        "loads": loads,
    }


async def switch(folder: Path, calibration: Path, budget: str, repeats: int) -> dict[str, Any]:
    models = model_set(models_file(folder, TARGETS), calibration, budget)
    models.start()
    times: dict[str, list[float]] = {"a": [], "b": []}
    try:
        await first_token(models, "a")  # both measured once (costs cached), kernels warm
        await first_token(models, "b")
        for _ in range(repeats):
            for name in ("a", "b"):
                times[name].append(await first_token(models, name))
                other = models.find("b" if name == "a" else "a")
                assert other is not None and other.state == "unloaded", "the budget holds both"
        warm = [await first_token(models, "b") for _ in range(3)]
    finally:
        models.stop()
    switches = times["a"] + times["b"]
    return {
        "switch_first_token_s": round(statistics.median(switches), 3),
        "switch_worst_s": round(max(switches), 3),
        "loaded_first_token_s": round(statistics.median(warm), 3),
    }


def cold_start(target: Path, calibration: Path) -> float:
    """Seconds from spawning ``dflash-serve --target`` to its first token."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        sys.executable, "-m", "dflash_server.cli", "--target", str(target), "--port", str(port),
        "--no-prefix-cache", "--max-kv-memory", "16MiB", "--calibration-cache", str(calibration),
    ]  # fmt: skip
    start = time.perf_counter()
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None:
                raise RuntimeError(f"dflash-serve exited with {server.returncode}: {command}")
            time.sleep(0.02)
        body = {"prompt": list(PROMPT), "max_tokens": 1, "temperature": 0}
        httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status()
        return time.perf_counter() - start
    finally:
        server.terminate()
        server.wait(30)


TARGETS: dict[str, Path] = {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=64, help="hidden size of A and B")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, help="embedding rows (default: the tokenizer's)")
    parser.add_argument("--reloads", type=int, default=3, help="reloads of B after its first")
    parser.add_argument("--switches", type=int, default=3, help="A->B->A rounds timed")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for i, name in enumerate(("a", "b")):
            TARGETS[name] = build_target(
                root / name, hidden_size=args.hidden, num_hidden_layers=args.layers,
                vocab_size=args.vocab, seed=i,
            )  # fmt: skip
        size = sum(f.stat().st_size for f in TARGETS["a"].glob("*.safetensors"))
        budget = str(int(1.5 * (size + 16 * 2**20)))  # one model with its KV budget, not two
        calibration = root / "calibration"
        stalls = asyncio.run(stall(root, calibration, args.reloads))
        switches = asyncio.run(switch(root, calibration, budget, args.switches))
        colds = [cold_start(TARGETS["b"], calibration) for _ in range(2)]
    results = {
        "models": f"qwen3_5 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}",
        "weights_mb": round(size / 2**20, 2),
        "stall": stalls,
        "switch": {**switches, "cold_start_first_token_s": round(min(colds), 3)},
    }
    print(
        f"A's normal gap between passes: {stalls['normal_gap_ms']} ms (p99 "
        f"{stalls['normal_p99_gap_ms']} ms, worst {stalls['normal_worst_gap_ms']} ms)"
    )
    for row in stalls["loads"]:
        print(
            f"  B {row['load']}: {row['load_s']} s; A's worst gap {row['worst_gap_ms']} ms "
            f"({row['worst_over_normal']}x normal; {row['gaps_over_2x']} of {row['passes']} "
            "gaps over 2x)"
        )
    s = results["switch"]
    print(
        f"switch (unload + load + first token): median {s['switch_first_token_s']} s, worst "
        f"{s['switch_worst_s']} s; loaded: {s['loaded_first_token_s']} s; cold start of a "
        f"new dflash-serve: {s['cold_start_first_token_s']} s"
    )
    if args.json:
        write_json(args.json, results)


if __name__ == "__main__":
    main()
