"""Settings precedence, presets and the ``dflash-serve`` command line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from dflash_server.cli import SUBCOMMANDS, build_parser, load_settings, main
from dflash_server.config_files import DEFAULT_PRESET, SettingsError, list_presets
from dflash_server.settings import Settings
from server_fixtures import ServeProcess, build_draft, free_port


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("DFLASH_"):
            monkeypatch.delenv(key)


def test_presets_ship_the_required_pairs() -> None:
    presets = {name: Settings.load(config=name) for name in list_presets()}
    pairs = {(s.target, s.draft) for s in presets.values()}
    assert ("mlx-community/Qwen3.5-4B-bf16", "z-lab/Qwen3.5-4B-DFlash") in pairs
    assert any(d == "z-lab/Qwen3.5-9B-DFlash" and "9B" in t for t, d in pairs)
    assert any(d == "guglxni/Qwen3.5-9B-abliterated-DFlash" and "4bit" in t for t, d in pairs)
    # One preset per drafter family, each a published drafter for a Qwen3.5-family target.
    assert {"z-lab/Qwen3.8-27B-DFlash2", "RadixArk/Qwen3.8-27B-DSpark", "mtp",
            "VirVen/Qwen3.5-27B-EAGLE3-v2/compressed"} <= {d for _, d in pairs}  # fmt: skip


def test_default_preset_when_no_model_is_named() -> None:
    s = load_settings([])
    preset = Settings.load(config=DEFAULT_PRESET)
    assert (s.target, s.draft) == (preset.target, preset.draft)
    assert s.model_id == preset.model_id and s.port == 8000 and s.host == "127.0.0.1"


def test_precedence_cli_over_env_over_file_over_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "my.toml"
    cfg.write_text(
        'target = "file/target"\ndraft = "file/draft"\nport = 1111\nmax-queue = 3\n'
        "top_k = 7\nenable_thinking = false\n"
    )
    monkeypatch.setenv("DFLASH_PORT", "2222")
    monkeypatch.setenv("DFLASH_TOP_K", "9")
    monkeypatch.setenv("DFLASH_ALLOWED_ORIGINS", "http://a.example, http://b.example")
    s = load_settings(["--config", str(cfg), "--port", "3333", "--enable-thinking"])
    assert s.port == 3333  # CLI beats env and file
    assert s.top_k == 9  # env beats file
    assert s.max_queue == 3 and s.target == "file/target"  # file beats defaults
    assert s.enable_thinking is True
    assert s.allowed_origins == ["http://a.example", "http://b.example"]
    assert s.temperature == 1.0 and s.keepalive == 10.0  # defaults


def test_env_config_and_json_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"target": "j/t", "draft": "j/d", "allowed_origins": ["*"]}))
    monkeypatch.setenv("DFLASH_CONFIG", str(cfg))
    s = load_settings(["--no-enable-thinking", "--served-model-name", "m"])
    assert (s.target, s.allowed_origins, s.enable_thinking, s.model_id) == (
        "j/t",
        ["*"],
        False,
        "m",
    )


def test_config_without_models_keeps_default_models(tmp_path: Path) -> None:
    cfg = tmp_path / "port.toml"
    cfg.write_text("port = 9999\ntemperature = 0.5\n")
    s = load_settings(["--config", str(cfg)])
    assert s.port == 9999 and s.temperature == 0.5
    assert s.target == Settings.load(config=DEFAULT_PRESET).target


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--draft", "a/b"], "--draft was given without --target"),
        (["--config", "no-such-preset"], "not found"),
        (["--port", "99999"], "--port"),
        (["--block-size", "0"], "--block-size"),
    ],
)
def test_bad_settings_are_one_line(argv: list[str], needle: str) -> None:
    with pytest.raises(SettingsError, match=needle):
        load_settings(argv)


def test_a_bad_environment_variable_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_PORT", "notaport")
    with pytest.raises(SettingsError, match=r"^DFLASH_PORT='notaport': .*integer") as info:
        load_settings([])
    assert "--port" not in str(info.value)
    assert load_settings(["--port", "9000"]).port == 9000  # the flag wins, the variable unread


def test_every_settings_field_has_a_flag() -> None:
    flags = {a.dest for a in build_parser()._actions}
    assert set(Settings.model_fields) <= flags


def test_main_reports_errors_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--draft", "a/b"]) == 2  # a settings error (a drafter for no target)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    missing = str(tmp_path / "missing")
    port = ["--port", str(free_port())]  # the port is checked first: one that is free
    assert main(["--target", missing, "--draft", missing, *port]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dflash-serve: error: target") and err.count("\n") == 1
    # A hub id that cannot be fetched (tests run with HF_HUB_OFFLINE=1).
    assert main(["--target", "nobody-xyz/model", "--draft", "nobody-xyz/drafter", *port]) == 1
    err = capsys.readouterr().err
    assert "nobody-xyz/model" in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.slow
def test_dflash_serve_process_starts_logs_and_serves(
    tiny_hybrid_path: Path, draft_path: Path, calibration_cache: Path
) -> None:
    """The real command: startup log lines, /health, a chat request, clean Ctrl-C (130, the
    shell's status for it, after the graceful shutdown)."""
    port = free_port()
    cmd = [sys.executable, "-m", "dflash_server.cli", "--target", str(tiny_hybrid_path)]
    cmd += ["--draft", str(draft_path), "--port", str(port), "--served-model-name", "tiny"]
    # The session's calibration (the autouse fixture above cleared the DFLASH_* variables).
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DFLASH_CALIBRATION_CACHE": str(calibration_cache)}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert err.endswith("dflash-serve: stopped (Ctrl-C)\n") and "Traceback" not in err, err
    assert "block size 8" in err and "weights" in err and "ready: serving 'tiny'" in err
    assert "costs from the calibration cache" in err or "calibration saved to" in err


def test_drafter_that_does_not_fit_stops_the_server(
    tiny_hybrid_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A pair that cannot work is refused at startup with one line, and the process exits."""
    from dflash_server.testing import build_target

    wider = build_target(tmp_path / "wide", hidden_size=128)
    draft = build_draft(tmp_path / "draft", wider)  # drafter for a 128-wide target
    argv = ["--target", str(tiny_hybrid_path), "--draft", str(draft)]
    assert main([*argv, "--port", str(free_port()), "--log-level", "error"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("dflash-serve: error: cannot use drafter")
    assert "hidden_size" in err[-1] and "Traceback" not in "\n".join(err)


def test_readme_cli_table_equals_the_flags() -> None:
    """The README's CLI reference is the table generated from Settings, flag for flag."""
    from dflash_server.cli import markdown_table

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert markdown_table() in readme, (
        "README's CLI table is stale: paste the output of "
        "python -c 'from dflash_server.cli import markdown_table; print(markdown_table())'"
    )
    flags = {a.option_strings[0] for a in build_parser()._actions if a.option_strings}
    assert {f"--{n.replace('_', '-')}" for n in Settings.model_fields} == flags - {"-h"}


def test_help_lists_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "convert" in out and "train" in out


def test_busy_port_is_one_line_before_any_loading(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        missing = "/no/such/model"  # never looked at: the port comes first
        assert main(["--target", missing, "--draft", missing, "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"port {port} on 127.0.0.1 is already in use" in err
    assert "--port" in err and "Traceback" not in err


@pytest.mark.slow
def test_ready_is_logged_when_health_is_200(tiny_hybrid_path: Path, draft_path: Path) -> None:
    """The "ready" line comes after every load-time measurement: a request it invites is served.
    A --context-length above the model's limit is reported as capped."""
    port = free_port()
    args = ["--target", str(tiny_hybrid_path), "--draft", str(draft_path), "--port", str(port)]
    server = ServeProcess([*args, "--context-length", "100000000"], slow=2)
    try:
        server.wait_for("ready: serving")
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        code, _ = server.stop(signal.SIGINT)
    finally:
        server.kill()
    assert code == 130, server.output
    assert "measuring pass costs" in server.output
    assert "--context-length 100000000 is above the model's limit: capped to 32768" in server.output


def test_version_and_mistyped_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("dflash-serve 0.")
    assert main(["bnech", "--config", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dflash-serve: error: no subcommand 'bnech' (did you mean 'bench'?)")
    assert all(name in err for name in ("convert", "train", "export", "bench"))
    assert err.count("\n") <= 2 + len(SUBCOMMANDS)  # not the usage of every flag
    with pytest.raises(SystemExit) as exit_:
        main(["--prot", "9000"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unrecognized arguments: --prot" in err


def test_slow_blas_is_named_with_the_fix(tmp_path: Path) -> None:
    """On Linux without OpenBLAS in the process, start-up says what to install and set."""
    from dflash_server.engine.blas import blas_hint

    maps = tmp_path / "maps"
    wheel_blas = "7f50-7f51 r-xp 0 fe:00 1 /venv/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0"
    numpy_own = "7f52-7f53 r-xp 0 fe:00 2 /venv/numpy.libs/libscipy_openblas64_-32a4b2a6.so"
    maps.write_text(f"{wheel_blas}\n{numpy_own}\n")
    if sys.platform != "linux":
        assert blas_hint(maps) is None
        return
    hint = blas_hint(maps)
    assert hint is not None and "apt-get install libopenblas0-pthread" in hint
    assert "LD_PRELOAD=" in hint and "\n" not in hint
    openblas = (
        "7f54-7f55 r-xp 0 fe:00 3 /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
    )
    maps.write_text(f"{wheel_blas}\n{openblas}\n")
    assert blas_hint(maps) is None
