"""Optional: the real agent CLIs, unmodified, complete a turn against the server.

Runs ``claude -p`` (Claude Code, ANTHROPIC_BASE_URL) and ``codex exec`` (Codex CLI, a custom
provider with ``wire_api = "responses"``) when they are on PATH (or in ``$DFLASH_CLI_BIN``);
skipped otherwise. The server is the tiny fixture model with scripted output (the CLIs' own
prompts are 20-40k tokens, their tools Bash, namespaces, web search...) and a context large
enough for them; only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dflash_server.testing import build_target
from server_fixtures import RunningServer, ScriptedGenerate, build_draft, make_app, run_server

CONTEXT = 400_000
ANSWER = ["</think>\n\n", "All ", "done", "."]


def _cli(name: str) -> str | None:
    extra = os.environ.get("DFLASH_CLI_BIN")
    return shutil.which(name, path=f"{extra}:{os.environ['PATH']}" if extra else None)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, Any]]:
    if _cli("claude") is None and _cli("codex") is None:
        pytest.skip("neither claude nor codex is installed")
    root = tmp_path_factory.mktemp("e2e")
    target = build_target(root / "target", arch="qwen3_5")
    config = json.loads((target / "config.json").read_text())
    for part in (config, config.get("text_config", {})):  # room for the CLIs' prompts
        part["max_position_embeddings"] = CONTEXT
    (target / "config.json").write_text(json.dumps(config))
    script = ScriptedGenerate(ANSWER)
    app = make_app(
        target,
        build_draft(root / "draft", target),
        generate=script,
        served_model_name="tiny",
        context_length=CONTEXT,
    )
    with run_server(app) as srv:
        yield srv, script


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
    env = {
        "HOME": str(tmp_path),
        "ANTHROPIC_BASE_URL": srv.base_url,
        "ANTHROPIC_API_KEY": "x",
        "ANTHROPIC_MODEL": "tiny",
        "ANTHROPIC_SMALL_FAST_MODEL": "tiny",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    out = _run([claude, "-p", "Say hi"], tmp_path, env)
    assert "All done." in out
    request = script.calls[-1]["request"]
    assert len(request.prompt) > 10_000  # its real system prompt and tools


def test_codex_exec_completes_a_turn(served: tuple[RunningServer, Any], tmp_path: Path) -> None:
    codex = _cli("codex")
    if codex is None:
        pytest.skip("codex is not installed")
    srv, script = served
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
    out = _run([codex, "exec", "Say hi"], work, {"HOME": str(tmp_path), "CODEX_HOME": str(home)})
    assert "All done." in out
    assert len(script.calls[-1]["request"].prompt) > 10_000
