"""Load targets (through mlx-lm) and DFlash drafters from a local folder or a hub repo."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import infer_quant_config

from dflash_server.models.drafter import DFlashConfig, DFlashDraftModel

_DRAFT_PATTERNS = ["*.safetensors", "*.json"]


def resolve_model_path(repo_or_path: str | Path, allow_patterns: list[str] | None = None) -> Path:
    """A local folder as is; otherwise a hub snapshot (cached, progress bar, HF_HUB_OFFLINE aware)."""
    path = Path(repo_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise FileNotFoundError(f"{path} is a file; pass the model's folder")
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(repo_or_path), allow_patterns=allow_patterns))


def load(path_or_repo: str | Path, **kwargs: Any) -> tuple[nn.Module, Any]:
    """Load a target model and its tokenizer with mlx-lm (any architecture mlx-lm supports)."""
    from mlx_lm import load as mlx_lm_load

    return mlx_lm_load(str(path_or_repo), **kwargs)


def load_draft(path_or_repo: str | Path, target: nn.Module | None = None) -> DFlashDraftModel:
    """Load a DFlash drafter unmodified; quantized MLX exports included. Binds ``target`` if given."""
    path = resolve_model_path(path_or_repo, _DRAFT_PATTERNS)
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"no config.json in {path}: is this a DFlash drafter folder?")
    raw = json.loads(config_file.read_text())
    config = DFlashConfig.from_dict(raw)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(mx.load(str(f)))
    model = DFlashDraftModel(config)
    if (quantization := raw.get("quantization")) is not None:
        quantize_like_checkpoint(model, quantization, weights)
    load_weights_strict(model, weights, source=str(path))
    model.eval()
    mx.eval(model.parameters())
    if target is not None:
        model.bind(target)
    return model


def quantize_like_checkpoint(
    model: nn.Module, quantization: dict[str, Any], weights: dict[str, mx.array]
) -> None:
    """Swap in quantized layers where the checkpoint stores packed weights (mlx-lm's convention)."""

    def predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
        if isinstance(quantization.get(path), dict):  # per-module override
            return quantization[path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return infer_quant_config(path, module, weights)

    nn.quantize(
        model,
        group_size=quantization.get("group_size", 64),
        bits=quantization.get("bits", 4),
        mode=quantization.get("mode", "affine"),
        class_predicate=predicate,
    )


def load_weights_strict(model: nn.Module, weights: dict[str, mx.array], source: str) -> None:
    """Load with a readable error listing missing/unexpected/mis-shaped tensors."""
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    shapes = [
        f"{k}: checkpoint {tuple(weights[k].shape)} vs model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in weights and weights[k].shape != v.shape
    ]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)}: {', '.join(missing[:8])}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)}: {', '.join(unexpected[:8])}")
        if shapes:
            parts.append(f"wrong shape: {'; '.join(shapes[:4])}")
        raise ValueError(
            f"drafter weights in {source} do not match its config.json ({' | '.join(parts)}). "
            "Is this a DFlash drafter checkpoint, with a config.json from the same export?"
        )
    model.load_weights(list(weights.items()), strict=True)
