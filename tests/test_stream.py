"""stream_generate: EOS, stop strings and max_tokens honoured inside a block; response fields."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from dflash_server import stream_generate
from dflash_server.testing import ReplayDrafter, random_drafter

PROMPT = "def fibonacci(n):"


@pytest.fixture
def setup(tiny_hybrid):
    model, tokenizer = tiny_hybrid
    ids = tokenizer.encode(PROMPT)
    reference = [t for t, _ in generate_step(mx.array(ids), model, max_tokens=48)]
    # Full blocks every cycle: any early end must cut a block in the middle.
    draft = ReplayDrafter(ids + reference + [0] * 32, [15], random_drafter(model))
    return model, tokenizer, ids, reference, draft


def run(model, draft, tokenizer, ids, **kw):
    out = list(stream_generate(model, draft, tokenizer, ids, 16, **kw))
    return out, [t for r in out for t in r.tokens], "".join(r.text for r in out)


def test_max_tokens_inside_a_block(setup):
    model, tokenizer, ids, reference, draft = setup
    out, tokens, _ = run(model, draft, tokenizer, ids, max_tokens=7)
    assert tokens == reference[:7]
    assert out[-1].finish_reason == "length" and out[-1].generation_tokens == 7
    assert all(r.finish_reason is None for r in out[:-1])


def test_eos_inside_a_block(setup, monkeypatch):
    model, tokenizer, ids, reference, draft = setup
    i = next(i for i in range(5, 40) if reference[i] not in reference[:i])  # mid-block
    monkeypatch.setattr(tokenizer, "_eos_token_ids", {reference[i]})
    out, tokens, text = run(model, draft, tokenizer, ids, max_tokens=40)
    assert tokens == reference[:i]  # the EOS itself is neither counted nor shown
    assert out[-1].finish_reason == "stop"
    assert text == tokenizer.decode(reference[:i])


def test_stop_string_inside_a_block(setup):
    model, tokenizer, ids, reference, draft = setup
    full = tokenizer.decode(reference[:40])
    stop = full[20:24]
    before = full[: full.index(stop)]
    out, tokens, text = run(model, draft, tokenizer, ids, max_tokens=40, stop=[stop, "never-seen"])
    assert text == before
    assert out[-1].finish_reason == "stop" and out[-1].stop == stop  # which one ended it
    # No token past the one that completed the stop string.
    assert stop in tokenizer.decode(tokens) and stop not in tokenizer.decode(tokens[:-1])


def test_response_fields_and_stats(setup):
    model, tokenizer, ids, reference, draft = setup
    out, _, text = run(model, draft, tokenizer, ids, max_tokens=33)  # 1 + 2 full blocks
    last = out[-1]
    assert text == tokenizer.decode(reference[:33])
    assert last.prompt_tokens == len(ids) and last.generation_tokens == 33
    assert last.prompt_tps > 0 and last.generation_tps > 0 and last.peak_memory > 0
    assert last.token == reference[32]
    stats = last.stats.as_dict()
    assert stats["tau"] == 16.0 and stats["acceptance_histogram"][15] == stats["cycles"]
    assert stats["drafted"] == 15 * stats["cycles"]


def test_invalid_arguments(tiny_hybrid):
    model, tokenizer = tiny_hybrid
    draft = random_drafter(model, block_size=8)
    with pytest.raises(ValueError, match="block_size"):
        next(stream_generate(model, draft, tokenizer, "hi", block_size=9))
    with pytest.raises(ValueError, match="top_p"):
        # top_p=0 is valid (OpenAI spec: minimum 0; keeps the most likely token): -0.1 is not.
        next(stream_generate(model, draft, tokenizer, "hi", top_p=-0.1))
    with pytest.raises(ValueError, match="empty"):
        next(stream_generate(model, draft, tokenizer, []))


def test_interleaved_generations_share_one_wired_limit(setup, monkeypatch):
    """The server interleaves generators; the wired limit is set once and restored once."""
    import contextlib

    from dflash_server.generation import pair as pair_module

    events = []

    @contextlib.contextmanager
    def fake_wired_limit(model, streams):
        events.append("set")
        yield
        events.append("restore")

    monkeypatch.setattr(pair_module, "wired_limit", fake_wired_limit)
    model, tokenizer, ids, _, _ = setup
    a = stream_generate(model, None, tokenizer, ids, max_tokens=4)
    b = stream_generate(model, None, tokenizer, ids, max_tokens=8)
    next(a), next(b)
    list(a)  # a finishes while b is still running
    assert events == ["set"]
    list(b)
    assert events == ["set", "restore"]


def test_special_tokens_left_out_of_text_only(tiny_hybrid):
    """skip_special_tokens: control tokens vanish from the text, never from the token ids; the
    markers the server parses (think, tool calls) stay."""
    from dflash_server.generation.pair import ModelPair
    from dflash_server.generation.request import BlockPolicy, GenerationRequest
    from dflash_server.generation.sampling import SamplingParams
    from dflash_server.generation.stream import generate
    from dflash_server.generation.text import hidden_tokens

    model, tokenizer = tiny_hybrid
    named = {tokenizer.convert_tokens_to_ids(t): t for t in ("<|im_start|>", "<|endoftext|>")}
    kept = [tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>", "<tool_call>")]
    assert set(named) <= hidden_tokens(tokenizer) and not set(kept) & hidden_tokens(tokenizer)
    # A bias makes the random model write control tokens among its own.
    bias = {t: 8.0 for t in named}
    ids = tokenizer.encode(PROMPT)

    def run(skip: bool) -> tuple[list[int], str]:
        request = GenerationRequest(
            tuple(ids),
            24,
            SamplingParams(logit_bias=bias),
            block=BlockPolicy(4),
            skip_special_tokens=skip,
        )
        out = list(generate(ModelPair.of(model, tokenizer, random_drafter(model)), request))
        return [t for r in out for t in r.tokens], "".join(r.text for r in out)

    raw_tokens, raw = run(False)
    tokens, text = run(True)
    assert tokens == raw_tokens and set(named) & set(tokens)
    assert any(t in raw for t in named.values()) and not any(t in text for t in named.values())
    assert text == tokenizer.decode([t for t in tokens if t not in named])
