"""Shared pytest fixtures: tiny random-weight models built offline, once per session."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before any hub-aware import: tests never touch the network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dflash_server.testing import build_target


def pytest_configure(config: pytest.Config) -> None:
    """Before the workers start (once per temporary directory): compile MLX's CPU kernels, so
    the first run on a fresh machine does not spend a server's start limit compiling
    (tests/warm_kernels.py)."""
    if hasattr(config, "workerinput") or config.option.collectonly:
        return  # a worker: the controller warmed them
    from warm_kernels import marker

    if not marker().exists():
        print("\nwarming MLX's kernels (once per temporary directory) ...", flush=True)
        subprocess.run([sys.executable, str(Path(__file__).parent / "warm_kernels.py")], check=True)


@pytest.fixture(scope="session")
def tiny_hybrid_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random qwen3_5 (Gated DeltaNet + full attention every 4th layer) model folder."""
    return build_target(tmp_path_factory.mktemp("models") / "tiny-qwen3_5", arch="qwen3_5")


@pytest.fixture(scope="session")
def tiny_attn_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random qwen3 (plain attention) model folder."""
    return build_target(tmp_path_factory.mktemp("models") / "tiny-qwen3", arch="qwen3")


@pytest.fixture(scope="session")
def tiny_hybrid(tiny_hybrid_path: Path) -> tuple[Any, Any]:
    """``mlx_lm.load(tiny_hybrid_path)``: (model, TokenizerWrapper)."""
    import mlx_lm

    return mlx_lm.load(str(tiny_hybrid_path))


@pytest.fixture(scope="session")
def tiny_attn(tiny_attn_path: Path) -> tuple[Any, Any]:
    """``mlx_lm.load(tiny_attn_path)``: (model, TokenizerWrapper)."""
    import mlx_lm

    return mlx_lm.load(str(tiny_attn_path))


@pytest.fixture(scope="session")
def tiny_vl_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen3.5 vision-language folder (mlx-vlm's layout): the tiny hybrid text model
    plus a small vision tower and merger, with mlx-vlm's image processor config."""
    from dflash_server.testing.vision import build_vision_target

    return build_vision_target(tmp_path_factory.mktemp("models") / "tiny-vl")


@pytest.fixture(scope="session")
def tiny_vl(tiny_vl_path: Path) -> tuple[Any, Any, Any]:
    """(model, TokenizerWrapper, VisionTower): ``mlx_lm.load`` and ``load_vision``."""
    import mlx_lm

    from dflash_server.models.vision import load_vision

    model, tokenizer = mlx_lm.load(str(tiny_vl_path))
    return model, tokenizer, load_vision(tiny_vl_path)


@pytest.fixture(scope="session")
def draft_path(tiny_hybrid_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small drafter folder for the tiny hybrid target (one per session: one fingerprint, so
    the calibration cache measures this pair once)."""
    from server_fixtures import build_draft

    return build_draft(tmp_path_factory.mktemp("draft") / "d", tiny_hybrid_path)


@pytest.fixture(scope="session")
def draft4_path(tiny_hybrid_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same with block size 4 (one per session)."""
    from server_fixtures import build_draft

    return build_draft(tmp_path_factory.mktemp("draft") / "d4", tiny_hybrid_path, block_size=4)


@pytest.fixture(scope="session", autouse=True)
def calibration_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One calibration cache for the whole session (servers started in-process and as
    subprocesses read it from the environment): each pair is measured once, and the user's own
    cache is never touched."""
    folder = tmp_path_factory.mktemp("calibration")
    os.environ["DFLASH_CALIBRATION_CACHE"] = str(folder)
    yield folder
    del os.environ["DFLASH_CALIBRATION_CACHE"]
