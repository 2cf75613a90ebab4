"""The drafter's context window: sinks + newest positions, lossless, restorable from snapshots."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from dflash_server import stream_generate
from dflash_server.chat.prompts import render_chat
from dflash_server.drafters.context import ContextCache
from dflash_server.drafters.window import SinkContextCache
from dflash_server.engine.prefix_cache import PrefixCache
from dflash_server.generation.pair import ModelPair
from dflash_server.generation.request import BlockPolicy, GenerationRequest
from dflash_server.generation.stream import generate
from dflash_server.testing import ReplayDrafter, random_drafter


def rows(n: int, start: int = 0) -> mx.array:
    """[1, 1, n, 2] keys whose first feature is the absolute position."""
    pos = mx.arange(start, start + n, dtype=mx.float32)
    return mx.stack([pos, -pos], axis=-1)[None, None]


@pytest.mark.parametrize("chunks", [[3], [1, 1, 1, 1, 1, 1, 1], [20], [2, 9, 1, 30, 4]])
def test_sink_cache_keeps_the_first_and_the_newest_positions(chunks):
    cache, full = SinkContextCache(window=10, sinks=4), ContextCache()
    offset = 0
    for n in chunks:
        cache.append(rows(n, offset), rows(n, offset))
        full.append(rows(n, offset), rows(n, offset))
        offset += n
        keys, _ = cache.fetch()
        want = list(range(min(4, offset))) + list(range(max(4, offset - 6), offset))
        assert keys[0, 0, :, 0].tolist() == want
        assert cache.offset == offset
        # A snapshot restores into a fresh cache with the same view, and keeps growing alike.
        other = SinkContextCache(window=10, sinks=4)
        other.restore(cache.snapshot())
        assert mx.array_equal(other.fetch()[0], keys).item()
        other.append(rows(3, offset), rows(3, offset))
        cache2 = SinkContextCache(window=10, sinks=4)
        cache2.restore(cache.snapshot())
        cache2.append(rows(3, offset), rows(3, offset))
        assert mx.array_equal(other.fetch()[0], cache2.fetch()[0]).item()
    assert full.fetch()[0].shape[2] == offset


def test_window_leaves_short_contexts_alone_and_bounds_long_ones(tiny_hybrid):
    model, _ = tiny_hybrid
    draft = random_drafter(model, block_size=4)
    taps = mx.random.normal((1, 40, len(draft.config.target_layer_ids) * 64), key=mx.random.key(1))
    block = mx.array([[5] + [draft.config.mask_token_id] * 3])
    full = draft(block, taps, draft.make_cache())
    assert draft.set_window(64) == 64
    assert mx.allclose(draft(block, taps, draft.make_cache()), full, atol=1e-5).item()
    draft.set_window(12)
    cache = draft.make_cache()
    windowed = draft(block, taps, cache)
    assert not mx.allclose(windowed, full, atol=1e-4).item()
    assert all(c.fetch()[0].shape[2] == 12 for c in cache)
    assert draft.set_window(0) is None  # back to the whole context
    assert mx.allclose(draft(block, taps, draft.make_cache()), full, atol=1e-5).item()
    with pytest.raises(ValueError, match="sink"):
        draft.set_window(3)


def test_config_sliding_window_size_is_the_default(tiny_hybrid, tmp_path):
    from dflash_server import DFlashConfig, DFlashDraftModel

    model, _ = tiny_hybrid
    base = random_drafter(model)
    config = DFlashConfig(**{**base.config.__dict__, "sliding_window_size": 256})
    assert DFlashDraftModel(config).window == 256
    assert DFlashConfig.from_dict(config.to_dict()).sliding_window_size == 256
    assert "sliding_window_size" not in base.config.to_dict()


def test_windowed_drafter_is_lossless(tiny_hybrid):
    model, tokenizer = tiny_hybrid
    ids = tokenizer.encode("def fibonacci(n): " * 6)
    reference = [t for t, _ in generate_step(mx.array(ids), model, max_tokens=40)]
    for draft in (
        random_drafter(model),
        ReplayDrafter(ids + reference, [3, 9], random_drafter(model)),
    ):
        draft.set_window(10)
        out = list(stream_generate(model, draft, tokenizer, ids, 8, max_tokens=40))
        assert [t for r in out for t in r.tokens] == reference


def test_prefix_cache_with_a_windowed_drafter_matches_a_cold_run(tiny_hybrid):
    model, tokenizer = tiny_hybrid
    system = {"role": "system", "content": "You are a helpful assistant. " * 8}
    turn1 = [system, {"role": "user", "content": "What is the capital of France?"}]
    turn2 = [
        *turn1,
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "Italy?"},
    ]
    draft = random_drafter(model, block_size=4)
    draft.set_window(24)  # shorter than the prompts

    def run(prompt, cache):
        request = GenerationRequest(
            tuple(prompt.tokens), 12, block=BlockPolicy(4), checkpoints=prompt.checkpoints
        )
        pair = ModelPair.of(model, tokenizer, draft)
        out = list(generate(pair, request, prefill_step_size=16, prefix=cache))
        return [t for r in out for t in r.tokens], out[-1].stats.cached_tokens

    first = render_chat(tokenizer, turn1, enable_thinking=True)
    second = render_chat(tokenizer, turn2, enable_thinking=True)
    cache = PrefixCache(1 << 30)
    run(first, cache)
    warm, cached = run(second, cache)
    cold, _ = run(second, PrefixCache(1 << 30))
    assert warm == cold and cached > 24
