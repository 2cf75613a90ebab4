"""An offline tiny Qwen3.5 vision-language checkpoint: the text model of ``build_target`` plus a
small random vision tower and merger (mlx-vlm's classes), in a real checkpoint's layout.

The folder has what a downloaded Qwen3.5 holds: ``config.json`` with ``text_config``,
``vision_config`` and the vision token ids, weights under either the original names
(``model.language_model.*``, ``model.visual.*``, ``lm_head.*``, PyTorch tensor layouts, norm
weights stored as offsets from 1) or mlx-vlm's converted ones (``language_model.*``,
``vision_tower.*``), and a ``preprocessor_config.json`` for mlx-vlm's image processor. Both
mlx-lm (the text model alone) and mlx-vlm (the whole model) load it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_server.models.loading import flat_arrays, load_arrays
from dflash_server.testing import SPECIAL_TOKENS, build_target

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
LAYOUTS = ("mlx-vlm", "original")
# mlx-lm's and mlx-vlm's sanitizers add 1 to these norm weights of original checkpoints.
_OFFSET_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)


def build_vision_target(
    path: Path,
    *,
    layout: str = "mlx-vlm",
    hidden_size: int = 64,
    num_hidden_layers: int = 4,
    vocab_size: int | None = None,
    vision_depth: int = 2,
    vision_hidden_size: int = 32,
    min_pixels: int = 64 * 64,
    max_pixels: int = 256 * 256,
    seed: int = 0,
) -> Path:
    """Write a random float32 Qwen3.5 vision-language folder; return ``path``.

    Heads of 64 with a quarter rotated give 8 rotary frequencies over ``mrope_section`` [3, 3,
    2], so image tokens' height and width positions both reach the attention. Images become
    (h/32)·(w/32) tokens (patch 16, merge 2) within ``min_pixels`` .. ``max_pixels``. Wrong
    image features or positions change its greedy answer within a few tokens.
    """
    import mlx.core as mx
    from mlx_vlm.models.qwen3_5 import VisionConfig, VisionModel

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    path = Path(path)
    rope = {
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [3, 3, 2],
        "mrope_interleaved": True,
    }
    build_target(
        path,
        arch="qwen3_5",
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        vocab_size=vocab_size,
        seed=seed,
        special=SPECIAL_TOKENS + VISION_TOKENS,
        text_overrides={"head_dim": 64, "rope_parameters": rope},
    )
    ids = {
        t["content"]: t["id"]
        for t in json.loads((path / "tokenizer.json").read_text())["added_tokens"]
    }
    vision: dict[str, Any] = {
        "model_type": "qwen3_5",
        "depth": vision_depth,
        "hidden_size": vision_hidden_size,
        "intermediate_size": 2 * vision_hidden_size,
        "num_heads": max(2, vision_hidden_size // 64),
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": hidden_size,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [],
        "hidden_act": "gelu_pytorch_tanh",
    }
    config = json.loads((path / "config.json").read_text())
    config.update(
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    mx.random.seed(seed + 1)
    tower = VisionModel(VisionConfig.from_dict(vision))
    tower.set_dtype(mx.float32)
    # Random init leaves the features ~5x smaller than the text embeddings, so the images would
    # barely change the answer: scale the merger's output layer up to match.
    fc2 = tower.merger.linear_fc2
    fc2.weight, fc2.bias = fc2.weight * 5.0, fc2.bias * 5.0
    mx.eval(tower.parameters())
    weights = load_arrays(path / "model.safetensors")
    weights |= {f"vision_tower.{k}": v for k, v in flat_arrays(tower.parameters())}
    # Random layers wash the context out (the answer follows the last token); louder attention
    # makes the images, and the positions they sit at, change the greedy answer within tokens.
    for key in [k for k in weights if k.endswith("self_attn.o_proj.weight")]:
        weights[key] = weights[key] * 16.0
    if layout == "original":
        weights = dict(_original(k, v) for k, v in weights.items())
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    index = path / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = dict.fromkeys(sorted(weights), "model.safetensors")
        index.write_text(json.dumps(data, indent=2))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    processor = {
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "processor_class": "Qwen3VLProcessor",
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
    }
    (path / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    return path


def _original(key: str, value: Any) -> tuple[str, Any]:
    """A converted tensor under its original checkpoint name and PyTorch layout."""
    if key.startswith("vision_tower."):
        key = "model.visual." + key.removeprefix("vision_tower.")
        if key.endswith("patch_embed.proj.weight"):  # MLX [out, t, h, w, in] -> [out, in, t, h, w]
            value = value.transpose(0, 4, 1, 2, 3)
        return key, value
    if key.startswith("language_model.lm_head."):
        return key.removeprefix("language_model."), value
    key = "model.language_model." + key.removeprefix("language_model.model.")
    if key.endswith("conv1d.weight"):  # MLX [C, K, 1] -> PyTorch [C, 1, K]
        value = value.moveaxis(2, 1)
    if value.ndim == 1 and key.endswith(_OFFSET_NORMS):
        value = value - 1.0
    return key, value
