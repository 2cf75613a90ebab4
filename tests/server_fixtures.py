"""Helpers for the server tests: a tiny drafter folder and a real uvicorn on a loopback port."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

OFFLINE = {"HF_HUB_OFFLINE": "1"}  # subprocesses never touch the network either


def build_draft(path: Path, target_path: Path, *, block_size: int = 8, seed: int = 1) -> Path:
    """Write a random DFlash drafter folder (config.json + safetensors) that fits ``target_path``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from dflash_server import DFlashConfig, DFlashDraftModel
    from dflash_server.testing import mask_token_id

    cfg = json.loads((target_path / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    layers = text["num_hidden_layers"]
    config = DFlashConfig(
        hidden_size=text["hidden_size"],
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=2 * text["hidden_size"],
        vocab_size=text["vocab_size"],
        rms_norm_eps=1e-6,
        rope_theta=10_000_000.0,
        max_position_embeddings=32768,
        block_size=block_size,
        target_layer_ids=(1, layers - 2),
        num_target_layers=layers,
        mask_token_id=mask_token_id(target_path),
    )
    mx.random.seed(seed)
    model = DFlashDraftModel(config)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    return path


def tool_call_markup(name: str, **params: str) -> str:
    """A Qwen3.5 XML tool call, as the model writes it (for scripted generations)."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def pieces(text: str, n: int = 4) -> list[str]:
    """``text`` cut into ``n``-character pieces, as a stream would deliver it."""
    return [text[i : i + n] for i in range(0, len(text), n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    base_url: str  # http://127.0.0.1:PORT
    app: Any
    server: Any

    @property
    def engine(self) -> Any:
        return self.app.state.engine


@contextlib.contextmanager
def run_server(app: Any, ready_timeout: float = 60.0, **config: Any) -> Iterator[RunningServer]:
    """Serve ``app`` with uvicorn on a free loopback port in a thread, as ``dflash-serve`` serves
    it (``config``: other ``uvicorn.Config`` settings); wait until /health is 200."""
    import uvicorn

    from dflash_server.serve.server import server_options

    port = free_port()
    options = {**server_options(app.state.settings), **config}
    uvicorn_config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", **options
    )
    server = uvicorn.Server(uvicorn_config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            raise RuntimeError("test server did not become ready")
        time.sleep(0.05)
    try:
        yield RunningServer(base, app, server)
    finally:
        server.should_exit = True
        thread.join(15)


def real_generate(models: Any, request: Any) -> Iterator[Any]:
    """The engine's own generation (``dflash_server.generation.stream.generate``), for wrappers."""
    from dflash_server.generation.stream import generate

    return generate(models.pair, request)


def make_job(prompt: list[int], max_tokens: int, **fields: Any) -> Any:
    """An engine ``Job`` for ``prompt``: plain decoding unless ``block_size`` > 1; sampling
    fields (temperature, ...) by name."""
    from dflash_server.engine.jobs import Job
    from dflash_server.generation.request import BlockPolicy, GenerationRequest
    from dflash_server.generation.sampling import SamplingParams

    sampling = {k: fields.pop(k) for k in list(fields) if k in SamplingParams.model_fields}
    if "block_size" in fields:
        fields["block"] = BlockPolicy(fields.pop("block_size"))
    return Job(GenerationRequest(tuple(prompt), max_tokens, SamplingParams(**sampling), **fields))


def fake_response(text: str, tokens: list[int], finish_reason: str | None, n: int) -> Any:
    """A ``GenerationResponse`` with made-up text and token ids, for scripted engine tests."""
    from dflash_server.generation.stream import GenerationResponse

    return GenerationResponse(text, tokens, finish_reason, 0, 0.0, n, 0.0, 0.0)


class ScriptedGenerate:
    """A ``generate`` for Engine that replays text pieces, optionally slowly.

    Records each call (the request, its prompt, the drafter it would use) and whether the
    generator was closed before its end, so tests can check cancellation really stopped the work.
    """

    def __init__(
        self,
        pieces: list[str],
        delay: float = 0.0,
        first_delay: float = 0.0,
        source: str | None = None,
    ) -> None:
        self.pieces, self.delay, self.first_delay = pieces, delay, first_delay
        self.source = source  # each piece one token from it ("target", "draft"), for dflash_tokens
        self.calls: list[dict[str, Any]] = []
        self.closed_early = 0
        self.finished = 0

    def __call__(self, models: Any, request: Any) -> Iterator[Any]:
        draft = models.pair.draft if request.speculative else None
        self.calls.append({"request": request, "prompt": list(request.prompt), "draft": draft})
        return self._run(request.max_tokens, request.stop)

    def _run(self, max_tokens: int, stop: tuple[str, ...] = ()) -> Iterator[Any]:
        from dflash_server.generation.text import StopMatcher  # stop strings as generate does

        time.sleep(self.first_delay)
        pieces = self.pieces[:max_tokens]
        stops = StopMatcher(stop)
        done = False
        try:
            for i, piece in enumerate(pieces):
                if i:
                    time.sleep(self.delay)
                text, hit = stops.feed(piece)
                done = i == len(pieces) - 1 or hit is not None
                if done and hit is None:
                    text += stops.flush()
                reason = "length" if done and len(pieces) == max_tokens else "stop"
                response = fake_response(text, [i], reason if done else None, i + 1)
                response.stop = hit
                response.sources = [(text, self.source)] if self.source else None
                yield response
                if done:
                    return
        except GeneratorExit:
            if not done:  # closed before its last response: cancelled
                self.closed_early += 1
            raise
        finally:
            self.finished += done


class ScriptedTokens:
    """A ``generate`` for Engine that replays token ids through the real detokenizer and stop
    strings (``TextStream``), ``step`` tokens per commit (as a speculative cycle commits several),
    ``delay`` seconds apart: the text as the model's tokens make it, an incomplete UTF-8
    character held back included."""

    def __init__(self, tokens: list[int], step: int = 1, delay: float = 0.0) -> None:
        self.tokens, self.step, self.delay = tokens, step, delay

    def __call__(self, models: Any, request: Any) -> Iterator[Any]:
        from dflash_server.generation.cycle import Commit
        from dflash_server.generation.text import TextStream, hidden_tokens

        tokenizer = models.pair.tokenizer
        text = TextStream(tokenizer, request.stop, hidden_tokens(tokenizer))
        tokens, step, delay = self.tokens[: request.max_tokens], self.step, self.delay

        def run() -> Iterator[Any]:
            for i in range(0, len(tokens), step):
                time.sleep(delay)
                commit = tokens[i : i + step]
                last = i + step >= len(tokens)
                piece, _, finish = text.feed(Commit(commit, finish="stop" if last else None))
                yield fake_response(piece, commit, finish, i + len(commit))
                if finish is not None:
                    return

        return run()


def slow(generate: Any, delay: float) -> Any:
    """Wrap a real ``stream_generate`` so each response takes at least ``delay`` seconds."""

    def wrapped(*args: Any, **kwargs: Any) -> Iterator[Any]:
        for response in generate(*args, **kwargs):
            time.sleep(delay)
            yield response

    return wrapped


class GeneratorStreams:
    """The engine's running requests (``engine.streams.Streams``) as the responses of a
    ``generate(models, request)`` test double, one per round (the first: the prefill's)."""

    def __init__(self, generate: Any, models: Any) -> None:
        self.generate, self.models = generate, models
        self.runs: dict[Any, Iterator[Any]] = {}

    @property
    def busy(self) -> bool:
        return bool(self.runs)

    def start(self, request: Any) -> Any:
        stream = object()
        self.runs[stream] = self.generate(self.models, request)
        return stream

    def stop(self, stream: Any) -> None:
        run = self.runs.pop(stream, None)
        close = getattr(run, "close", None)  # a generator's: frees its caches now
        if close is not None:
            close()

    def step(self) -> dict[Any, Any]:
        from dflash_server.generation.stream import GenerationResponse

        out: dict[Any, Any] = {}
        for stream, run in list(self.runs.items()):
            try:
                out[stream] = next(run)
            except StopIteration:  # ended without a final response: as one of no tokens
                out[stream] = GenerationResponse("", [], "length", 0, 0.0, 0, 0.0, 0.0)
            except Exception as exc:
                out[stream] = exc
        return out


def streams_of(generate: Any) -> Any:
    """An ``Engine(streams=...)`` factory running the ``generate`` double (None: the real)."""
    return None if generate is None else lambda models: GeneratorStreams(generate, models)


def make_app(
    target: Path, draft: Path | str | None, *, generate: Any = None, **settings: Any
) -> Any:
    """An app serving the tiny fixture models (``draft``: a folder, "mtp" or None);
    ``generate`` swaps the engine's generation for a test double."""
    from dflash_server.api.app import create_app
    from dflash_server.api.metrics import Metrics
    from dflash_server.serve.engine import build_engine
    from dflash_server.settings import Settings

    s = Settings.load(target=str(target), draft=None if draft is None else str(draft), **settings)
    metrics = Metrics() if s.metrics else None
    engine = build_engine(s, streams=streams_of(generate), metrics=metrics)
    return create_app(s, engine, metrics)


def start_engine(models: Any, generate: Any, **settings: Any) -> Any:
    """A started ``Engine`` over already loaded models, with a (scripted) generate function."""
    from dflash_server.engine.worker import Engine

    engine = Engine(lambda: models, streams=streams_of(generate), **settings)
    engine.start()
    assert engine.wait_ready(30)
    return engine


async def drain(job: Any, timeout: float = 30) -> list[Any]:
    """All events of a job until its end; fails if the engine goes quiet for ``timeout`` s."""
    events: list[Any] = []
    while batch := await job.next_events(timeout=timeout):
        events.extend(batch)
    assert batch is not None, "timed out"
    return events


# The real CLI, with ``SLOW`` seconds of MLX work (a big model's load-time measurements, on the
# tiny models) before the engine measures its batched pass costs, the last step of loading.
SLOW_LOAD = """
import sys, time
import mlx.core as mx
import dflash_server.generation.calibrate_passes as budget

measure = budget.measure_pass_costs

def slow(*args, **kwargs):
    print("measuring pass costs", flush=True)
    end, x = time.monotonic() + float(sys.argv[1]), mx.ones((64, 64))
    while time.monotonic() < end:
        mx.eval(x @ x)
    return measure(*args, **kwargs)

budget.measure_pass_costs = slow
from dflash_server.cli import main
sys.exit(main(sys.argv[2:]))
"""


class OutputProcess:
    """A subprocess whose output (stdout and stderr) is read line by line as it comes;
    ``session``: in a process group of its own (its children too: ``kill`` ends them all)."""

    def __init__(self, command: list[str], env: dict[str, str], session: bool = False) -> None:
        self.proc = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=session,
        )
        self.session = session
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, needle: str, timeout: float = 90) -> str:
        """The first (next) output line containing ``needle``; fails if the process ends first."""
        deadline = time.monotonic() + timeout
        while (line := self._queue.get(timeout=max(0.0, deadline - time.monotonic()))) is not None:
            self.lines.append(line)
            if needle in line:
                return line
        raise AssertionError(f"exited ({self.proc.wait()}) before {needle!r}:\n" + self.output)

    def stop(self, sig: int, timeout: float = 60) -> tuple[int, float]:
        """Send ``sig``; (exit status, seconds until the process ended)."""
        start = time.monotonic()
        self.proc.send_signal(sig)
        code = self.finish(timeout)
        return code, time.monotonic() - start

    def finish(self, timeout: float = 60) -> int:
        """Wait for the process to end; its exit status (all its output is in ``lines``)."""
        code = self.proc.wait(timeout)
        while (line := self._queue.get(timeout=10)) is not None:
            self.lines.append(line)
        return code

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def kill(self) -> None:
        if self.session:  # the group this process leads: what it started goes too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class ServeProcess(OutputProcess):
    """``dflash-serve ARGS`` in a subprocess (loading slowed by ``slow`` seconds). No
    calibration cache: the (slowed) measurements run at every start, and nothing is written."""

    def __init__(self, args: list[str], slow: float = 0.0) -> None:
        command = [sys.executable, "-c", SLOW_LOAD, str(slow), *args]
        super().__init__([*command, "--calibration-cache", "off"], {**os.environ, **OFFLINE})
