"""``dflash-serve export vllm|sglang``: the GPU-server command for a preset or a model pair."""

from __future__ import annotations

import json
import os
import shlex
import stat
import sys
from pathlib import Path

import pytest

from dflash_server.cli import main as cli_main
from dflash_server.config_files import list_presets
from dflash_server.tools.export import main

TARGET = "lukey03/Qwen3.5-9B-abliterated"  # what the MLX 4-bit preset was converted from
DRAFT = "guglxni/Qwen3.5-9B-abliterated-DFlash"
# The launch commands of the DFlash model cards (z-lab/Qwen3.5-*-DFlash), for this pair.
CARD_VLLM = f"""vllm serve {TARGET} \\
  --speculative-config '{{"method": "dflash", "model": "{DRAFT}", "num_speculative_tokens": 15}}' \\
  --attention-backend flash_attn \\
  --max-num-batched-tokens 32768"""
CARD_SGLANG = f"""python -m sglang.launch_server \\
    --model-path {TARGET} \\
    --speculative-algorithm DFLASH \\
    --speculative-draft-model-path {DRAFT} \\
    --speculative-num-draft-tokens 16 \\
    --tp-size 1 \\
    --attention-backend fa3 \\
    --mem-fraction-static 0.75 \\
    --mamba-scheduler-strategy extra_buffer \\
    --trust-remote-code"""


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("DFLASH_"):
            monkeypatch.delenv(name)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[list[str], str]:
    """Export; return the command's argv and the comment lines above it."""
    assert main(list(argv)) == 0
    out = capsys.readouterr().out
    notes = "\n".join(line for line in out.splitlines() if line.startswith("#"))
    command = "\n".join(line for line in out.splitlines() if not line.startswith("#"))
    return shlex.split(command.replace("\\\n", " ")), notes


def flags(argv: list[str]) -> dict[str, str | None]:
    """``--flag value`` pairs (None for switches); JSON values parsed for comparison."""
    out: dict[str, str | None] = {}
    for i, word in enumerate(argv):
        if word.startswith("--"):
            value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
            out[word] = value
    return out


def card(text: str) -> tuple[list[str], dict[str, str | None]]:
    argv = shlex.split(text.replace("\\\n", " "))
    return argv, flags(argv)


@pytest.mark.parametrize("engine, card_text", [("vllm", CARD_VLLM), ("sglang", CARD_SGLANG)])
def test_abliterated_preset_matches_the_model_card(
    engine: str, card_text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv, notes = run(capsys, engine, "--config", "qwen3.5-9b-abliterated-4bit")
    card_argv, card_flags = card(card_text)
    head = 3  # 'vllm serve MODEL' / 'python -m sglang.launch_server'
    assert argv[:head] == card_argv[:head]
    got = flags(argv)
    for flag, value in card_flags.items():
        assert flag in got, f"{flag} missing from {argv}"
        if value is not None and value.startswith("{"):
            assert json.loads(got[flag] or "") == json.loads(value)
        else:
            assert got[flag] == value, flag
    assert "MLX" not in " ".join(argv)  # never the MLX 4-bit conversion
    assert got["--served-model-name"] == "qwen3.5-9b-abliterated"
    assert got["--reasoning-parser"] == "qwen3" and got["--tool-call-parser"] == "qwen3_coder"
    assert "block size 16 assumed" in notes  # no drafter config here: the cards' value
    if engine == "vllm":
        generation = json.loads(got["--override-generation-config"] or "")
        assert generation == {
            "temperature": 1.0,
            "top_p": 0.95,
            "top_k": 20,
            "repetition_penalty": 1.05,
        }
        assert "presence_penalty=1.5" in notes  # not a vLLM server default: said so
    else:
        assert got["--sampling-defaults"] == "model"
        assert "presence_penalty=1.5" in notes and "top_k=20" in notes


@pytest.mark.parametrize("preset", list_presets())
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_every_preset_exports(engine: str, preset: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv, _ = run(capsys, engine, "--config", preset)
    model = argv[2] if engine == "vllm" else flags(argv)["--model-path"]
    assert model and "mlx" not in model.lower() and "/" in model
    assert flags(argv)["--port"] == "8000" and "--api-key" not in argv


def test_settings_carry_over(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    draft = tmp_path / "drafter"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"block_size": 8}))
    config = tmp_path / "mine.toml"
    config.write_text("temperature = 0.6\nenable_thinking = false\nmax_tokens = 4096\n")
    argv, notes = run(
        capsys, "vllm", "--config", str(config), "--target", "Qwen/Qwen3.5-4B",
        "--draft", str(draft), "--served-model-name", "mine", "--context-length", "65536",
        "--api-key", "s3cret", "--port", "9000", "--tensor-parallel", "2",
    )  # fmt: skip
    got = flags(argv)
    assert json.loads(got["--speculative-config"] or "")["num_speculative_tokens"] == 7
    assert "assumed" not in notes  # read from the drafter's config.json
    assert got["--served-model-name"] == "mine" and got["--max-model-len"] == "65536"
    assert got["--api-key"] == "s3cret" and got["--port"] == "9000"
    assert got["--tensor-parallel-size"] == "2"
    assert json.loads(got["--override-generation-config"] or "") == {
        "temperature": 0.6, "max_new_tokens": 4096
    }  # fmt: skip
    assert json.loads(got["--default-chat-template-kwargs"] or "") == {"enable_thinking": False}

    argv, _ = run(capsys, "sglang", "--target", "Qwen/Qwen3.5-4B", "--draft", str(draft))
    assert flags(argv)["--speculative-num-draft-tokens"] == "8"
    assert "--context-length" not in argv  # none set: the server uses the model's


def test_local_mlx_target_needs_the_hf_checkpoint(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = ["vllm", "--target", str(tmp_path), "--draft", "z-lab/Qwen3.5-4B-DFlash"]
    assert main(args) == 2
    assert "--hf-target" in capsys.readouterr().err
    argv, _ = run(capsys, *args, "--hf-target", "Qwen/Qwen3.5-4B")
    assert argv[2] == "Qwen/Qwen3.5-4B"


def test_compose_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    yaml = pytest.importorskip("yaml")
    for engine in ("vllm", "sglang"):
        path = tmp_path / f"{engine}.yml"
        key = "k$y"  # '$' is compose interpolation: must be escaped
        run(capsys, engine, "--config", "qwen3.5-4b", "--api-key", key, "--compose", str(path))
        service = yaml.safe_load(path.read_text())["services"][engine]
        command = [c.replace("$$", "$") for c in service["command"]]
        assert "k$$y" in service["command"]
        assert command[-2:] == ["--api-key", key]
        assert command[command.index("--host") + 1] == "0.0.0.0"  # inside the container
        assert service["ports"] == ["127.0.0.1:8000:8000"]  # exposed as the local server is
        assert service["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
        if engine == "vllm":
            assert service["image"].startswith("vllm/vllm-openai")
            assert command[:2] == ["--model", "Qwen/Qwen3.5-4B"]
        else:
            assert command[:3] == ["python3", "-m", "sglang.launch_server"]
        assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it holds the API key


def test_dflash_serve_export_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["export", "sglang", "--config", "qwen3.5-9b"]) == 0
    out = capsys.readouterr().out
    assert "--model-path Qwen/Qwen3.5-9B" in out and "z-lab/Qwen3.5-9B-DFlash" in out


def test_mtp_and_no_drafter_export(capsys: pytest.CaptureFixture[str]) -> None:
    """The checkpoint's own head exports as vLLM's "mtp" method and SGLang's NEXTN; no drafter
    exports no speculation at all."""
    argv, notes = run(capsys, "vllm", "--config", "qwen3.5-4b-mtp")
    assert json.loads(flags(argv)["--speculative-config"] or "") == {
        "method": "mtp", "num_speculative_tokens": 3
    }  # fmt: skip
    assert "DFlash" not in notes
    argv, _ = run(capsys, "sglang", "--config", "qwen3.5-4b-mtp", "--block-size", "3")
    got = flags(argv)
    assert got["--speculative-algorithm"] == "NEXTN" and got["--speculative-num-steps"] == "2"
    for engine in ("vllm", "sglang"):
        argv, _ = run(capsys, engine, "--target", "Qwen/Qwen3.5-4B")
        assert not any(a.startswith("--speculative") for a in argv), argv


def test_mlx_launch_over_several_macs(capsys: pytest.CaptureFixture[str]) -> None:
    """``export mlx``: mlx.launch, '--' (its --hosts would swallow --host), then dflash-serve
    with the same settings on every Mac."""
    argv, notes = run(capsys, "mlx", "--hosts", "10.0.0.1,10.0.0.2", "--config", "qwen3.5-9b",
                      "--host", "0.0.0.0", "--port", "9000")  # fmt: skip
    # Both commands by their full path beside this Python: ssh's PATH has no .venv on it.
    launcher, serve = Path(sys.executable).parent / "mlx.launch", argv[argv.index("--") + 1]
    assert argv[0] == (str(launcher) if launcher.is_file() else "mlx.launch")
    assert Path(serve).name == "dflash-serve" and (Path(serve).is_file() or serve == "dflash-serve")
    assert argv[1:] == ["--hosts", "10.0.0.1,10.0.0.2", "--backend", "ring", "--", serve,
                        "--config", "qwen3.5-9b", "--host", "0.0.0.0", "--port",
                        "9000"]  # fmt: skip
    assert "rank 0" in notes and "ready: serving" in notes
    argv, notes = run(capsys, "mlx", "--hostfile", "hosts.json", "--backend", "jaccl")
    assert argv[1:5] == ["--hostfile", "hosts.json", "--backend", "jaccl"]
    assert "only clients on the first Mac reach it" in notes  # the default --host 127.0.0.1


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["mlx"], "needs --hosts IP1,IP2 or --hostfile FILE"),
        (["mlx", "--hosts", "mac1,mac2"], "connects to IP addresses"),
        (["mlx", "--hosts", "10.0.0.1,10.0.0.2", "--backend", "jaccl"], "JACCL needs a hostfile"),
        (["vllm", "--hosts", "10.0.0.1"], "are for 'export mlx'"),
    ],
)
def test_mlx_launch_refusals(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert says in capsys.readouterr().err
