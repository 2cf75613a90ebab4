"""Several machines: what running the ranks in lockstep costs per round.

A ~70M hybrid target (the benchmark target's shape at hidden 512) runs N rows (greedy DFlash, a fixed block of 8, the
published-shape random drafter) for R rounds: in one process, then tensor-sharded over two
ranks that ``mlx.launch`` starts on this machine (ring backend over loopback), rank 0 driving
the rows through its ``Leader`` and rank 1 following. Per round it reports the broadcast
(rank 0's frame with its decisions and every rank's memory: one ``all_sum``), its bytes, the
model's own all-reduces (how many a pass makes, and what that many ``all_sum`` of a pass's
hidden states take, chained), and the round's wall time against the one process. Both ranks
share this machine's cores, so the ratio bounds the overhead from above; a speed-up needs two
machines.

    python benchmarks/bench_distributed.py [--streams 1 4] [--rounds 20] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream

from common import PROMPT, published_drafter, write_json
from dflash_server.engine.distributed import INLINE, SLOT, Channel, world
from dflash_server.engine.lockstep import Follower, Leader
from dflash_server.generation.batch import BatchDecoder
from dflash_server.generation.pair import ModelPair
from dflash_server.generation.request import BlockPolicy, GenerationRequest
from dflash_server.generation.stream import Generation
from dflash_server.models.loading import load
from dflash_server.testing import build_target

BLOCK = 8
WARMUP = 3  # rounds before timing: every row prefilled and decoding


class TimedChannel(Channel):
    """A channel that times each exchange and keeps each message's size."""

    def __init__(self, group: Any) -> None:
        super().__init__(group)
        self.seconds: list[float] = []
        self.sizes: list[int] = []

    def exchange(self, message: bytes = b"") -> bytes:
        start = time.perf_counter()
        out = super().exchange(message)
        self.seconds.append(time.perf_counter() - start)
        self.sizes.append(len(out))
        return out


def counted(leader: Leader, batch: BatchDecoder) -> int:
    """One lockstep round, counting the collectives rank 0 issues for it (its frame's too)."""
    calls = 0
    originals = mx.distributed.all_sum, mx.distributed.all_gather

    def counting(fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            return fn(*args, **kwargs)

        return call

    mx.distributed.all_sum, mx.distributed.all_gather = map(counting, originals)
    try:
        leader.step(batch)
    finally:
        mx.distributed.all_sum, mx.distributed.all_gather = originals
    return calls


def chained_sums(
    group: Any, shape: tuple[int, ...], count: int, dtype: Any = mx.float32, repeats: int = 7
) -> float:
    """Seconds for ``count`` all_sums of ``shape``, each waiting for the previous (as a pass's
    layers do), the fastest of ``repeats`` (a busy machine only adds time); every rank calls it
    together, so no rank waits for another's compute: what the transfers themselves cost."""
    times = []
    for _ in range(repeats + 1):
        x = mx.zeros(shape, dtype)
        mx.eval(x)
        start = time.perf_counter()
        with mx.stream(generation_stream):
            for _ in range(count):
                x = mx.distributed.all_sum(x, group=group)
        mx.eval(x)
        times.append(time.perf_counter() - start)
    return min(times[1:])


def transfers(group: Any, shape: tuple[int, ...], passes: int) -> dict[str, float]:
    """The round's transfers alone: one frame, and the pass's all-reduces (``passes`` sums of
    its hidden states); every rank calls it together."""
    frame = (group.size() * SLOT + 8 + INLINE,)
    return {
        "frame_ms": 1000 * chained_sums(group, frame, 20, mx.uint8) / 20,
        "all_reduces_ms": 1000 * chained_sums(group, shape, passes),
    }


def add_rows(pair: ModelPair, batch: BatchDecoder, n: int, leader: Leader | None) -> None:
    prompt = list(pair.tokenizer.encode(PROMPT))
    for i in range(n):
        request = GenerationRequest((*prompt, i + 1), 1 << 20, block=BlockPolicy(BLOCK))
        generation = Generation(pair, request)
        batch.add(generation.row, generation.prompt, request.max_tokens, generation.eos_ids)
        if leader is not None:
            leader.added(generation.row, request)


def rounds_ms(step: Any, rounds: int) -> float:
    """Median wall time of ``rounds`` steps after the warm-up ones."""
    seconds = []
    for i in range(WARMUP + rounds):
        start = time.perf_counter()
        step()
        if i >= WARMUP:
            seconds.append(time.perf_counter() - start)
    return 1000 * statistics.median(seconds)


def measure(folder: Path, streams: list[int], rounds: int) -> dict[str, Any]:
    """Every configuration on this process: alone, or as one rank of ``mlx.launch`` (rank 0
    drives the rows and reports; the others follow)."""
    group = world()
    model, tokenizer = load(folder, group)
    drafter = published_drafter(model, block_size=BLOCK)
    pair = ModelPair.build(model, tokenizer, drafter, lockstep=group is not None)
    hidden = pair.target.parts.hidden_size
    out: dict[str, Any] = {}
    for n in streams:
        batch = BatchDecoder(pair.target)
        if group is None:
            add_rows(pair, batch, n, None)
            out[str(n)] = {"round_ms": rounds_ms(batch.step, rounds)}
            continue
        if group.rank() > 0:
            channel = Channel(group)
            Follower(pair, batch, channel, timeout_s=600, on_hang=print, prefill_step_size=2048,
                     prefix_cache=None).run()  # fmt: skip
            transfers(group, (n, BLOCK, hidden), int(channel.exchange()))
            continue
        leader = Leader(TimedChannel(group), 600, print)
        add_rows(pair, batch, n, leader)
        ms = rounds_ms(partial(leader.step, batch), rounds)
        passes = counted(leader, batch) - 1  # less the round's own frame
        leader.close()
        leader.channel.exchange(str(passes).encode())  # the followers time as many sums
        channel = leader.channel
        assert isinstance(channel, TimedChannel)
        steady = slice(WARMUP + 1, WARMUP + 1 + rounds)  # after the rounds that admit rows
        out[str(n)] = {
            "round_ms": ms,
            "message_bytes": statistics.median(channel.sizes[steady]),
            # The frame's collective also waits for the slowest rank to finish its last step.
            "frame_wait_ms": 1000 * statistics.median(channel.seconds[steady]),
            "all_reduces_per_pass": passes,
            **transfers(group, (n, BLOCK, hidden), passes),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--json", type=Path)
    p.add_argument("--rank-run", nargs=2, metavar=("TARGET", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_run:  # one rank of the two mlx.launch started
        target, out = args.rank_run
        result = measure(Path(target), args.streams, args.rounds)
        if world().rank() == 0:  # type: ignore[union-attr]
            Path(out).write_text(json.dumps(result))
        return
    folder = Path(tempfile.mkdtemp(prefix="bench-distributed-"))
    try:
        # The benchmark target's 3 KV heads do not split over 2 ranks; at hidden 512 (~70M
        # parameters) every head count does.
        target = build_target(folder / "target", hidden_size=512, num_hidden_layers=12,
                              vocab_size=32000)  # fmt: skip
        alone = measure(target, args.streams, args.rounds)
        out = folder / "ranks.json"
        launch = Path(sys.executable).parent / "mlx.launch"
        command = [str(launch), "-n", "2", "--backend", "ring", "--", sys.executable, __file__,
                   "--rank-run", str(target), str(out), "--rounds", str(args.rounds),
                   "--streams", *map(str, args.streams)]  # fmt: skip
        # Each rank gets its share of the cores for BLAS, as on machines of its own (two
        # ranks of 2 threads each on 2 cores spin against each other: ~10x slower here).
        threads = str(max(1, (os.cpu_count() or 2) // 2))
        env = {"OPENBLAS_NUM_THREADS": threads, **os.environ}
        subprocess.run(command, check=True, env=env)
        ranks = json.loads(out.read_text())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print("streams | ms/round: one process, two ranks (ratio) | frame: bytes, ms, wait ms | "
          "all-reduces per pass, ms")  # fmt: skip
    for n in map(str, args.streams):
        a, r = alone[n], ranks[n]
        print(f"{n} | {a['round_ms']:.1f}, {r['round_ms']:.1f} ({r['round_ms'] / a['round_ms']:.2f}x)"
              f" | {r['message_bytes']:.0f}, {r['frame_ms']:.2f}, {r['frame_wait_ms']:.1f} | "
              f"{r['all_reduces_per_pass']}, {r['all_reduces_ms']:.1f}")  # fmt: skip
    write_json(args.json, {"one_process": alone, "two_ranks": ranks})


if __name__ == "__main__":
    main()
