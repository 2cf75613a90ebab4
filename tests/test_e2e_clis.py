"""Optional: the real agent CLIs, unmodified, complete a turn against the server.

Runs ``claude -p`` (Claude Code, ANTHROPIC_BASE_URL) and ``codex exec`` (Codex CLI, a custom
provider with ``wire_api = "responses"``) when they are on PATH (or in ``$DFLASH_CLI_BIN``);
skipped otherwise. The server is the tiny fixture model with scripted output (the CLIs' own
prompts are 20-40k tokens, their tools Bash, namespaces, web search...) and a context large
enough for them; only 127.0.0.1 is contacted. On the tiny vision model, each CLI also reads a
picture with its own tool (Claude Code's Read, Codex's view_image), whose result holds the image.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from dflash_server.testing import build_target
from dflash_server.testing.vision import build_vision_target
from server_fixtures import (
    RunningServer,
    ScriptedGenerate,
    build_draft,
    make_app,
    pieces,
    run_server,
    tool_call_markup,
)

CONTEXT = 400_000
ANSWER = ["</think>\n\n", "All ", "done", "."]


def _cli(name: str) -> str | None:
    extra = os.environ.get("DFLASH_CLI_BIN")
    return shutil.which(name, path=f"{extra}:{os.environ['PATH']}" if extra else None)


class ToolThenAnswer(ScriptedGenerate):
    """Calls the tool (``call``: its markup) until a request holds an image, the tool's result;
    then answers."""

    def __init__(self) -> None:
        super().__init__(ANSWER)
        self.call = ""

    def __call__(self, models: Any, request: Any) -> Iterator[Any]:
        self.pieces = ANSWER if request.images else pieces("</think>\n\n" + self.call)
        return super().__call__(models, request)


def _skip_without_clis() -> None:
    if _cli("claude") is None and _cli("codex") is None:
        pytest.skip("neither claude nor codex is installed")


def _serve(target: Path, script: ScriptedGenerate) -> Iterator[tuple[RunningServer, Any]]:
    """``target`` served with room for the CLIs' prompts, its answers from ``script``."""
    config = json.loads((target / "config.json").read_text())
    for part in (config, config.get("text_config", {})):
        part["max_position_embeddings"] = CONTEXT
    (target / "config.json").write_text(json.dumps(config))
    app = make_app(
        target,
        build_draft(target.parent / "draft", target),
        generate=script,
        served_model_name="tiny",
        context_length=CONTEXT,
    )
    with run_server(app) as srv:
        yield srv, script


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, Any]]:
    _skip_without_clis()
    root = tmp_path_factory.mktemp("e2e")
    yield from _serve(build_target(root / "target", arch="qwen3_5"), ScriptedGenerate(ANSWER))


@pytest.fixture(scope="module")
def served_vision(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, Any]]:
    _skip_without_clis()
    root = tmp_path_factory.mktemp("e2e-vision")
    yield from _serve(build_vision_target(root / "target"), ToolThenAnswer())


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> str:
    keep = {k: os.environ[k] for k in ("PATH", "LANG", "TERM") if k in os.environ}
    done = subprocess.run(
        cmd, cwd=cwd, env=keep | env, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    return done.stdout


def test_claude_code_completes_a_turn(served: tuple[RunningServer, Any], tmp_path: Path) -> None:
    claude = _cli("claude")
    if claude is None:
        pytest.skip("claude is not installed")
    srv, script = served
    out = _run([claude, "-p", "Say hi"], tmp_path, _claude_env(srv, tmp_path))
    assert "All done." in out
    request = script.calls[-1]["request"]
    assert len(request.prompt) > 10_000  # its real system prompt and tools


def _claude_env(srv: RunningServer, home: Path) -> dict[str, str]:
    return {
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": srv.base_url,
        "ANTHROPIC_API_KEY": "x",
        "ANTHROPIC_MODEL": "tiny",
        "ANTHROPIC_SMALL_FAST_MODEL": "tiny",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }


def test_codex_exec_completes_a_turn(served: tuple[RunningServer, Any], tmp_path: Path) -> None:
    codex = _cli("codex")
    if codex is None:
        pytest.skip("codex is not installed")
    srv, script = served
    work, env = _codex_setup(srv, tmp_path)
    out = _run([codex, "exec", "Say hi"], work, env)
    assert "All done." in out
    assert len(script.calls[-1]["request"].prompt) > 10_000


def _codex_setup(srv: RunningServer, tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A Codex home whose provider is the server, and a git work folder: (folder, env)."""
    home = tmp_path / "codex"
    home.mkdir()
    (home / "config.toml").write_text(
        'model = "tiny"\nmodel_provider = "dflash"\nmodel_context_window = 400000\n\n'
        "[model_providers.dflash]\n"
        'name = "dflash-server"\n'
        f'base_url = "{srv.base_url}/v1"\n'
        'wire_api = "responses"\n'
    )
    work = tmp_path / "work"
    work.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=work, check=True)
    return work, {"HOME": str(tmp_path), "CODEX_HOME": str(home)}


def _picture(folder: Path) -> tuple[Path, bytes]:
    """A small random PNG in ``folder``: its path and its pixels."""
    pixels = bytes(random.Random(5).randrange(256) for _ in range(96 * 64 * 3))
    path = folder / "pic.png"
    Image.frombytes("RGB", (96, 64), pixels).save(path)
    return path, pixels


def _read_the_picture(srv: RunningServer, script: Any, pixels: bytes) -> None:
    """The last request held the picture, pixel for pixel, inside the tool response."""
    request = script.calls[-1]["request"]
    served = srv.engine.served
    expected = served.vision.prepare(Image.frombytes("RGB", (96, 64), pixels))
    assert [image.digest for image in request.images] == [expected.digest]
    text = served.tokenizer.decode(list(request.prompt))
    assert "<tool_response>\n<|vision_start|><|image_pad|>" in text
    assert "<|image_pad|><|vision_end|>\n</tool_response>" in text


def test_claude_code_reads_a_picture(
    served_vision: tuple[RunningServer, Any], tmp_path: Path
) -> None:
    """Claude Code's Read of a PNG sends it back as a tool_result image block."""
    claude = _cli("claude")
    if claude is None:
        pytest.skip("claude is not installed")
    srv, script = served_vision
    path, pixels = _picture(tmp_path)
    script.call = tool_call_markup("Read", file_path=str(path))
    out = _run([claude, "-p", "Look at pic.png"], tmp_path, _claude_env(srv, tmp_path))
    assert "All done." in out
    _read_the_picture(srv, script, pixels)


def test_codex_views_a_picture(served_vision: tuple[RunningServer, Any], tmp_path: Path) -> None:
    """Codex's view_image sends the picture back as a function_call_output input_image."""
    codex = _cli("codex")
    if codex is None:
        pytest.skip("codex is not installed")
    srv, script = served_vision
    work, env = _codex_setup(srv, tmp_path)
    path, pixels = _picture(work)
    script.call = tool_call_markup("view_image", path=str(path))
    out = _run([codex, "exec", "Look at pic.png"], work, env)
    assert "All done." in out
    _read_the_picture(srv, script, pixels)
