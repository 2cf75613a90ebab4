"""The package as users get it: a wheel installed into a fresh venv, run outside the checkout.

Builds the wheel offline (no build isolation: the test extra brings setuptools), installs it
without dependencies into a new venv that borrows this environment's dependencies through a
``.pth`` line, and runs ``dflash-serve`` from a temporary folder, so nothing in the checkout
(``configs/``, ``src/``) can be found by accident.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from server_fixtures import free_port

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # builds a wheel and a venv, runs the CLI four times


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the built wheel, the fresh venv's ``dflash-serve``)."""
    tmp = tmp_path_factory.mktemp("wheel")
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    subprocess.run(
        [*build, "--wheel-dir", str(tmp / "dist"), str(ROOT)],
        check=True,
        capture_output=True,
        cwd=tmp,
    )
    (wheel,) = (tmp / "dist").glob("dflash_server-*.whl")
    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    # This environment's pip installs into the venv (offline; seeding the venv with its own
    # pip takes longer than the whole install).
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps"]
    subprocess.run(
        [*install, "--no-index", "-q", str(wheel)],
        check=True,
        capture_output=True,
        env=_clean_env(tmp),
    )
    # Dependencies come from this environment (no network); the wheel's package shadows the
    # checkout's editable install, whose own .pth files are not processed from here.
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
        env=_clean_env(tmp),
    ).stdout.strip()
    Path(site, "zz_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return wheel, env_dir / "bin" / "dflash-serve"


def _clean_env(home: Path) -> dict[str, str]:
    """No settings, no PYTHONPATH pointing into the checkout, no hub access."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DFLASH_", "PYTHON"))}
    return env | {"HF_HUB_OFFLINE": "1", "HF_HOME": str(home / "hf")}


def _run(exe: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(exe), *args], capture_output=True, text=True, cwd=cwd, env=_clean_env(cwd), timeout=120
    )


def test_the_wheel_ships_presets_and_the_chat_page(installed: tuple[Path, Path]) -> None:
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    presets = {n for n in names if n.startswith("dflash_server/presets/")}
    assert "dflash_server/presets/qwen3.5-4b.toml" in presets
    assert "dflash_server/presets/qwen3.5-9b.toml" in presets
    assert {"dflash_server/web/index.html", "dflash_server/web/app.js"} <= names
    assert "dflash_server/py.typed" in names


def test_the_wheel_ships_the_license(installed: tuple[Path, Path]) -> None:
    """The Apache-2.0 text that pyproject.toml declares, in the wheel's metadata."""
    wheel, _ = installed
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
        text = z.read(name).decode()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert text == (ROOT / "LICENSE").read_text()
    assert 'license = "Apache-2.0"' in (ROOT / "pyproject.toml").read_text()


def test_dflash_serve_from_the_wheel(installed: tuple[Path, Path], tmp_path: Path) -> None:
    _, exe = installed
    help_ = _run(exe, "--help", cwd=tmp_path)
    assert help_.returncode == 0, help_.stderr
    assert "qwen3.5-9b" in help_.stdout  # the preset list in --config's help

    # Offline, a preset resolves and the run stops at the hub, in one line (the port, checked
    # first, is a free one).
    for args in ((), ("--config", "qwen3.5-9b")):
        run = _run(exe, *args, "--port", str(free_port()), cwd=tmp_path)
        assert run.returncode == 1, run.stderr
        (line,) = run.stderr.strip().splitlines()
        assert "hub is unreachable" in line, line
        assert "preset" not in line

    export = _run(exe, "export", "vllm", "--config", "qwen3.5-9b", cwd=tmp_path)
    assert export.returncode == 0, export.stderr
    assert "vllm serve" in export.stdout and "Qwen3.5-9B" in export.stdout
