"""Tokens/s through the HTTP/SSE path vs calling ``stream_generate`` directly.

Builds a random-weight Qwen3.5-style target and a random drafter (offline, seconds), then
alternates: N direct runs in this process, N streamed ``/v1/completions`` runs against a
``dflash-serve`` subprocess on the same model folders, same prompt, greedy, same max_tokens.
A random drafter accepts almost nothing, so nearly every token is its own SSE event: the worst
case for per-token overhead.

    python benchmarks/http_overhead.py                      # ~35M-parameter model
    python benchmarks/http_overhead.py --hidden 64 --layers 4 --vocab 0   # tiny: overhead-bound

On Linux preload OpenBLAS first (scripts/test.sh shows how), or fp32 matmuls crawl.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

PROMPT = "def fibonacci(n: int) -> int:\n"


def cpu_seconds(pid: int | None = None) -> float | None:
    """User+system CPU time of this process, or of ``pid`` (Linux /proc only)."""
    if pid is None:
        return time.process_time()
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def build_models(root: Path, hidden: int, layers: int, vocab: int) -> tuple[Path, Path]:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from dflash_server import DFlashConfig, DFlashDraftModel
    from dflash_server.testing import build_target, mask_token_id

    target = build_target(
        root / "target", hidden_size=hidden, num_hidden_layers=layers, vocab_size=vocab or None
    )
    text = json.loads((target / "config.json").read_text())["text_config"]
    config = DFlashConfig(
        hidden_size=hidden,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4 if hidden < 512 else 128,
        intermediate_size=2 * hidden,
        vocab_size=text["vocab_size"],
        rms_norm_eps=1e-6,
        rope_theta=1e7,
        max_position_embeddings=32768,
        block_size=16,
        target_layer_ids=(1, layers - 2),
        num_target_layers=layers,
        mask_token_id=mask_token_id(target),
    )
    draft = root / "draft"
    draft.mkdir()
    model = DFlashDraftModel(config)
    mx.save_safetensors(str(draft / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (draft / "config.json").write_text(json.dumps(config.to_dict()))
    return target, draft


def run_direct(model, draft, tokenizer, max_tokens: int) -> tuple[int, float]:
    from dflash_server import stream_generate

    start = time.perf_counter()
    n = 0
    for r in stream_generate(model, draft, tokenizer, PROMPT, max_tokens=max_tokens, temperature=0):
        n += len(r.tokens)
    return n, time.perf_counter() - start


def run_http(
    client: httpx.Client, base: str, max_tokens: int, speculative: bool
) -> tuple[int, float, int]:
    body = {
        "speculative": speculative,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    events = tokens = 0
    with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            events += 1
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return tokens, time.perf_counter() - start, events


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32768, help="embedding rows (0: tokenizer size)")
    ap.add_argument("--tokens", type=int, default=256, help="max_tokens per request")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument(
        "--speculative",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--no-speculative: plain decoding on both paths (more tokens/s, harder on HTTP)",
    )
    args = ap.parse_args()

    import mlx_lm

    from dflash_server import load_draft

    with tempfile.TemporaryDirectory() as tmp:
        target, draft_path = build_models(Path(tmp), args.hidden, args.layers, args.vocab)
        model, tokenizer = mlx_lm.load(str(target))
        draft = load_draft(str(draft_path))
        draft.bind(model)
        direct_draft = draft if args.speculative else None

        cmd = [sys.executable, "-m", "dflash_server.cli", "--target", str(target)]
        cmd += ["--draft", str(draft_path), "--port", str(args.port), "--log-level", "warning"]
        server = subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        base = f"http://127.0.0.1:{args.port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if httpx.get(f"{base}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit("server did not start")
                time.sleep(0.2)
            direct, http, events = [], [], 0
            cpu_direct = cpu_server = 0.0
            with httpx.Client(timeout=300) as client:
                run_direct(model, direct_draft, tokenizer, args.tokens)  # warm-up both sides
                run_http(client, base, args.tokens, args.speculative)
                for _ in range(args.runs):
                    c0 = cpu_seconds()
                    n, dt = run_direct(model, direct_draft, tokenizer, args.tokens)
                    cpu_direct += cpu_seconds() - c0
                    direct.append(n / dt)
                    s0 = cpu_seconds(server.pid)
                    n_http, dt, events = run_http(client, base, args.tokens, args.speculative)
                    s1 = cpu_seconds(server.pid)
                    cpu_server += (s1 - s0) if s0 is not None and s1 is not None else float("nan")
                    assert n_http == n, f"token counts differ: {n_http} vs {n}"
                    http.append(n_http / dt)
        finally:
            server.terminate()
            server.wait(30)

    d, h = statistics.median(direct), statistics.median(http)
    # Each HTTP run against the direct run just before it: cancels slow drifts in machine load.
    paired = statistics.median(1 - b / a for a, b in zip(direct, http))
    total = n * args.runs
    mode = "DFlash, random drafter" if args.speculative else "plain decoding"
    print(f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab or 'tokenizer'}")
    print(f"mode: {mode}; tokens/request: {n}; SSE events/request: {events}; runs: {args.runs}")
    print(f"direct stream_generate: {d:8.1f} tok/s (median)")
    print(f"HTTP/SSE streaming:     {h:8.1f} tok/s (median)")
    print(f"overhead: {100 * (1 - h / d):.1f} % of medians, {100 * paired:.1f} % median of pairs")
    print(
        f"CPU per token: direct {1e3 * cpu_direct / total:.3f} ms, "
        f"server process {1e3 * cpu_server / total:.3f} ms"
    )


if __name__ == "__main__":
    main()
