"""The offline tiny-model builders behave like real Qwen3.5 checkpoints where tests rely on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from dflash_server.testing import (
    SPECIAL_TOKENS,
    build_target,
    build_tokenizer,
    mask_token_id,
    random_drafter,
    tokenizer_size,
)

MSGS = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello, world!"},
]
PREFIX = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHello, world!<|im_end|>\n"


def _greedy(model: Any, tokenizer: Any, n: int = 24) -> list[int]:
    prompt = mx.array(tokenizer.encode("The quick brown fox"))
    steps = generate_step(prompt, model, max_tokens=n)
    return [int(tok) for tok, _ in steps]


@pytest.fixture(params=["tiny_hybrid", "tiny_attn"])
def loaded(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    return request.getfixturevalue(request.param)


def test_fixture_paths(tiny_hybrid_path: Path, tiny_attn_path: Path) -> None:
    for path in (tiny_hybrid_path, tiny_attn_path):
        assert (path / "config.json").exists()
        assert (path / "model.safetensors").exists()
        assert (path / "tokenizer.json").exists()
        assert 300 <= tokenizer_size(path) <= 400


def test_architectures(tiny_hybrid: tuple[Any, Any], tiny_attn: tuple[Any, Any]) -> None:
    hybrid, _ = tiny_hybrid
    attn, _ = tiny_attn
    assert hybrid.model_type == "qwen3_5"
    assert [type(c).__name__ for c in hybrid.make_cache()] == ["ArraysCache"] * 3 + ["KVCache"]
    assert attn.model_type == "qwen3"
    from mlx_lm.models.cache import make_prompt_cache

    assert all(type(c).__name__ == "KVCache" for c in make_prompt_cache(attn))


def test_chat_template_thinking_modes(loaded: tuple[Any, Any]) -> None:
    _, tok = loaded
    on = tok.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=False)
    off = tok.apply_chat_template(
        MSGS, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert on == PREFIX + "<|im_start|>assistant\n<think>\n"
    assert off == PREFIX + "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_chat_template_tools_and_history(tiny_hybrid: tuple[Any, Any]) -> None:
    _, tok = tiny_hybrid
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    msgs = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sunny"},
    ]
    text = tok.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False)
    assert text == (
        "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n\n<tool_call>\n"
        "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>"
        "<|im_end|>\n"
    )
    assert tok.has_tool_calling and tok.has_thinking


def test_special_tokens(loaded: tuple[Any, Any]) -> None:
    _, tok = loaded
    ids = [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert len(set(ids)) == len(SPECIAL_TOKENS)
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_id == ids[2]
    assert tok.encode("<|im_start|>user<think>", add_special_tokens=False)[0] == ids[1]


@pytest.mark.parametrize(
    "text",
    ["Hello, world! The answer is 42.", "def f(x):\n    return x * 2\n", "Ünïcødé 日本 🙂 tabs\t."],
)
def test_tokenizer_round_trip(loaded: tuple[Any, Any], text: str) -> None:
    _, tok = loaded
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_ids_match_raw_tokenizer(tmp_path: Path, tiny_hybrid: tuple[Any, Any]) -> None:
    """transformers 5 rebuilds Qwen3.5's pre-tokenizer for qwen3_5 folders: ids must not change."""
    from tokenizers import Tokenizer

    build_tokenizer(tmp_path)
    raw = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    text = "Let me think: fibonacci(10) = 55, isn't it? Ça va.\n\n  x = 1"
    assert tiny_hybrid[1].encode(text, add_special_tokens=False) == raw.encode(text).ids


def test_mask_token_is_free_row(tiny_hybrid: tuple[Any, Any], tiny_hybrid_path: Path) -> None:
    model, tok = tiny_hybrid
    mask = mask_token_id(tiny_hybrid_path)
    rows = model.language_model.model.embed_tokens.weight.shape[0]
    assert mask == tokenizer_size(tiny_hybrid_path) < rows
    assert rows % 64 == 0
    assert tok.convert_ids_to_tokens(mask) is None


def test_published_shape_drafter(tmp_path: Path) -> None:
    """Benchmarks time a random drafter of the published proportions: 5 layers, heads of 64,
    4 query heads per KV head, MLP 3x wide, taps spread as the reference trainer picks them."""
    import mlx_lm

    from dflash_server.generation.target import TargetModel

    model, _ = mlx_lm.load(str(build_target(tmp_path / "t", hidden_size=512, num_hidden_layers=12)))
    draft = random_drafter(model, shape="published", block_size=8, mask_id=7)
    c = draft.config
    assert c.num_hidden_layers == 5 and c.head_dim == 64
    assert c.num_attention_heads == 8 and c.num_key_value_heads == 2
    assert c.intermediate_size == 3 * 512 and c.mask_token_id == 7 and c.block_size == 8
    assert tuple(c.target_layer_ids) == (1, 3, 5, 7, 9)
    target = TargetModel(model, c.target_layer_ids)
    _, taps = target.forward(mx.array([[1, 2, 3]]), target.make_cache())
    cache = draft.make_cache()
    draft.append_context(taps, cache)
    logits = draft(mx.array([[3] + [7] * 7]), None, cache, logits_start=1)
    assert logits.shape[:2] == (1, 7)
    with pytest.raises(ValueError, match="shape must be"):
        random_drafter(model, shape="huge")


def test_greedy_decoding_varies(loaded: tuple[Any, Any]) -> None:
    model, tok = loaded
    out = _greedy(model, tok)
    assert len(out) == 24
    assert len(set(out)) >= 4
    assert max(out) < len(tok.get_vocab()) - len(SPECIAL_TOKENS)  # no specials, no spare rows


@pytest.mark.parametrize(
    "kwargs",
    [
        {"arch": "qwen3_5_moe"},
        {"arch": "llama", "tie_word_embeddings": True},
        {"arch": "qwen3_5", "nested_text_config": False, "quantize_bits": 4},
    ],
)
def test_other_builds(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    import mlx_lm

    path = build_target(tmp_path / "m", **kwargs)
    model, tok = mlx_lm.load(str(path))
    out = _greedy(model, tok, 16)
    assert len(set(out)) >= 2
    if "quantize_bits" in kwargs:
        assert "quantization" in mlx_lm.utils.load_config(path)


def test_seed_is_deterministic(tmp_path: Path) -> None:
    import mlx_lm

    a = mlx_lm.load(str(build_target(tmp_path / "a", seed=3)))
    b = mlx_lm.load(str(build_target(tmp_path / "b", seed=3)))
    assert _greedy(*a, 8) == _greedy(*b, 8)
