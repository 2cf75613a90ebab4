"""Engine layer: reasoning split, prompt rendering, the worker thread and its queue."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from dflash_server.chat.prompts import render_chat, render_completion
from dflash_server.chat.reasoning import ReasoningSplitter, joined, split_reasoning
from dflash_server.engine.jobs import EngineNotReady, Failed, Finished, QueueFull, TextChunk
from dflash_server.engine.loader import LoadedModels, ModelLoadError, load_models, resolve_model
from dflash_server.engine.worker import Engine
from server_fixtures import ScriptedGenerate, drain, make_job, start_engine

# ----- reasoning split ---------------------------------------------------------------------

CASES = [
    # (prompt opens think block, model output, expected reasoning, expected content)
    (True, "plan it\n</think>\n\nThe answer is 42.", "plan it\n", "The answer is 42."),
    (True, "never closes", "never closes", ""),
    (True, "</think>direct", "", "direct"),
    (False, "plain answer", "", "plain answer"),
    (False, "<think>\nsneaky</think>\n\nvisible", "sneaky", "visible"),
    (False, "a</think>b", "", "ab"),  # a stray closer never leaks
    (False, "x <thi", "", "x <thi"),  # an unfinished marker prefix is text after all
    (True, "uses < and </b> tags</think>ok", "uses < and </b> tags", "ok"),
]


@pytest.mark.parametrize(("opens", "text", "reasoning", "content"), CASES)
def test_split_whole(opens: bool, text: str, reasoning: str, content: str) -> None:
    assert split_reasoning(text, opens) == (reasoning, content)


@pytest.mark.parametrize(("opens", "text", "reasoning", "content"), CASES)
def test_split_any_chunking(opens: bool, text: str, reasoning: str, content: str) -> None:
    """Markers cut at every possible position (and one char at a time) split the same way."""
    cuts = [[i] for i in range(1, len(text))] + [list(range(1, len(text)))]
    for cut in cuts:
        pieces = [text[a:b] for a, b in zip([0, *cut], [*cut, len(text)])]
        splitter = ReasoningSplitter(opens)
        out_r, out_c = "", ""
        for piece in pieces:
            r, c = joined(splitter.feed(piece))
            out_r, out_c = out_r + r, out_c + c
            assert "<think>" not in c and "</think>" not in c
        r, c = joined(splitter.finish())
        assert (out_r + r, out_c + c) == (reasoning, content), pieces


# ----- prompts -----------------------------------------------------------------------------


def test_render_chat_thinking_modes(tiny_hybrid: tuple[Any, Any]) -> None:
    _, tokenizer = tiny_hybrid
    msgs = [{"role": "user", "content": "Hello"}]
    on = render_chat(tokenizer, msgs, enable_thinking=True)
    off = render_chat(tokenizer, msgs, enable_thinking=False)
    assert on.text.endswith("<|im_start|>assistant\n<think>\n") and on.opens_reasoning
    assert off.text.endswith("</think>\n\n") and not off.opens_reasoning
    assert on.tokens == list(tokenizer.encode(on.text))
    # History with reasoning renders closed blocks: still opens only the new one.
    history = [*msgs, {"role": "assistant", "content": "Hi", "reasoning_content": "r"}, *msgs]
    assert render_chat(tokenizer, history, enable_thinking=True).opens_reasoning


def test_render_completion(tiny_hybrid: tuple[Any, Any]) -> None:
    _, tokenizer = tiny_hybrid
    p = render_completion(tokenizer, "Hello, world!")
    assert p.tokens == list(tokenizer.encode("Hello, world!")) and not p.opens_reasoning
    assert render_completion(tokenizer, p.tokens).tokens == p.tokens


# ----- worker ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tiny_hybrid_path: Path, draft_path: Path, calibration_cache: Path) -> LoadedModels:
    return load_models(
        str(tiny_hybrid_path),
        str(draft_path),
        context_length=256,
        calibration_cache=calibration_cache,
    )


def test_load_models_summary(models: LoadedModels) -> None:
    s = models.summary
    assert s.context_length == 256 and models.pair.draft.config.block_size == 8
    assert s.block_size == 8 and s.target_quantization == "unquantized"
    assert s.target_weights_gb > 0 and s.vocab_size > 0


def test_missing_models_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such folder"):
        resolve_model(str(tmp_path / "nope"), "target", ["*.json"])
    with pytest.raises(ModelLoadError) as info:
        resolve_model("nobody-xyz/no-such-model", "draft", ["*.json"])  # offline in tests
    assert "\n" not in str(info.value) and "nobody-xyz/no-such-model" in str(info.value)
    with pytest.raises(ModelLoadError, match="cannot load target"):
        load_models(str(tmp_path), None)  # an empty folder


def test_long_prompts_bring_no_tokenizer_warning(
    tiny_hybrid_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The context limit is the model's: a smaller tokenizer ``model_max_length`` warns of
    nothing (transformers' "indexing errors" warning misled users on long prompts)."""
    import json
    import shutil

    folder = shutil.copytree(tiny_hybrid_path, tmp_path / "short-tokenizer")
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_max_length": 64}))
    pair = load_models(str(folder), None, measure=False).pair
    assert len(pair.tokenizer.encode("hello world " * 100)) > 64
    assert not [r for r in caplog.records if "sequence length" in r.getMessage()]


def _engine(models: LoadedModels, gen: Any, max_queue: int = 4) -> Engine:
    return start_engine(models, gen, max_queue=max_queue)


def test_jobs_run_in_order_with_params(models: LoadedModels) -> None:
    gen = ScriptedGenerate(["a", "b", "c"], delay=0.01)
    engine = _engine(models, gen)

    async def main() -> list[list[Any]]:
        jobs = [make_job([1, 2, i], 5, seed=i, block_size=8) for i in range(3)]
        for job in jobs:
            engine.submit(job)
        return [await drain(job, timeout=10) for job in jobs]

    try:
        results = asyncio.run(main())
    finally:
        engine.stop()
    assert [c["prompt"][-1] for c in gen.calls] == [0, 1, 2]  # FIFO
    assert gen.calls[0]["request"].seed == 0 and gen.calls[0]["draft"] is models.pair.draft
    for events in results:
        text = "".join(e.text for e in events if isinstance(e, TextChunk))
        assert text == "abc"
        done = events[-1]
        assert isinstance(done, Finished) and done.finish_reason == "stop"
        assert done.completion_tokens == 3 and done.prompt_tokens == 3
        assert done.speculative is True and done.block_size == 8


def test_plain_decoding_passes_no_drafter(models: LoadedModels) -> None:
    gen = ScriptedGenerate(["x"])
    engine = _engine(models, gen)

    async def main() -> None:
        job = make_job([1], 5, block_size=1)  # speculation off
        engine.submit(job)
        await drain(job, timeout=10)

    try:
        asyncio.run(main())
    finally:
        engine.stop()
    assert gen.calls[0]["draft"] is None and not gen.calls[0]["request"].speculative


def test_cancel_stops_running_job_and_frees_worker(models: LoadedModels) -> None:
    gen = ScriptedGenerate(["t"] * 500, delay=0.01)
    engine = _engine(models, gen, max_queue=1)

    async def main() -> list[Any]:
        first = make_job([1], 500)
        engine.submit(first)
        await first.next_events(timeout=10)  # running now
        queued = make_job([2], 500)
        engine.submit(queued)
        with pytest.raises(QueueFull) as full:
            engine.submit(make_job([3], 5))
        assert full.value.retry_after >= 1
        queued.cancel()  # leaves the queue at once
        assert engine.queue_depth == 1
        first.cancel()
        nxt = make_job([4], 3)
        engine.submit(nxt)
        return await drain(nxt, timeout=10)

    try:
        events = asyncio.run(main())
    finally:
        engine.stop()
    assert gen.closed_early == 1  # the cancelled generator was closed, not run to the end
    assert [c["prompt"] for c in gen.calls] == [[1], [4]]  # the cancelled queued job never ran
    assert isinstance(events[-1], Finished) and events[-1].finish_reason == "length"
    assert engine.queue_depth == 0


def test_generation_error_is_reported_and_worker_survives(models: LoadedModels) -> None:
    calls = []

    def broken(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        yield from ScriptedGenerate(["ok"])(*args, **kwargs)

    engine = _engine(models, broken)

    async def main() -> tuple[list[Any], list[Any]]:
        a, b = make_job([1], 4), make_job([1], 4)
        engine.submit(a)
        engine.submit(b)
        return await drain(a, timeout=10), await drain(b, timeout=10)

    try:
        bad, good = asyncio.run(main())
    finally:
        engine.stop()
    assert isinstance(bad[-1], Failed) and "boom" in bad[-1].message
    assert isinstance(good[-1], Finished)


def test_loading_state_and_failure() -> None:
    release = threading.Event()
    fatal: list[str] = []

    def loader() -> LoadedModels:
        release.wait(10)
        raise ModelLoadError("target 'x' was not found")

    engine = Engine(loader, on_fatal=fatal.append)
    engine.start()
    assert engine.state == "loading"

    async def submit() -> None:
        engine.submit(make_job([1], 1))

    with pytest.raises(EngineNotReady):
        asyncio.run(submit())
    release.set()
    assert not engine.wait_ready(10)
    assert engine.state == "error" and fatal == ["target 'x' was not found"]
    engine.stop()


def test_event_loop_never_runs_mlx(models: LoadedModels) -> None:
    """Generation happens on the worker thread, never on the thread running the event loop."""
    threads: list[str] = []

    def gen(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        yield from ScriptedGenerate(["z"])(*args, **kwargs)

    engine = _engine(models, gen)

    async def main() -> None:
        job = make_job([1], 2)
        engine.submit(job)
        await drain(job, timeout=10)

    try:
        asyncio.run(main())
    finally:
        engine.stop()
    assert threads == ["dflash-engine"]
