"""Prefix cache disk tier: what verifying an entry's checksum costs against the prefill it saves.

The check is paid on a RAM miss, once per entry read back. Three measurements:

    hashes   ms per MiB of the candidate checksums (one thread, in memory)
    entry    a synthetic snapshot of a real model's shape (default: Qwen3.5-4B with the published
             5-layer drafter: 8 attention layers of --kv-heads x --head-dim bf16 KV, 24 Gated
             DeltaNet layers of 2 MiB fp32 state + 48 KiB conv window per checkpoint; see
             docs/design.md), written and read back through PrefixDisk: read + verify + load,
             and the verify part alone
    model    end to end on the ~100M fp32 qwen3_5 benchmark target + drafter: TTFT of a cold
             prefill vs. a restart that restores the prompt from disk (verify time inside it)

    python benchmarks/bench_prefix_disk.py                    # 3400 and 16384 tokens
    python benchmarks/bench_prefix_disk.py --tokens 3400 --json out.json
    python benchmarks/bench_prefix_disk.py --no-model   # hashes and entries only
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import time
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import load

import dflash_server.engine.prefix_disk as prefix_disk
import dflash_server.engine.prefix_file as prefix_file
from common import bench_target, published_drafter, write_json
from dflash_server.engine.prefix_cache import PrefixCache
from dflash_server.engine.prefix_disk import PrefixDisk
from dflash_server.generation.pair import ModelPair
from dflash_server.generation.prefix import Checkpoint, PromptSnapshot
from dflash_server.generation.request import BlockPolicy, GenerationRequest
from dflash_server.generation.stream import generate
from dflash_server.testing import mask_token_id

MiB = 2**20


def best_of(fn, repeat: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def hashes(mib: int = 256) -> dict[str, float]:
    data = memoryview(np.random.default_rng(0).bytes(mib * MiB))
    candidates = {
        "sha256": lambda: hashlib.sha256(data).digest(),
        "blake2b": lambda: hashlib.blake2b(data).digest(),
        "crc32 (no collision margin)": lambda: zlib.crc32(data),
    }
    return {name: round(best_of(fn) * 1000 / mib, 3) for name, fn in candidates.items()}


def synthetic(n: int, a: argparse.Namespace) -> PromptSnapshot:
    """A snapshot of ``n`` tokens shaped like the configured model (random contents)."""

    def rand(shape, dtype=mx.bfloat16) -> mx.array:
        return mx.random.normal(shape).astype(dtype)

    attention = {i for i in range(a.layers) if i % 4 == 3}
    kv = [
        (rand((1, a.kv_heads, n, a.head_dim)), rand((1, a.kv_heads, n, a.head_dim)))
        if i in attention
        else None
        for i in range(a.layers)
    ]
    draft_kv = [(rand((1, 8, n, 128)), rand((1, 8, n, 128))) for _ in range(5)]
    gdn = a.layers - len(attention)
    checkpoints = {
        p: Checkpoint([[rand((1, 3, 8192)), rand((1, 32, 128, 128), mx.float32)]] * gdn)
        for p in np.linspace(n // a.checkpoints, n - 1, a.checkpoints).astype(int).tolist()
    }
    snapshot = PromptSnapshot(tuple(range(n)), kv, draft_kv, checkpoints)
    mx.eval(snapshot.arrays())
    return snapshot


def timed_digest() -> list[float]:
    """Wrap the disk tier's checksum (writing and reading) to collect the seconds spent in it."""
    spent: list[float] = []
    digest = prefix_file.digest

    def wrapper(*args):
        start = time.perf_counter()
        out = digest(*args)
        spent.append(time.perf_counter() - start)
        return out

    prefix_file.digest = prefix_disk.digest = wrapper
    return spent


def entry(n: int, a: argparse.Namespace, spent: list[float], digest) -> dict:
    snapshot = synthetic(n, a)
    with tempfile.TemporaryDirectory() as tmp:
        disk = PrefixDisk(tmp, 1 << 40, "bench")
        start = time.perf_counter()
        disk.save(("bench",), snapshot)
        disk.close(600)
        write = time.perf_counter() - start
        (path,) = Path(tmp).glob("*.safetensors")
        size = path.stat().st_size
        del snapshot
        disk = PrefixDisk(tmp, 1 << 40, "bench")  # a restart: the index from the header
        spent.clear()
        start = time.perf_counter()
        found = disk.lookup(("bench",), np.arange(n + 1), n, 0)
        read = time.perf_counter() - start
        assert found is not None
        verify = spent[-1]
        del found
        arrays, meta = mx.load(str(path), return_metadata=True)
        mx.eval(arrays)
        one = best_of(lambda: digest(meta, arrays, 1), 2)
        parallel = best_of(lambda: digest(meta, arrays, prefix_disk.READ_THREADS), 2)
    return {
        "tokens": n,
        "file_mib": round(size / MiB, 1),
        "write_s": round(write, 3),
        "read_verify_load_s": round(read, 3),
        "verify_s": round(verify, 3),
        "verify_ms_per_mib": round(verify * 1000 / (size / MiB), 3),
        "digest_1_thread_s": round(one, 3),
        f"digest_{prefix_disk.READ_THREADS}_threads_s": round(parallel, 3),
    }


def model_end_to_end(n: int, spent: list[float]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = bench_target(Path(tmp) / "t")
        model, tokenizer = load(str(path))
        draft = published_drafter(model, mask_id=mask_token_id(path))
        tokens = tuple(int(t) for t in np.random.default_rng(1).integers(10, 300, n))
        request = GenerationRequest(tokens, 1, block=BlockPolicy(draft.config.block_size))

        def ttft(cache) -> tuple[float, int]:
            start = time.perf_counter()
            out = list(
                generate(
                    ModelPair.of(model, tokenizer, draft),
                    request,
                    prefill_step_size=512,
                    prefix=cache,
                )
            )
            return time.perf_counter() - start, out[-1].stats.cached_tokens

        ttft(None)  # warm-up: kernels
        cold, _ = ttft(None)
        folder = Path(tmp) / "cache"
        first = PrefixCache(1, PrefixDisk(folder, 1 << 40, "bench"))  # RAM holds nothing
        ttft(first)
        first.close()
        size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        spent.clear()
        warm, reused = ttft(PrefixCache(1 << 34, PrefixDisk(folder, 1 << 40, "bench")))
    return {
        "tokens": n,
        "file_mib": round(size / MiB, 1),
        "ttft_cold_s": round(cold, 3),
        "ttft_disk_hit_s": round(warm, 3),
        "reused": reused,
        "verify_s": round(sum(spent), 4),
        "verify_over_cold_prefill": round(sum(spent) / cold, 4),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[3400, 16384])
    p.add_argument("--layers", type=int, default=32, help="target layers, every 4th attention")
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--checkpoints", type=int, default=3)
    p.add_argument("--no-model", action="store_true", help="skip the end-to-end model runs")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    out: dict = {"hash_ms_per_mib": hashes(), "checksum": prefix_file.CHECKSUM}
    print(json.dumps(out), flush=True)
    digest = prefix_file.digest
    spent = timed_digest()
    out["entry"] = [entry(n, a, spent, digest) for n in a.tokens]
    for row in out["entry"]:
        print(json.dumps(row), flush=True)
    out["model"] = [] if a.no_model else [model_end_to_end(n, spent) for n in a.tokens]
    for row in out["model"]:
        print(json.dumps(row), flush=True)
    write_json(a.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
