"""The target hooks check themselves when installed: an mlx-lm that changed fails at load time."""

from __future__ import annotations

from pathlib import Path

import mlx_lm
import pytest
from mlx_lm.models import gated_delta, qwen3_5

from dflash_server.generation.target import TargetModel
from dflash_server.models.hooks import HookError, TargetHooks


def test_hooks_are_scoped_to_a_recording(tiny_hybrid) -> None:
    model, _ = tiny_hybrid
    hooks = TargetHooks.of(model)
    original = qwen3_5.gated_delta_update
    with hooks.recording():
        assert qwen3_5.gated_delta_update is not original  # swapped only while recording
    assert qwen3_5.gated_delta_update is original and hooks.active is None


def test_renamed_recurrence_fails_at_install(tiny_hybrid_path: Path, monkeypatch) -> None:
    model, _ = mlx_lm.load(str(tiny_hybrid_path))  # a fresh model: hooks not installed yet
    monkeypatch.delattr(qwen3_5, "gated_delta_update")
    with pytest.raises(HookError, match=r"mlx-lm \S+ changed .*gated_delta_update"):
        TargetHooks.of(model)


def test_recurrence_called_another_way_fails_the_self_check(
    tiny_hybrid_path: Path, monkeypatch
) -> None:
    """A layer that no longer calls the function through its module (e.g. a re-import)."""
    model, _ = mlx_lm.load(str(tiny_hybrid_path))
    direct = gated_delta.gated_delta_update
    original_call = qwen3_5.GatedDeltaNet.__call__

    def call(self, *args, **kwargs):
        saved = qwen3_5.gated_delta_update
        qwen3_5.gated_delta_update = direct  # bypasses whatever was installed
        try:
            return original_call(self, *args, **kwargs)
        finally:
            qwen3_5.gated_delta_update = saved

    monkeypatch.setattr(qwen3_5.GatedDeltaNet, "__call__", call)
    with pytest.raises(HookError, match="0 of 3 Gated DeltaNet layers"):
        TargetModel(model, ())
