"""Lossless greedy: DFlash tokens == mlx-lm's plain greedy tokens of the target alone."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

from dflash_server import stream_generate
from dflash_server.testing import ReplayDrafter, random_drafter

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "<|im_start|>user\nhi<|im_end|>\n"]
N = 40


def plain_greedy(model, prompt_ids, n=N, processors=None) -> list[int]:
    steps = generate_step(mx.array(prompt_ids), model, max_tokens=n, logits_processors=processors)
    return [t for t, _ in steps]


def dflash_tokens(model, draft, tokenizer, prompt_ids, block_size, n=N, **kw) -> list[int]:
    out = stream_generate(model, draft, tokenizer, prompt_ids, block_size, max_tokens=n, **kw)
    return [t for r in out for t in r.tokens]


@pytest.fixture(params=["tiny_hybrid", "tiny_attn"])
def target(request):
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_random_drafter_greedy_is_lossless(target, block_size):
    model, tokenizer = target
    draft = random_drafter(model, block_size=16)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        assert dflash_tokens(model, draft, tokenizer, ids, block_size) == plain_greedy(model, ids)


@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_replay_drafter_exercises_every_acceptance_length(target, block_size):
    model, tokenizer = target
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        n = block_size * (block_size + 1) // 2 + 2 * block_size  # room for one pattern round
        reference = plain_greedy(model, ids, n)
        # Cycle c accepts c % block_size drafts: 0..B-1, B-1 being a full block.
        draft = ReplayDrafter(ids + reference, list(range(block_size)), random_drafter(model))
        out = list(stream_generate(model, draft, tokenizer, ids, block_size, max_tokens=n))
        assert [t for r in out for t in r.tokens] == reference
        histogram = out[-1].stats.acceptance_histogram
        assert all(count > 0 for count in histogram), histogram


def test_greedy_with_penalties_matches_plain(tiny_hybrid):
    model, tokenizer = tiny_hybrid
    ids = tokenizer.encode(PROMPTS[0])
    penalties = dict(repetition_penalty=1.3, presence_penalty=0.7, frequency_penalty=0.4)
    processors = make_logits_processors(None, 1.3, 20, 0.7, 20, 0.4, 20)
    reference = plain_greedy(model, ids, N, processors)
    assert reference != plain_greedy(model, ids)  # the penalties do change the output
    draft = ReplayDrafter(ids + reference, [3, 0, 15, 7], random_drafter(model))
    assert dflash_tokens(model, draft, tokenizer, ids, 16, **penalties) == reference
    draft = random_drafter(model)
    assert dflash_tokens(model, draft, tokenizer, ids, 4, **penalties) == reference


def test_chunked_prefill_is_lossless(tiny_hybrid):
    model, tokenizer = tiny_hybrid
    ids = tokenizer.encode(" ".join(PROMPTS) * 3)
    reference = plain_greedy(model, ids)
    draft = ReplayDrafter(ids + reference, [5, 2], random_drafter(model))
    assert dflash_tokens(model, draft, tokenizer, ids, 8, prefill_step_size=7) == reference


def test_moe_hybrid_target_is_lossless(tmp_path):
    from dflash_server import load
    from dflash_server.testing import build_target

    model, tokenizer = load(build_target(tmp_path / "moe", arch="qwen3_5_moe"))
    ids = tokenizer.encode(PROMPTS[1])
    reference = plain_greedy(model, ids)
    draft = ReplayDrafter(ids + reference, [0, 4, 9], random_drafter(model))
    assert dflash_tokens(model, draft, tokenizer, ids, 16) == reference


def test_plain_mode_matches_mlx_lm(target):
    model, tokenizer = target
    ids = tokenizer.encode(PROMPTS[2])
    assert dflash_tokens(model, None, tokenizer, ids, None) == plain_greedy(model, ids)


def test_black_box_sampler_is_accepted_like_the_reference(tiny_hybrid):
    """Older reference code passes an mlx-lm ``sampler=``; greedy must still be lossless."""
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = tiny_hybrid
    ids = tokenizer.encode(PROMPTS[0])
    reference = plain_greedy(model, ids)
    draft = ReplayDrafter(ids + reference, [2, 15], random_drafter(model))
    out = list(
        stream_generate(model, draft, tokenizer, ids, max_tokens=N, sampler=make_sampler(0.0))
    )
    assert [t for r in out for t in r.tokens] == reference
    assert out[0].accepted is None and out[1].accepted == 3


@pytest.mark.parametrize(
    "options",
    [{"quantize_bits": 4}, {"tie_word_embeddings": True}, {"arch": "llama"}],
    ids=["4bit-target", "tied-embeddings", "llama"],
)
def test_other_target_variants_are_lossless(tmp_path, options):
    """The drafter borrows a quantized or tied embedding/head as it finds it."""
    from dflash_server import load
    from dflash_server.testing import build_target

    model, tokenizer = load(build_target(tmp_path / "t", **options))
    ids = tokenizer.encode(PROMPTS[0])
    reference = plain_greedy(model, ids)
    assert dflash_tokens(model, random_drafter(model), tokenizer, ids, 4) == reference
    draft = ReplayDrafter(ids + reference, [1, 6], random_drafter(model))
    assert dflash_tokens(model, draft, tokenizer, ids, 8) == reference


def test_sliding_window_drafter(tiny_hybrid):
    """Sliding layers attend to the last window-1 context positions only; output stays lossless."""
    from dflash_server import DFlashConfig, DFlashDraftModel

    model, tokenizer = tiny_hybrid
    base = random_drafter(model, block_size=4)
    fields = {**base.config.__dict__, "layer_types": ("sliding_attention", "full_attention")}
    windowed = DFlashDraftModel(DFlashConfig(**{**fields, "sliding_window": 5}))
    wide = DFlashDraftModel(DFlashConfig(**{**fields, "sliding_window": 10_000}))
    windowed.update(base.parameters())
    wide.update(base.parameters())
    taps = mx.random.normal((1, 12, len(base.config.target_layer_ids) * 64), key=mx.random.key(0))
    block = mx.array([[5] + [base.config.mask_token_id] * 3])
    logits = [d.bind(model)(block, taps, d.make_cache()) for d in (windowed, wide, base)]
    assert not mx.allclose(logits[0], logits[1], atol=1e-4).item()
    assert mx.allclose(logits[1], logits[2], atol=1e-4).item()
    ids = tokenizer.encode(PROMPTS[1])
    assert dflash_tokens(model, windowed, tokenizer, ids, 4) == plain_greedy(model, ids)
