"""Start-up: flags checked before loading, a line for each setting that changes the numbers,
loading phases that say what they took, --version and --help without the numerical stack, and
Ctrl-C at any moment (docs/operations.md, "Start-up")."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from dflash_server.cli import load_settings, main
from dflash_server.config_files import SettingsError
from dflash_server.engine import phases
from dflash_server.generation.kv_quant import QUANTIZED_KV_START, config_head_dim
from dflash_server.serve import engine as serve_engine
from dflash_server.serve.preflight import refusal
from server_fixtures import free_port


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("DFLASH_"):
            monkeypatch.delenv(key)


@pytest.fixture
def log_text(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """The server's log lines, whatever an earlier test set its logger's propagation to."""
    logger = logging.getLogger("dflash_server")
    logger.addHandler(caplog.handler)
    level = logger.level
    logger.setLevel(logging.INFO)  # setLevel, not .level =: it clears the enabled-for cache
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)
        logger.setLevel(level)


def test_a_misspelt_flag_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--hlep"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--hlep (did you mean '--help'?)" in err
    with pytest.raises(SystemExit):
        main(["bench", "--concurency", "4"])
    assert "(did you mean '--concurrency'?)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--target", "t", "--data", "d", "--out", "o", "--stpes", "3"])
    assert "(did you mean '--steps'?)" in capsys.readouterr().err


def test_a_misspelt_config_key_names_the_key(tmp_path: Path) -> None:
    config = tmp_path / "mine.toml"
    config.write_text("kv-bit = 4\nport = 9000\n")
    with pytest.raises(SettingsError, match=r"'kv_bit' \(did you mean 'kv_bits'\?\)"):
        load_settings(["--config", str(config)])


def test_head_size_is_read_from_the_config() -> None:
    assert config_head_dim({"head_dim": 128, "hidden_size": 4096, "num_attention_heads": 16}) == 128
    assert config_head_dim({"text_config": {"hidden_size": 2048, "num_attention_heads": 16}}) == 128
    assert config_head_dim({"model_type": "unknown"}) is None
    from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START

    assert QUANTIZED_KV_START == DEFAULT_QUANTIZED_KV_START  # kept without importing mlx-lm


def test_kv_group_size_is_checked_before_loading(tmp_path: Path) -> None:
    """The group size against the head size in config.json: refused naming the flag and the
    group sizes that fit; nothing to refuse without --kv-bits or with a size that fits."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"text_config": {"head_dim": 96}}))
    target = ["--target", str(folder), "--draft", "none"]
    problem = refusal(load_settings([*target, "--kv-bits", "4"]), folder)
    assert problem is not None and problem.startswith("--kv-group-size 64 does not divide")
    assert problem.endswith("head size 96 (--kv-bits quantizes each head in groups): pass "
                            "--kv-group-size 32")  # fmt: skip
    assert (
        refusal(load_settings([*target, "--kv-bits", "4", "--kv-group-size", "32"]), folder) is None
    )
    assert refusal(load_settings(target), folder) is None


def test_kv_group_size_refused_in_one_line_before_loading(
    tiny_hybrid_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--target", str(tiny_hybrid_path), "--draft", "none", "--kv-bits", "4"]
    assert main([*argv, "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "attention head size 16" in err, err
    assert "no group size (32, 64, 128) does: leave out --kv-bits" in err


def test_settings_that_change_the_numbers_are_logged(
    tiny_hybrid_path: Path,
    draft_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    log_text: pytest.LogCaptureFixture,
) -> None:
    """A fixed block size above the drafter's trained block, a context above the model's, the
    KV quantization in force: each gets a start-up line saying what runs."""
    monkeypatch.setattr(
        serve_engine, "load_models", partial(serve_engine.load_models, measure=False)
    )  # no cost measurement: only the lines are under test
    argv = ["--target", str(tiny_hybrid_path), "--draft", str(draft_path), "--block-size", "40"]
    argv += ["--context-length", "100000000", "--kv-bits", "8", "--calibration-cache", "off"]
    serve_engine.build_loader(load_settings(argv), None)()
    text = log_text.text
    assert "--block-size 40 is outside the drafter's 2..8 (its trained block): runs as 8" in text
    assert "--context-length 100000000 is above the model's limit: capped to 32768" in text
    assert (
        "KV cache: attention K/V quantized to 8 bits in groups of 64, from a request's token "
        "5000 on" in text
    )
    log_text.clear()
    plain = [*argv[:4], "--block-size", "4", "--calibration-cache", "off"]
    serve_engine.build_loader(load_settings(plain), None)()
    assert "--block-size" not in log_text.text and "KV cache" not in log_text.text


def test_a_long_phase_says_what_it_took_and_compiled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, log_text: pytest.LogCaptureFixture
) -> None:
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    monkeypatch.setattr(phases, "kernel_folder", lambda: kernels)
    with phases.phase("quick"):  # under a second: not worth a line
        pass
    with phases.phase("drafter loaded", long_s=0):
        for name in ("a.so", "b.so"):
            (kernels / name).write_bytes(b"")
    assert "quick" not in log_text.text
    assert "drafter loaded: 0.0 s, 2 MLX CPU kernels compiled on first use" in log_text.text


def test_a_cold_kernel_folder_is_announced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, log_text: pytest.LogCaptureFixture
) -> None:
    import mlx.core as mx

    monkeypatch.setattr(phases, "kernel_folder", lambda: tmp_path / "none-yet")
    phases.announce_kernels()
    on_cpu = mx.default_device().type == mx.cpu
    assert ("MLX compiles its CPU kernels on this first start" in log_text.text) == on_cpu


HEAVY = ("mlx", "mlx_lm", "transformers", "numpy", "huggingface_hub", "fastapi", "uvicorn")
COMMANDS_WITHOUT_THE_STACK = f"""
import sys
from dflash_server.cli import main

def heavy():
    return sorted({{m.split(".")[0] for m in sys.modules}} & set({HEAVY!r}))

assert main(["--version"]) == 0 and not heavy() and "pydantic" not in sys.modules, heavy()
for argv in (["bench", "--help"], ["train", "--help"], ["convert", "--help"], ["--help"],
             ["export", "--help"]):
    try:
        main(argv)
    except SystemExit as exc:
        assert exc.code == 0, argv
    assert not heavy(), (argv, heavy())
print("imported none of them")
"""


@pytest.mark.slow
def test_version_and_help_import_no_numerical_stack() -> None:
    """--version and every --help answer without MLX, mlx-lm, transformers (seconds of
    imports); --version without pydantic either."""
    run = subprocess.run(
        [sys.executable, "-c", COMMANDS_WITHOUT_THE_STACK],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and run.stdout.endswith("imported none of them\n"), run.stderr


def _wait_until_mlx_is_mapped(pid: int, timeout: float = 60) -> None:
    """Until the process has MLX's library mapped: the stack's imports (seconds) have begun.
    Without /proc, half a second."""
    maps = Path(f"/proc/{pid}/maps")
    if not maps.exists():
        time.sleep(0.5)
        return
    deadline = time.monotonic() + timeout
    while "libmlx" not in maps.read_text():
        assert time.monotonic() < deadline, "MLX never loaded"
        time.sleep(0.005)


@pytest.mark.slow
def test_ctrl_c_while_importing_exits_130_with_one_line(tiny_hybrid_path: Path) -> None:
    cmd = [sys.executable, "-m", "dflash_server.cli", "--target", str(tiny_hybrid_path)]
    cmd += ["--draft", "none", "--port", str(free_port())]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _wait_until_mlx_is_mapped(proc.pid)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and err == "dflash-serve: interrupted (Ctrl-C)\n", err
