"""Concurrent streams: interleaved cycles vs the batched engine vs mlx-lm's plain BatchGenerator.

On one target (default: a random ~100M fp32 ``qwen3_5``, as ``bench_adaptive.py``), for each
``--tau`` (the replaying test double commits ``tau`` tokens per full cycle, real drafter pass
paid) and each number of concurrent ``--streams`` (greedy, block_size "auto" as the server
runs it), three modes run the same requests:

* ``interleave``: each stream's own decoder, one cycle each in turn (the engine before batching);
* ``batched``: one ``BatchDecoder`` pass per round for all streams (``generation/batch.py``);
* ``mlx-batch``: mlx-lm's ``BatchGenerator``, plain batched decoding (no speculation).

Rounds interleave the modes; reported: total tok/s (all streams' tokens over the wall time,
prefills included; ``decode_tok_s``: from the moment every stream has its first token), p50/p95
of the gap between a stream's consecutive token arrivals (a
speculative cycle's tokens arrive together: one gap), medians and paired ratios per round.
Every stream's tokens must equal plain greedy. Then the stall test: 3 streams run while a
``--long``-token prompt prefills in ``--chunk``-token chunks; the largest gap of the 3 streams
is compared with the longest engine round while it prefills (one chunk plus one pass, or plus
one cycle of each stream when interleaving).

    LD_PRELOAD=/lib/x86_64-linux-gnu/libopenblas.so.0 \\
        python benchmarks/bench_concurrency.py --json /tmp/concurrency.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, generate_step

from common import PROMPT, bench_target, published_drafter, write_json
from dflash_server import load
from dflash_server.adaptive.controller import BlockController, SharedPrior
from dflash_server.generation.batch import BatchDecoder
from dflash_server.generation.calibrate import measure_costs
from dflash_server.generation.calibrate_passes import measure_pass_costs
from dflash_server.generation.cycle import PREFILL_CHUNK
from dflash_server.generation.row import Row
from dflash_server.generation.sampling import SamplingParams, TokenSampler
from dflash_server.generation.speculative import LoneRows
from dflash_server.generation.target import TargetModel
from dflash_server.testing import ReplayDrafter

MODES = ("interleave", "batched", "mlx-batch")


class Setup:
    def __init__(self, args: argparse.Namespace) -> None:
        self.tmp = tempfile.TemporaryDirectory()
        path = args.target or bench_target(Path(self.tmp.name) / "t")
        self.model, tokenizer = load(str(path))
        self.prompt = list(tokenizer.encode(PROMPT))
        self.inner = published_drafter(self.model, block_size=16)
        self.target = TargetModel(self.model, self.inner.config.target_layer_ids)
        self.costs = measure_costs(self.model, self.inner)
        # The verify budget, as the engine measures it at load.
        self.pass_costs = measure_pass_costs(self.target, self.inner)
        self.n = args.tokens
        steps = generate_step(mx.array(self.prompt), self.model, max_tokens=self.n + 16)
        self.reference = [t for t, _ in steps]
        self.prior = SharedPrior()

    def rows(self, mode: str) -> BatchDecoder | LoneRows:
        """The engine's rows for ``mode``: one batch, or each stream alone."""
        return BatchDecoder(self.target, costs=self.pass_costs) if mode == "batched" else LoneRows()

    def replay(self, tau: int) -> ReplayDrafter:
        """The drafter of a run's rows: rows that share it draft in one pass, as the real
        drafter's rows do (each row keeps its own cycle count)."""
        return ReplayDrafter(self.prompt + self.reference, [tau - 1], self.inner)

    def row(self, draft: ReplayDrafter, prefill_step_size: int = 2048) -> Row:
        policy = BlockController(16, self.costs.copy(), prior=self.prior)
        return Row(
            self.target, draft, TokenSampler(SamplingParams(), 0), policy,
            prefill_step_size=prefill_step_size,
        )  # fmt: skip


def run(setup: Setup, mode: str, streams: int, tau: int) -> dict:
    n, prompt = setup.n, setup.prompt
    arrivals: list[list[tuple[float, int]]] = [[] for _ in range(streams)]
    tokens: list[list[int]] = [[] for _ in range(streams)]
    start = time.perf_counter()
    if mode == "mlx-batch":
        gen = BatchGenerator(setup.model, max_tokens=n, completion_batch_size=streams)
        uids = gen.insert([prompt] * streams)
        left = set(uids)
        while left:
            for r in gen.next_generated():
                i = uids.index(r.uid)
                tokens[i].append(r.token)
                arrivals[i].append((time.perf_counter(), 1))
                if r.finish_reason is not None:
                    left.discard(r.uid)
        gen.close()
    else:
        draft = setup.replay(tau)
        rows = [setup.row(draft) for _ in range(streams)]
        driver = setup.rows(mode)
        for row in rows:
            driver.add(row, prompt, n)
        while driver.busy:  # as the engine's round
            for row, commit in driver.step().items():
                assert not isinstance(commit, Exception), commit
                i = rows.index(row)
                if commit.tokens:
                    arrivals[i].append((time.perf_counter(), len(commit.tokens)))
                    tokens[i].extend(commit.tokens)
    wall = time.perf_counter() - start
    for t in tokens:
        assert t == setup.reference[:n], f"{mode}: a stream differs from plain greedy"
    gaps = [b[0] - a[0] for a_s in arrivals for a, b in itertools.pairwise(a_s)]
    # Decode phase: once every stream has its first token (prefills done), to the end.
    begin = max(a_s[0][0] for a_s in arrivals)
    end = max(a_s[-1][0] for a_s in arrivals)
    later = sum(k for a_s in arrivals for t, k in a_s if t > begin)
    return {
        "tok_s": streams * n / wall,
        "decode_tok_s": later / max(end - begin, 1e-9),
        "gap_p50_ms": 1e3 * statistics.median(gaps),
        "gap_p95_ms": 1e3 * statistics.quantiles(gaps, n=20)[-1],
    }


def stall(setup: Setup, mode: str, long: int, chunk: int, tau: int) -> dict:
    """3 running streams while a ``long``-token prompt prefills: their largest gap."""
    arrivals: list[list[tuple[float, int]]] = [[] for _ in range(3)]
    long_prompt = [(7 * i) % 1000 + 3 for i in range(long)]
    draft = setup.replay(tau)
    rows = [setup.row(draft) for _ in range(3)]
    driver = setup.rows(mode)
    for row in rows:
        driver.add(row, setup.prompt, 10**6)
    # Warm the streams up, then add the long prompt and run until its first token.
    long_row = setup.row(draft, prefill_step_size=chunk)
    rounds, long_started, done = 0, 0.0, False
    round_s: list[float] = []  # rounds while the long prompt prefills
    chunks = 0
    while not done:
        if rounds == 8:
            driver.add(long_row, long_prompt, 1)
            long_started = time.perf_counter()
        t0 = time.perf_counter()
        outcomes = driver.step()
        now = time.perf_counter()
        for row, commit in outcomes.items():
            assert not isinstance(commit, Exception), commit
            if row is long_row:
                chunks += 1
                done = commit is not PREFILL_CHUNK
            elif commit.tokens:
                arrivals[rows.index(row)].append((now, len(commit.tokens)))
        if long_row in outcomes:
            round_s.append(now - t0)
        rounds += 1
    for row in rows:
        driver.remove(row)
    gaps = [
        b[0] - a[0] for a_s in arrivals for a, b in itertools.pairwise(a_s) if b[0] >= long_started
    ]
    return {
        "largest_gap_ms": round(1e3 * max(gaps), 1),
        "round_ms_max": round(1e3 * max(round_s), 1),
        "within_bound": max(gaps) <= max(round_s) * 1.05,
        "chunks": chunks,
    }


def paired(rounds: dict[str, list[dict]], a: str, b: str, key: str = "tok_s") -> float:
    """Median over rounds of a/b within a round (machine load drifts between rounds)."""
    ratios = [x[key] / y[key] for x, y in zip(rounds[a], rounds[b])]
    return round(statistics.median(ratios), 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", help="mlx-lm model (default: build a random ~100M qwen3_5)")
    ap.add_argument("--tau", type=int, nargs="*", default=[1, 4, 8])
    ap.add_argument("--streams", type=int, nargs="*", default=[1, 2, 4, 8])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--long", type=int, default=16384, help="stall test prompt (0: skip)")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    setup = Setup(args)
    print(setup.costs.describe(), flush=True)
    print(setup.pass_costs.describe(), flush=True)
    results: dict = {"costs": setup.costs.as_dict(), "rows": [], "stall": {}}
    for tau in args.tau:
        for streams in args.streams:
            for mode in MODES:  # warm-up
                run(setup, mode, streams, tau)
            rounds = {m: [] for m in MODES}
            for _ in range(args.rounds):
                for mode in MODES:
                    rounds[mode].append(run(setup, mode, streams, tau))
            med = {m: {k: round(statistics.median(r[k] for r in rs), 2) for k in rs[0]}
                   for m, rs in rounds.items()}  # fmt: skip

            row = {
                "tau": tau,
                "streams": streams,
                **{m: med[m] for m in MODES},
                "batched_vs_interleave": paired(rounds, "batched", "interleave"),
                "batched_vs_mlx_batch": paired(rounds, "batched", "mlx-batch"),
                "decode_batched_vs_mlx_batch": paired(
                    rounds, "batched", "mlx-batch", "decode_tok_s"
                ),
            }
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
    if args.long:
        for mode in ("interleave", "batched"):
            results["stall"][mode] = stall(setup, mode, args.long, args.chunk, 4)
            print(json.dumps({"stall": mode, **results["stall"][mode]}), flush=True)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
