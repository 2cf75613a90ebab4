"""Published DFlash (v1) variants: "assistant" exports, block_size inside dflash_config, mixed
sliding/full layers, is_causal, logit multiplier/softcap, and the refusal of unknown families."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from dflash_server import DFlashConfig, DFlashDraftModel, load_draft, stream_generate
from dflash_server.drafters import dflash
from dflash_server.drafters.config import assistant_kwargs
from dflash_server.drafters.registry import family_of
from dflash_server.testing import random_drafter

# z-lab/dflash tests/fixtures/assistant-config.json (Muse-Glimmer-30B-assistant), as downloaded.
ASSISTANT_CONFIG = {
    "architectures": ["MuseGlimmerAssistantModel"],
    "attention_dropout": 0,
    "block_size": 16,
    "bos_token_id": 200000,
    "dtype": "bfloat16",
    "eos_token_id": 200001,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 6656,
    "intermediate_size": 19968,
    "layer_types": ["sliding_attention"] * 5,
    "mask_token_id": 201818,
    "max_position_embeddings": 131072,
    "model_type": "muse_glimmer_assistant",
    "num_attention_heads": 32,
    "num_hidden_layers": 5,
    "num_key_value_heads": 8,
    "pad_token_id": 200018,
    "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
    "sliding_window": 2048,
    "target_layer_ids": [1, 13, 25, 37, 49],
    "transformers_version": "5.15.0.dev0",
}
# Its safetensors header (assistant-safetensors-header.json): 58 bf16 tensors.
ASSISTANT_TOP = {
    "encoder.fc.weight": (6656, 33280),
    "encoder.output_norm_enc.weight": (6656,),
    "norm.weight": (6656,),
}
ASSISTANT_LAYER = {
    "input_layernorm.weight": (6656,),
    "mlp.down_proj.weight": (6656, 19968),
    "mlp.gate_proj.weight": (19968, 6656),
    "mlp.up_proj.weight": (19968, 6656),
    "post_attention_layernorm.weight": (6656,),
    "self_attn.k_norm.weight": (128,),
    "self_attn.k_proj.weight": (1024, 6656),
    "self_attn.o_proj.weight": (6656, 4096),
    "self_attn.q_norm.weight": (128,),
    "self_attn.q_proj.weight": (4096, 6656),
    "self_attn.v_proj.weight": (1024, 6656),
}


def test_assistant_layout_maps_onto_dflash():
    family = family_of(ASSISTANT_CONFIG)
    config = DFlashConfig(**assistant_kwargs(ASSISTANT_CONFIG))  # what its loader builds
    assert family.name == "assistant" and family.load is dflash.load_assistant
    assert (config.block_size, config.mask_token_id, config.vocab_size) == (16, 201818, None)
    assert config.target_layer_ids == (1, 13, 25, 37, 49) and config.is_causal is False
    header = dict(ASSISTANT_TOP)
    for i in range(5):
        header.update({f"layers.{i}.{k}": v for k, v in ASSISTANT_LAYER.items()})
    assert len(header) == 58
    remapped = dflash.remap_assistant({k: mx.zeros(v) for k, v in header.items()})
    model = DFlashDraftModel(config)
    assert {k: v.shape for k, v in remapped.items()} == {
        k: v.shape for k, v in tree_flatten(model.parameters())
    }
    assert not any(layer.self_attn.causal for layer in model.layers)  # sliding, yet bidirectional


def test_assistant_missing_key_is_named():
    cfg = {k: v for k, v in ASSISTANT_CONFIG.items() if k != "mask_token_id"}
    assert family_of(cfg).name == "assistant"
    with pytest.raises(ValueError, match="mask_token_id"):
        assistant_kwargs(cfg)


def sliding_drafter(model, window: int = 6, **changes) -> DFlashDraftModel:
    base = random_drafter(model, block_size=4)
    fields = {**base.config.__dict__, "layer_types": ("sliding_attention",) * 2}
    draft = DFlashDraftModel(DFlashConfig(**{**fields, "sliding_window": window, **changes}))
    draft.update(base.parameters())
    return draft.bind(model)


def logits(draft, model, n: int = 11) -> mx.array:
    width = len(draft.config.target_layer_ids) * draft.config.hidden_size
    taps = mx.random.normal((1, n, width), key=mx.random.key(1))
    block = mx.array([[5] + [draft.config.mask_token_id] * (draft.config.block_size - 1)])
    return draft.bind(model)(block, taps, draft.make_cache())


def save_assistant(draft: DFlashDraftModel, path, **extra):
    """Write ``draft`` the way assistant exports are laid out: encoder.* names, flat config."""
    names = {
        "fc.weight": "encoder.fc.weight",
        "hidden_norm.weight": "encoder.output_norm_enc.weight",
    }
    weights = {names.get(k, k): v for k, v in tree_flatten(draft.parameters())}
    c = draft.config
    cfg = {
        **ASSISTANT_CONFIG,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
    }
    cfg.update(
        head_dim=c.head_dim, num_attention_heads=c.num_attention_heads, block_size=c.block_size,
        num_key_value_heads=c.num_key_value_heads, num_hidden_layers=c.num_hidden_layers,
        layer_types=list(c.layer_types), sliding_window=c.sliding_window, rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_theta": c.rope_theta, "rope_type": "default"},
        target_layer_ids=list(c.target_layer_ids), mask_token_id=c.mask_token_id, **extra,
    )  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_assistant_export_loads_and_decodes(tiny_hybrid, tmp_path):
    model, tokenizer = tiny_hybrid
    draft = sliding_drafter(model)
    loaded = load_draft(save_assistant(draft, tmp_path / "a"), target=model)
    assert type(loaded) is DFlashDraftModel and loaded.config.is_causal is False
    assert loaded.family == "assistant"
    assert mx.allclose(logits(loaded, model), logits(draft, model), atol=1e-5).item()
    ids = tokenizer.encode("The quick brown fox")
    plain = [
        t for r in stream_generate(model, None, tokenizer, ids, max_tokens=24) for t in r.tokens
    ]
    spec = [
        t
        for r in stream_generate(model, loaded, tokenizer, ids, 4, max_tokens=24)
        for t in r.tokens
    ]
    assert spec == plain
    # The export's own logit scale, when its config has one: cap * tanh(multiplier * x / cap).
    scaled = save_assistant(
        draft, tmp_path / "s", output_multiplier=0.5, final_logit_softcapping=4.0
    )
    want = 4.0 * mx.tanh(0.5 * logits(draft, model) / 4.0)
    assert mx.allclose(logits(load_draft(scaled), model), want, atol=1e-4).item()


def test_target_logit_scale_is_inherited(tiny_hybrid):
    """A config at multiplier 1 without softcap takes the target's (as the reference does)."""
    model, _ = tiny_hybrid
    draft = sliding_drafter(model)
    plain = logits(draft, model)
    args = model.language_model.args
    args.output_multiplier, args.final_logit_softcapping = 0.25, 3.0
    try:
        inherited = logits(draft, model)
        own = logits(sliding_drafter(model, output_multiplier=2.0), model)
    finally:
        del args.output_multiplier, args.final_logit_softcapping
    assert mx.allclose(inherited, 3.0 * mx.tanh(0.25 * plain / 3.0), atol=1e-4).item()
    assert mx.allclose(own, 2.0 * plain, atol=1e-4).item()  # its own scale wins


def test_dflash_config_variants():
    from test_drafter import PUBLISHED_4B

    cfg = json.loads(json.dumps(PUBLISHED_4B))
    del cfg["block_size"]
    cfg["dflash_config"]["block_size"] = 8
    assert DFlashConfig.from_dict(cfg).block_size == 8
    cfg["layer_types"] = ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]
    cfg["sliding_window"] = 2048
    model = DFlashDraftModel(DFlashConfig.from_dict(cfg))
    assert [layer.self_attn.window for layer in model.layers] == [2048, None, 2048, None, 2048]
    assert not any(layer.self_attn.causal for layer in model.layers)  # DFlash: absent = false
    cfg["is_causal"] = True
    assert all(
        layer.self_attn.causal for layer in DFlashDraftModel(DFlashConfig.from_dict(cfg)).layers
    )
    assert DFlashConfig.from_dict(cfg).to_dict()["is_causal"] is True
    assert "is_causal" not in DFlashConfig.from_dict(PUBLISHED_4B).to_dict()


def test_mixed_layers_round_trip_and_stay_lossless(tiny_hybrid, tmp_path):
    model, tokenizer = tiny_hybrid
    base = random_drafter(model, block_size=4)
    fields = {**base.config.__dict__, "layer_types": ("sliding_attention", "full_attention")}
    draft = DFlashDraftModel(DFlashConfig(**{**fields, "sliding_window": 5}))
    draft.update(base.parameters())
    path = tmp_path / "mixed"
    path.mkdir()
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(draft.parameters())))
    (path / "config.json").write_text(json.dumps(draft.config.to_dict()))
    loaded = load_draft(path, target=model)
    assert mx.allclose(logits(loaded, model), logits(draft, model), atol=1e-5).item()
    ids = tokenizer.encode("def fibonacci(n):")
    plain = [
        t for r in stream_generate(model, None, tokenizer, ids, max_tokens=24) for t in r.tokens
    ]
    spec = [
        t
        for r in stream_generate(model, loaded, tokenizer, ids, 4, max_tokens=24)
        for t in r.tokens
    ]
    assert spec == plain


def test_unknown_architecture_is_refused(tmp_path):
    path = tmp_path / "eagle"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["Eagle3DraftModel"]}))
    with pytest.raises(
        ValueError, match=r"'Eagle3DraftModel'.*DFlashDraftModel, DFlash2DraftModel"
    ):
        load_draft(path)


def test_causal_key_spellings():
    from test_drafter import PUBLISHED_4B

    cfg = json.loads(json.dumps(PUBLISHED_4B))
    cfg["dflash_config"]["causal"] = True  # as some converters write it
    assert DFlashConfig.from_dict(cfg).is_causal is True
    cfg["is_causal"] = False  # the HF key wins
    assert DFlashConfig.from_dict(cfg).is_causal is False
