"""Drafter checkpoint compatibility: config parsing, weight names, loading, pairing checks."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from dflash_server import DFlashConfig, DFlashDraftModel, load_draft, stream_generate
from dflash_server.drafters.config import default_target_layer_ids
from dflash_server.testing import random_drafter

# The published z-lab/Qwen3.5-4B-DFlash config.json, as downloaded (sizes only shrunk in tests).
PUBLISHED_4B = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": 2560,
    "num_hidden_layers": 5,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 9728,
    "vocab_size": 248320,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000000,
    "max_position_embeddings": 262144,
    "block_size": 16,
    "num_target_layers": 32,
    "dflash_config": {"target_layer_ids": [1, 8, 15, 22, 29], "mask_token_id": 248070},
}


def published_keys(n_layers: int) -> list[str]:
    """The published checkpoints' tensor names (docs/design.md, "Drafter families"): no embedding,
    no lm_head."""
    keys = ["fc.weight", "hidden_norm.weight", "norm.weight"]
    for i in range(n_layers):
        p = f"layers.{i}."
        keys += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        keys += [p + f"self_attn.{m}.weight" for m in ("q_proj", "k_proj", "v_proj", "o_proj")]
        keys += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        keys += [p + f"mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
    return sorted(keys)


def test_published_config_parses_and_matches_checkpoint_layout():
    config = DFlashConfig.from_dict(PUBLISHED_4B)
    assert config.target_layer_ids == (1, 8, 15, 22, 29)
    assert (config.mask_token_id, config.block_size, config.rope_theta) == (248070, 16, 1e7)
    # Shapes only (no weights materialised): mlx arrays are lazy until evaluated.
    shapes = {k: v.shape for k, v in tree_flatten(DFlashDraftModel(config).parameters())}
    assert sorted(shapes) == published_keys(5)
    assert len(shapes) == 58
    assert shapes["fc.weight"] == (2560, 5 * 2560)
    assert shapes["layers.0.self_attn.q_proj.weight"] == (32 * 128, 2560)
    assert shapes["layers.0.self_attn.k_proj.weight"] == (8 * 128, 2560)
    assert shapes["layers.0.self_attn.o_proj.weight"] == (2560, 32 * 128)
    assert shapes["layers.0.self_attn.q_norm.weight"] == (128,)
    assert shapes["layers.4.mlp.down_proj.weight"] == (2560, 9728)


def test_config_variants():
    cfg = {k: v for k, v in PUBLISHED_4B.items() if k != "rope_theta"}
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e6}
    assert DFlashConfig.from_dict(cfg).rope_theta == 5e6

    cfg = json.loads(json.dumps(PUBLISHED_4B))
    del cfg["dflash_config"]["target_layer_ids"]
    assert DFlashConfig.from_dict(cfg).target_layer_ids == (1, 8, 15, 22, 29)
    assert default_target_layer_ids(32, 1) == (16,)

    cfg = json.loads(json.dumps(PUBLISHED_4B))
    cfg["layer_types"] = ["sliding_attention"] * 4 + ["full_attention"]
    cfg["sliding_window"] = 2048
    parsed = DFlashConfig.from_dict(cfg)
    assert parsed.sliding_window == 2048 and parsed.layer_types[0] == "sliding_attention"

    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    assert DFlashConfig.from_dict(cfg).rope_scaling["factor"] == 2.0


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        ("hidden_size", "hidden_size"),
        ("rope_theta", "rope_theta"),
        ("dflash_config", "mask_token_id"),
    ],
)
def test_config_errors_name_the_missing_key(drop, message):
    cfg = {k: v for k, v in PUBLISHED_4B.items() if k != drop}
    with pytest.raises(ValueError, match=message):
        DFlashConfig.from_dict(cfg)


def test_bad_config_values():
    cfg = json.loads(json.dumps(PUBLISHED_4B))
    cfg["layer_types"] = ["sliding_attention"] * 5
    with pytest.raises(ValueError, match="sliding_window"):
        DFlashConfig.from_dict(cfg)
    cfg = json.loads(json.dumps(PUBLISHED_4B))
    cfg["dflash_config"].pop("target_layer_ids")
    cfg.pop("num_target_layers")
    with pytest.raises(ValueError, match="target_layer_ids"):
        DFlashConfig.from_dict(cfg)


def save_drafter(draft: DFlashDraftModel, path: Path, extra: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(draft.parameters())))
    (path / "config.json").write_text(json.dumps({**draft.config.to_dict(), **(extra or {})}))
    return path


def draft_logits(draft: DFlashDraftModel, model, seed: int = 0) -> mx.array:
    mx.random.seed(seed)
    taps = mx.random.normal((1, 7, len(draft.config.target_layer_ids) * draft.config.hidden_size))
    block = mx.array([[3] + [draft.config.mask_token_id] * (draft.config.block_size - 1)])
    draft.bind(model)
    return draft(block, taps, draft.make_cache())


def test_round_trip_save_load(tiny_hybrid, tmp_path):
    model, _ = tiny_hybrid
    draft = random_drafter(model, block_size=8)
    loaded = load_draft(save_drafter(draft, tmp_path / "d"), target=model)
    assert mx.allclose(draft_logits(draft, model), draft_logits(loaded, model), atol=1e-5)


def test_quantized_drafter_loads_and_runs(tiny_hybrid, tmp_path):
    model, tokenizer = tiny_hybrid
    draft = random_drafter(model, block_size=4)
    reference = draft_logits(draft, model)
    nn.quantize(draft, group_size=32, bits=6)  # hidden 64: the group must divide it
    save_drafter(draft, tmp_path / "q", {"quantization": {"group_size": 32, "bits": 6}})
    loaded = load_draft(tmp_path / "q", target=model)
    assert isinstance(loaded.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert isinstance(loaded.fc, nn.QuantizedLinear)
    assert mx.allclose(draft_logits(loaded, model), reference, atol=0.5)
    out = list(stream_generate(model, loaded, tokenizer, "hello", max_tokens=8))
    assert sum(len(r.tokens) for r in out) == 8


def test_weight_mismatch_lists_missing_and_unexpected(tiny_hybrid, tmp_path):
    model, _ = tiny_hybrid
    draft = random_drafter(model, block_size=4)
    path = save_drafter(draft, tmp_path / "bad")
    weights = mx.load(str(path / "model.safetensors"))
    weights["model.fc.weight"] = weights.pop("fc.weight")
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    with pytest.raises(ValueError, match=r"missing 1: fc\.weight.*unexpected 1: model\.fc\.weight"):
        load_draft(path)


def test_mismatched_pair_is_refused(tiny_hybrid, tiny_attn):
    model, _ = tiny_hybrid
    draft = random_drafter(model)
    cfg = draft.config
    wider = DFlashDraftModel(DFlashConfig(**{**cfg.__dict__, "hidden_size": 96}))
    with pytest.raises(ValueError, match=r"hidden_size 96 != target's 64"):
        wider.bind(model)
    deep = DFlashDraftModel(DFlashConfig(**{**cfg.__dict__, "target_layer_ids": (1, 40)}))
    with pytest.raises(ValueError, match=r"target_layer_ids \[40\]"):
        deep.bind(model)


def test_model_card_usage(tiny_hybrid, tmp_path):
    """DFlashDraftModel(DFlashConfig(...)) + load_weights(list(weights.items())) + stream_generate."""
    model, tokenizer = tiny_hybrid
    path = save_drafter(random_drafter(model, block_size=4), tmp_path / "card")
    c = json.loads((path / "config.json").read_text())
    draft = DFlashDraftModel(
        DFlashConfig(
            hidden_size=c["hidden_size"],
            num_hidden_layers=c["num_hidden_layers"],
            num_attention_heads=c["num_attention_heads"],
            num_key_value_heads=c["num_key_value_heads"],
            head_dim=c["head_dim"],
            intermediate_size=c["intermediate_size"],
            vocab_size=c["vocab_size"],
            rms_norm_eps=c["rms_norm_eps"],
            rope_theta=c["rope_theta"],
            max_position_embeddings=c["max_position_embeddings"],
            block_size=c["block_size"],
            target_layer_ids=tuple(c["dflash_config"]["target_layer_ids"]),
            mask_token_id=c["dflash_config"]["mask_token_id"],
        )
    )
    weights = mx.load(str(path / "model.safetensors"))
    draft.load_weights(list(weights.items()))
    text = "".join(r.text for r in stream_generate(model, draft, tokenizer, "def f", max_tokens=6))
    plain = "".join(r.text for r in stream_generate(model, None, tokenizer, "def f", max_tokens=6))
    assert text == plain


def test_hub_id_offline_fails_cleanly():
    with pytest.raises(Exception, match=r"(?i)offline|cannot find|not found|connect"):
        load_draft("z-lab/this-drafter-does-not-exist")


def test_a_folder_inside_a_hub_repo(tiny_hybrid, tmp_path, monkeypatch):
    """``owner/name/compressed`` (drafters shipped in a repo's folder) fetches that folder
    only and loads from it; a repo without it is refused naming the folder."""
    import huggingface_hub

    from dflash_server.engine.loader import ModelLoadError, resolve_model

    model, _ = tiny_hybrid
    snapshot = tmp_path / "snapshot"
    save_drafter(random_drafter(model), snapshot / "compressed")
    asked: list[tuple[str, list[str]]] = []

    def fake_download(repo: str, allow_patterns: list[str]) -> str:
        asked.append((repo, allow_patterns))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    draft = load_draft("someone/some-drafter/compressed", target=model)
    assert isinstance(draft, DFlashDraftModel)
    assert asked == [("someone/some-drafter", ["compressed/*.safetensors", "compressed/*.json"])]
    assert resolve_model("someone/some-drafter/compressed", "drafter", ["*.json"]).name == (
        "compressed"
    )
    with pytest.raises(ModelLoadError, match="has no folder 'other'"):
        resolve_model("someone/some-drafter/other", "drafter", ["*.json"])
