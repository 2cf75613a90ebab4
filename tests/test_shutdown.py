"""Graceful shutdown of a real ``dflash-serve`` process on SIGTERM / SIGINT."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from server_fixtures import ServeProcess, free_port

# The real CLI, with generation slowed (50 ms per cycle) so requests are still running at the signal.
LAUNCH = """
import sys, time
import dflash_server.generation.stream as stream
real = stream.generate

def slow(*args, **kwargs):
    for response in real(*args, **kwargs):
        time.sleep(0.05)
        yield response

stream.generate = slow
from dflash_server.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _stream(base: str, body: dict[str, Any], out: list[Any], started: threading.Event) -> None:
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                out.append(data if data == "[DONE]" else json.loads(data))
                if len(out) >= 2:
                    started.set()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_ends_every_stream_with_a_final_event(
    sig: signal.Signals, tiny_hybrid_path: Path, draft_path: Path
) -> None:
    port = free_port()
    args = ["--target", str(tiny_hybrid_path), "--draft", str(draft_path), "--port", str(port)]
    args += ["--shutdown-timeout", "1.5", "--temperature", "0", "--no-enable-thinking"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLX_DISABLE_COMPILE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCH, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        msgs = [{"role": "user", "content": "hello"}]
        long_out: list[Any] = []
        short_out: list[Any] = []
        long_started, short_started = threading.Event(), threading.Event()
        long_body = {"messages": msgs, "max_tokens": 5000, "stream": True}
        short_body = {"messages": msgs, "max_tokens": 6, "stream": True}
        threads = [
            threading.Thread(target=_stream, args=(base, long_body, long_out, long_started)),
            threading.Thread(target=_stream, args=(base, short_body, short_out, short_started)),
        ]
        blocking: list[httpx.Response] = []

        def whole() -> None:
            body = {"messages": msgs, "max_tokens": 5000}
            blocking.append(httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60))

        threads.append(threading.Thread(target=whole))
        # The non-streamed one first, in the engine before the signal (else it may connect after
        # the listener closed: a refused connection, not the 503 checked below).
        threads[-1].start()
        deadline = time.monotonic() + 30
        while httpx.get(f"{base}/health", timeout=5).json()["queue_depth"] < 1:
            assert time.monotonic() < deadline, "the non-streamed request never arrived"
            time.sleep(0.05)
        for t in threads[:-1]:
            t.start()
        assert long_started.wait(30) and short_started.wait(30)
        proc.send_signal(sig)
        output, _ = proc.communicate(timeout=30)
        for t in threads:
            t.join(10)
            assert not t.is_alive()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # SIGTERM (a service manager's stop) exits 0; Ctrl-C 130, as a shell expects.
    assert proc.returncode == (0 if sig == signal.SIGTERM else 130), output
    assert "Traceback" not in output, output
    # The short one finished normally inside the grace period.
    assert short_out[-1] == "[DONE]"
    assert short_out[-2]["choices"][0]["finish_reason"] == "length"
    # The long ones were ended: an error event, then [DONE]; a 503 for the non-streamed one.
    assert long_out[-1] == "[DONE]"
    assert long_out[-2]["error"]["code"] == "server_shutdown"
    assert blocking and blocking[0].status_code == 503
    assert blocking[0].json()["error"]["code"] == "server_shutdown"


@pytest.mark.slow
def test_ctrl_c_while_loading_stops_at_once(tiny_hybrid_path: Path, draft_path: Path) -> None:
    """Ctrl-C while the models load (two minutes of load-time measuring here) ends the process
    at once with 130: no waiting for the measurements, no C++ abort from under the worker."""
    args = ["--target", str(tiny_hybrid_path), "--draft", str(draft_path)]
    server = ServeProcess([*args, "--port", str(free_port())], slow=120)
    try:
        server.wait_for("measuring pass costs")
        code, seconds = server.stop(signal.SIGINT)
    finally:
        server.kill()
    # Not a speed test: loading had two minutes to go; waiting for it took 20 s, then aborted.
    assert code == 130 and seconds < 10, (code, seconds, server.output)
    assert "stopped while loading the models" in server.output
    assert "terminate called" not in server.output and "Traceback" not in server.output
