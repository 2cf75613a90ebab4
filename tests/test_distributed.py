"""The target tensor-sharded over two ranks (``mlx.launch -n 2 --backend ring`` on 127.0.0.1).

Exact: greedy output equals mlx-lm's own sharded greedy decoding (lone, batched, after a prefix
hit and a cancellation), sampled output follows the sharded target's law (``sharded_ranks.py``
runs those on the engine, one launch). The real server (a second launch) answers as the oracle
and reports every rank's memory; a rank that dies or hangs gets every request a 503 and rank 0
a non-zero exit; ranks with different settings refuse to start, naming the difference.

Sharded logits differ from one machine's in the last bits (the sums run in another order; on
this fixture by at most ~1e-6), so the oracle is the sharded model, never the single one.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server_fixtures import OFFLINE, OutputProcess, free_port

HERE = Path(__file__).parent
LAUNCH = str(Path(sys.executable).parent / "mlx.launch")


def ring_port() -> int:
    """A port P with P and P + 1 free (the ring backend listens on one port per rank)."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


def launch(command: list[str], env: dict[str, str] | None = None) -> OutputProcess:
    """``command`` on two local ranks, in a process group of its own."""
    ring = [LAUNCH, "-n", "2", "--backend", "ring", "--starting-port", str(ring_port()), "--"]
    return OutputProcess([*ring, *command], {**os.environ, **OFFLINE, **(env or {})}, True)


def serve(*args: str) -> list[str]:
    return [sys.executable, "-m", "dflash_server.cli", *args]


def follower_pid(process: OutputProcess) -> int:
    """Rank 1's pid, from its start-up line (logged before or after rank 0's "ready")."""
    needle = "following rank 0 (pid"
    line = next((seen for seen in process.lines if needle in seen), None)
    line = line or process.wait_for(needle)
    return int(line.split("(pid ")[1].split(",")[0])


@pytest.fixture(scope="module")
def engine_run(tiny_hybrid_path: Path, draft_path: Path, tmp_path_factory: Any) -> dict:
    """``sharded_ranks.py`` on two ranks: what every case produced, and the oracle's."""
    out = tmp_path_factory.mktemp("ranks") / "out.json"
    script = [sys.executable, str(HERE / "sharded_ranks.py"), str(out)]
    process = launch([*script, str(tiny_hybrid_path), str(draft_path)])
    try:
        code = process.finish(timeout=900)
    finally:
        process.kill()
    assert code == 0 and out.exists(), process.output
    assert Path(f"{out}.rank1").read_text() == "followed to the end"
    return json.loads(out.read_text())


@pytest.mark.system  # two real ranks (.ci/run runs them after the suite)
def test_greedy_output_equals_the_sharded_oracle(engine_run: dict) -> None:
    got, want = engine_run["got"], engine_run["want"]
    for case in ("lone", "hit", "batched+0", "batched+3", "batched+7"):
        assert got[case]["end"] == "finished", case
        assert got[case]["tokens"] == want[case], case
    assert got["hit"]["cached"] > 0 and got["lone"]["cached"] == 0
    cancelled = got["cancelled"]  # stopped by rank 0 mid-way: the ranks went on together
    assert cancelled["end"] == "request cancelled"
    assert 5 <= len(cancelled["tokens"]) < 200
    assert cancelled["tokens"] == want["cancelled"][: len(cancelled["tokens"])]


@pytest.mark.system  # two real ranks (.ci/run runs them after the suite)
def test_tapped_layers_are_whole_on_every_rank(engine_run: dict) -> None:
    assert engine_run["taps"]["ranks_equal"]
    assert engine_run["taps"]["vs_single"] < 1e-4


@pytest.mark.system  # two real ranks (.ci/run runs them after the suite)
def test_sampled_output_follows_the_sharded_target_law(engine_run: dict) -> None:
    from test_sampling import total_variation, tv_tolerance

    exact, counts = engine_run["law"], engine_run["got"]["law"]
    n = sum(counts.values())
    assert total_variation(counts, exact, n) < tv_tolerance(len(exact), n, factor=2.0)


@pytest.fixture(scope="module")
def server(engine_run: dict, tiny_hybrid_path: Path, draft_path: Path) -> Iterator[Any]:
    """The real ``dflash-serve`` on two ranks (the costs the engine run measured are read
    back from the session's calibration cache); the last test below kills its rank 1."""
    port = free_port()
    process = launch(serve("--target", str(tiny_hybrid_path), "--draft", str(draft_path),
                           "--port", str(port)))  # fmt: skip
    process.port = port  # type: ignore[attr-defined]
    try:
        process.wait_for("ready: serving", timeout=600)
        process.rank1 = follower_pid(process)  # type: ignore[attr-defined]
        yield process
    finally:
        process.kill()


def complete(port: int, prompt: list[int], n: int = 40, **body: Any) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 0, **body}
    return httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=300)


@pytest.mark.system  # two real ranks (.ci/run runs them after the suite)
def test_server_answers_as_the_oracle_and_reports_every_rank(server: Any, engine_run: dict) -> None:
    prompt, want = engine_run["prompt"], engine_run["strings"]
    first = complete(server.port, prompt).json()
    assert first["choices"][0]["logprobs"]["tokens"] == want
    # A grammar: every rank builds its matcher and walks the drafted paths with it.
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {
        "messages": [{"role": "user", "content": "an object"}],
        "max_tokens": 24,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        "enable_thinking": False,
    }
    url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    answer = httpx.post(url, json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"].startswith("{")
    results: list[Any] = [None] * 3

    def one(i: int) -> None:  # batched with each other, the second and third a prefix hit
        results[i] = complete(server.port, prompt).json()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for result in results:
        assert result["choices"][0]["logprobs"]["tokens"] == want
    assert any(r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for r in results)
    metrics = httpx.get(f"http://127.0.0.1:{server.port}/metrics").text
    for rank in ("0", "1"):
        assert f'dflash_rank_memory_bytes{{kind="active",rank="{rank}"}}' in metrics


@pytest.mark.system  # two real ranks (.ci/run runs them after the suite)
def test_a_rank_that_dies_ends_requests_with_503_and_rank_0_exits(server: Any) -> None:
    """The last test on this server: its rank 1 is killed mid-request."""
    answer: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: answer.append(complete(server.port, [5] * 8, 4000)))
    thread.start()
    time.sleep(1.0)
    start = time.monotonic()
    os.kill(server.rank1, signal.SIGKILL)
    thread.join(120)
    assert answer and answer[0].status_code == 503, answer and answer[0].text
    line = server.wait_for("Node with rank 0 exited with code", timeout=120)
    assert not line.rstrip().endswith("code 0"), server.output
    assert time.monotonic() - start < 60


@pytest.mark.system  # two real ranks (.ci/run runs them after the suite)
def test_a_rank_that_hangs_ends_requests_with_503_and_rank_0_exits(
    engine_run: dict, tiny_hybrid_path: Path, draft_path: Path
) -> None:
    port = free_port()
    process = launch(serve("--target", str(tiny_hybrid_path), "--draft", str(draft_path),
                           "--port", str(port), "--rank-timeout", "3"))  # fmt: skip
    try:
        process.wait_for("ready: serving", timeout=600)
        rank1 = follower_pid(process)
        answer: list[httpx.Response] = []
        thread = threading.Thread(target=lambda: answer.append(complete(port, [5] * 8, 4000)))
        thread.start()
        time.sleep(1.0)
        start = time.monotonic()
        os.kill(rank1, signal.SIGSTOP)
        thread.join(120)
        assert answer and answer[0].status_code == 503, answer and answer[0].text
        assert "--rank-timeout" in answer[0].json()["error"]["message"]
        os.kill(rank1, signal.SIGKILL)  # a stopped process cannot take mlx.launch's SIGTERM
        line = process.wait_for("Node with rank 0 exited with code", timeout=120)
        assert not line.rstrip().endswith("code 0"), process.output
        assert time.monotonic() - start < 3 + 30
    finally:
        process.kill()


@pytest.mark.system  # two real ranks (.ci/run runs them after the suite)
def test_ranks_with_different_settings_refuse_to_start(
    tiny_hybrid_path: Path, draft_path: Path
) -> None:
    args = " ".join(serve("--target", str(tiny_hybrid_path), "--draft", str(draft_path),
                          "--port", str(free_port())))  # fmt: skip
    # Rank 1 alone gets another verify cap (as a DFLASH_* variable set on one machine would).
    differ = f'if [ "$MLX_RANK" = 1 ]; then export DFLASH_MAX_VERIFY=7; fi; exec {args}'
    process = launch(["/bin/sh", "-c", differ])
    try:
        process.finish(timeout=300)
    finally:
        process.kill()
    assert "rank 1 differs from rank 0 in --max-verify: 7 there, None on rank 0" in process.output
    # Whichever rank ends first (status 2), mlx.launch then stops the other; it reports every
    # rank that ended with a status other than 0.
    assert "exited with code 2" in process.output
    assert process.output.count("exited with code") == 2


def test_the_startup_items_name_model_files_by_content(tmp_path: Path, draft_path: Path) -> None:
    """What the ranks compare at start: a weight file changed on one machine differs, the
    same files elsewhere (another path, another time) do not."""
    import shutil

    from dflash_server.serve.ranks import shared_items
    from dflash_server.settings import Settings

    copy = shutil.copytree(draft_path, tmp_path / "elsewhere")
    settings = Settings.load(target=str(draft_path))
    same = shared_items(settings, str(draft_path), None)
    assert shared_items(settings, str(copy), None) == same
    weights = next(copy.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-4] + b"\0\0\0\1")
    changed = shared_items(settings, str(copy), None)
    assert [k for k in same if changed[k] != same[k]] == [f"target file {weights.name}"]
    assert math.isfinite(float(same["--rank-timeout"]))


@pytest.mark.parametrize("late", [False, True])
def test_a_follower_restores_exactly_the_prefix_rank_0_restored(
    tiny_hybrid: Any, tmp_path: Path, late: bool
) -> None:
    """A follower's store restores rank 0's length, waiting for its own
    disk write still in flight (``late``); one it cannot restore is a lost rank, never a
    silently different prefill."""
    from dflash_server.engine.distributed import RankLost
    from dflash_server.engine.lockstep import AgreedPrefix
    from dflash_server.engine.prefix_cache import PrefixCache
    from dflash_server.engine.prefix_disk import PrefixDisk
    from dflash_server.generation.pair import ModelPair
    from dflash_server.generation.request import BlockPolicy, GenerationRequest
    from dflash_server.generation.stream import generate
    from dflash_server.testing import random_drafter

    model, tokenizer = tiny_hybrid
    pair = ModelPair.of(model, tokenizer, random_drafter(model))
    disk = PrefixDisk(tmp_path, 1 << 30, "fingerprint")
    if late:  # the write lands well after the request that queued it
        write = disk._write
        disk._write = lambda *a: (time.sleep(0.5), write(*a))[1]  # type: ignore[method-assign]
    cache = PrefixCache(60_000, disk)  # RAM for one entry (~41 KB): the next one evicts it
    prompt = list(tokenizer.encode("The quick brown fox jumps over the lazy dog"))
    for text in (prompt, list(tokenizer.encode("def fibonacci(n):"))):
        list(generate(pair, GenerationRequest(tuple(text), 4, block=BlockPolicy(4)), prefix=cache))
    kind = (pair.target.tap_ids,)
    snapshot, restored = AgreedPrefix(cache, len(prompt) - 1, 1).lookup(kind, prompt)  # type: ignore[misc]
    assert restored == len(prompt) - 1 and snapshot.tokens == tuple(prompt)
    assert AgreedPrefix(cache, 0, 1).lookup(kind, prompt) is None
    with pytest.raises(RankLost, match="cannot restore the 5 prompt tokens rank 0 restored"):
        AgreedPrefix(cache, 5, 1).lookup(kind, prompt)  # no checkpoint there
    disk.close()
