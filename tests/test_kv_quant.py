"""Quantized attention KV (--kv-bits): DFlash equals mlx-lm's own decoding with the same cache.

The oracle is ``mlx_lm.generate.generate_step(..., kv_bits, kv_group_size, quantized_kv_start)``
with the same prefill chunk size; the fixture is the tiny hybrid target with 64-wide attention
heads (mlx quantizes groups of 32, 64 or 128) and grouped heads (4 query, 2 KV).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache

from dflash_server.adaptive.policy import FixedBlock
from dflash_server.chat.prompts import render_chat
from dflash_server.engine.prefix_cache import PrefixCache
from dflash_server.engine.prefix_disk import PrefixDisk
from dflash_server.generation.batch import BatchDecoder
from dflash_server.generation.kv_memory import bytes_per_position, kv_geometry
from dflash_server.generation.kv_quant import KVQuant, check_kv_bits, head_dim
from dflash_server.generation.pair import ModelPair
from dflash_server.generation.request import BlockPolicy, GenerationRequest
from dflash_server.generation.row import Row
from dflash_server.generation.sampling import SamplingParams, TokenSampler
from dflash_server.generation.speculative import SpeculativeDecoder
from dflash_server.generation.stream import generate, stream_generate
from dflash_server.generation.target import TargetModel
from dflash_server.testing import ReplayDrafter, build_target, random_drafter

STEP = 16  # prefill chunk: the prompts below span several
BIG = 1 << 30
SYSTEM = {"role": "system", "content": "You are a helpful assistant. " * 6}
TURN1 = [SYSTEM, {"role": "user", "content": "What is the capital of France?"}]
TURN2 = [
    *TURN1,
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Italy?"},
]


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    import mlx_lm

    path = build_target(tmp_path_factory.mktemp("kv") / "t", text_overrides={"head_dim": 64})
    return mlx_lm.load(str(path))


def oracle(model: Any, ids: list[int], n: int, kv: KVQuant | None) -> tuple[list[int], list]:
    """mlx-lm's plain greedy decoding: tokens and each token's log-probability."""
    extra = {} if kv is None else {"kv_bits": kv.bits, "kv_group_size": kv.group_size,
                                   "quantized_kv_start": kv.start}  # fmt: skip
    steps = generate_step(mx.array(ids), model, max_tokens=n, prefill_step_size=STEP, **extra)
    out = [(int(t), float(lp[t])) for t, lp in steps]
    return [t for t, _ in out], [lp for _, lp in out]


def decoder(model: Any, draft: Any, block: int, kv: KVQuant | None, **kw: Any):
    taps = tuple(draft.config.target_layer_ids) if draft is not None else ()
    sampler = TokenSampler(SamplingParams(), None)
    row = Row(TargetModel(model, taps), draft, sampler, FixedBlock(block), kv=kv,
              prefill_step_size=STEP, **kw)  # fmt: skip
    return SpeculativeDecoder(row)


def tokens_of(commits: Any) -> list[int]:
    return [t for c in commits for t in c.tokens]


def prompt_ids(tokenizer: Any, n: int) -> list[int]:
    text = "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2) " * 4
    ids = list(tokenizer.encode(text))
    assert len(ids) >= n
    return ids[:n]


KVS = [KVQuant(8, 64, 0), KVQuant(4, 64, 0), KVQuant(4, 32, 20), KVQuant(8, 32, 33)]


@pytest.mark.parametrize("kv", KVS, ids=lambda kv: f"{kv.bits}b-g{kv.group_size}-s{kv.start}")
def test_lone_dflash_equals_mlx_lm_with_the_same_quantized_cache(wide, kv: KVQuant) -> None:
    """Plain decoding, and DFlash at every acceptance length (rollback of quantized layers)."""
    model, tokenizer = wide
    ids = prompt_ids(tokenizer, 41)  # chunks 16, 16, 8 and the last token (as mlx-lm's)
    ref, ref_lps = oracle(model, ids, 40, kv)
    plain, plain_lps = oracle(model, ids, 40, None)
    inner = random_drafter(model, block_size=8)
    for pattern in ([0, 7, 3, 1, 5, 2], [7], [0]):
        run = decoder(model, ReplayDrafter(ids + ref, pattern, inner), 8, kv, logprobs=0)
        commits = list(run.generate(ids, 40))
        assert tokens_of(commits) == ref, pattern
        types = {type(c) for c in run.row.cache}
        assert types == {ArraysCache, QuantizedKVCache}  # GDN layers keep their state
        lps = [lp for c in commits for lp in c.logprobs or []]
        # The same quantized attention as the oracle's (not merely the same argmax): its
        # log-probabilities match to float rounding, far closer than full precision's do.
        ours = max(abs(a - b) for a, b in zip(lps, ref_lps))
        assert ours < 1e-4, ours
    if plain == ref:  # full precision decodes the same tokens: its logprobs still differ
        assert max(abs(a - b) for a, b in zip(plain_lps, ref_lps)) > 10 * ours
    lone_plain = decoder(model, None, 1, kv)
    assert tokens_of(lone_plain.generate(ids, 40)) == ref


def test_python_api_and_suffix_drafts(wide) -> None:
    model, tokenizer = wide
    ids = prompt_ids(tokenizer, 60)  # repetitive: suffix copies get verified
    kv = KVQuant(4, 64, 0)
    ref, _ = oracle(model, ids, 48, kv)
    opts = {"kv_bits": 4, "kv_group_size": 64, "quantized_kv_start": 0}
    for draft, block, suffix in ((random_drafter(model), 4, 0), (None, "auto", 8)):
        out = stream_generate(model, draft, tokenizer, ids, block, max_tokens=48,
                              prefill_step_size=STEP, suffix=suffix, **opts)  # fmt: skip
        assert [t for r in out for t in r.tokens] == ref
    with pytest.raises(ValueError, match="kv-bits must be one of"):
        next(stream_generate(model, None, tokenizer, ids, kv_bits=7))


def test_batched_rows_equal_their_lone_runs(wide) -> None:
    """Rows of different lengths joining a quantized batch at different rounds, widths
    changing (holes, squeezes), each equal to mlx-lm's decoding with the same cache."""
    model, tokenizer = wide
    kv = KVQuant(8, 64, 0)
    inner = random_drafter(model, block_size=8)
    taps = tuple(inner.config.target_layer_ids)
    prompts = [prompt_ids(tokenizer, n) for n in (5, 41, 23, 60)]
    oracles = [oracle(model, p, 36, kv) for p in prompts]
    refs = [tokens for tokens, _ in oracles]
    patterns = [[0, 7, 1], [3, 0, 5, 2], [7], []]
    batch = BatchDecoder(TargetModel(model, taps), None, None, kv)
    rows = []
    for p, ref, pattern in zip(prompts, refs, patterns):
        draft = ReplayDrafter(p + ref, pattern, inner) if pattern else None
        rows.append(decoder(model, draft, 8 if draft else 1, kv, logprobs=0).row)
    out: dict[int, list[int]] = {i: [] for i in range(len(rows))}
    lps: dict[int, list[float]] = {i: [] for i in range(len(rows))}
    joined, rounds, quantized = 0, 0, set()
    while joined < len(rows) or batch.busy:
        if joined < len(rows) and rounds % 2 == 0:
            batch.add(rows[joined], prompts[joined], 36)
            joined += 1
        for row, outcome in batch.step().items():
            assert not isinstance(outcome, Exception), outcome
            out[rows.index(row)] += list(getattr(outcome, "tokens", []))
            lps[rows.index(row)] += list(getattr(outcome, "logprobs", None) or [])
        if batch.cache is not None and len(batch.rows) > 1:
            quantized.add(batch.cache.quantized)
        rounds += 1
    assert [out[i] for i in range(len(rows))] == refs
    assert quantized == {True}
    for i, (_, ref_lps) in enumerate(oracles):  # the oracle's quantized attention, row by row
        assert max(abs(a - b) for a, b in zip(lps[i], ref_lps)) < 1e-4, i
    assert max(batch.histogram) >= 3  # rows overlapped in quantized passes
    # Another quantization (or none) does not share the batch: it runs alone beside it.
    assert not batch.supports(decoder(model, None, 1, KVQuant(4, 64, 0)).row)
    assert not batch.supports(decoder(model, None, 1, None).row)


def test_full_precision_row_joins_a_quantized_batch(wide) -> None:
    """Start past the short row's length: the long row's prefill switched it, the short one is
    quantized as it joins (the whole batch switches together; docs/design.md)."""
    model, tokenizer = wide
    kv = KVQuant(8, 64, 30)
    batch = BatchDecoder(TargetModel(model, ()), None, None, kv)
    long, short = prompt_ids(tokenizer, 41), prompt_ids(tokenizer, 9)
    rows = [decoder(model, None, 1, kv).row for _ in range(2)]
    batch.add(rows[0], long, 12)
    while not batch.rows:
        batch.step()
    batch.add(rows[1], short, 12)
    while len(batch.rows) < 2:
        batch.step()
    assert batch.cache is not None and batch.cache.quantized
    assert all(hasattr(c, "bits") for c in batch.cache.layers if not isinstance(c, ArraysCache))
    while batch.busy:
        batch.step()


def run_chat(model, draft, tokenizer, prompt, cache, kv) -> tuple[list[int], int]:
    request = GenerationRequest(tuple(prompt.tokens), 16, checkpoints=prompt.checkpoints,
                                block=BlockPolicy(4 if draft else 1))  # fmt: skip
    pair = ModelPair.of(model, tokenizer, draft)
    out = list(generate(pair, request, prefill_step_size=STEP, prefix=cache, kv=kv))
    return [t for r in out for t in r.tokens], out[-1].stats.cached_tokens


@pytest.mark.parametrize("with_draft", [False, True])
def test_prefix_cache_hit_equals_cold_ram_and_disk(wide, tmp_path: Path, with_draft) -> None:
    model, tokenizer = wide
    draft = random_drafter(model, block_size=4) if with_draft else None
    kv = KVQuant(4, 64, 0)
    first = render_chat(tokenizer, TURN1, enable_thinking=True)
    second = render_chat(tokenizer, TURN2, enable_thinking=True)
    cold, _ = run_chat(model, draft, tokenizer, second, PrefixCache(BIG), kv)
    folder = tmp_path / "disk"
    cache = PrefixCache(BIG, PrefixDisk(folder, BIG, "m"))
    run_chat(model, draft, tokenizer, first, cache, kv)
    warm, cached = run_chat(model, draft, tokenizer, second, cache, kv)
    assert warm == cold and cached == first.checkpoints[-1]
    entry = next(iter(cache._entries.values())).snapshot
    assert any(type(pair).__name__ == "QuantKV" for pair in entry.kv)  # stored quantized
    cache.close()
    # A restarted server with the same flags reads the entries back from disk (the second
    # turn's own entry restores up to its last token) ...
    again = PrefixCache(BIG, PrefixDisk(folder, BIG, "m"))
    warm, cached = run_chat(model, draft, tokenizer, second, again, kv)
    assert warm == cold and cached == len(second.tokens) - 1
    again.close()
    # ... one with other KV settings, or full precision, never does.
    for other in (KVQuant(8, 64, 0), KVQuant(4, 64, 5), None):
        fresh = PrefixCache(BIG, PrefixDisk(folder, BIG, "m"))
        _, cached = run_chat(model, draft, tokenizer, second, fresh, other)
        assert cached == 0, other
        fresh.close()


def test_bytes_per_token_match_the_caches(wide) -> None:
    model, _ = wide
    g = kv_geometry(model)
    assert g is not None and g.kv_elements == 2 * 2 * 64 and head_dim(model) == 64
    sizes = []
    for bits in (None, 8, 4):
        cache: list[Any] = [KVCache()]
        cache[0].update_and_fetch(mx.zeros((1, 2, 256, 64)), mx.zeros((1, 2, 256, 64)))
        if bits is not None:
            cache[0] = cache[0].to_quantized(group_size=64, bits=bits)
        sizes.append(bytes_per_position(g, kv_bits=bits, group_size=64))
        assert sizes[-1] * 256 == cache[0].nbytes, bits
    assert sizes == sorted(sizes, reverse=True)


def test_settings_are_checked() -> None:
    for bits, group, message in ((7, 64, "kv-bits"), (4, 16, "kv-group-size")):
        with pytest.raises(ValueError, match=message):
            check_kv_bits(bits, group)
    from dflash_server.cli import load_settings
    from dflash_server.config_files import SettingsError

    with pytest.raises(SettingsError, match="--kv-bits: must be one of 2, 3, 4, 5, 6, 8, got 7"):
        load_settings(["--kv-bits", "7"])
    settings = load_settings(["--kv-bits", "4", "--quantized-kv-start", "0"])
    assert settings.kv_quant == KVQuant(4, 64, 0)
    assert load_settings([]).kv_quant is None
    assert load_settings(["--kv-bits", "8"]).quantized_kv_start == 5000  # mlx-lm's default


def test_group_size_must_divide_the_heads(tiny_hybrid) -> None:
    model, tokenizer = tiny_hybrid  # 16-wide heads: no group size divides them
    with pytest.raises(ValueError, match="does not divide the model's attention head size 16"):
        next(stream_generate(model, None, tokenizer, [1, 2, 3], kv_bits=8, kv_group_size=32))


def test_a_model_without_make_cache_is_sized(tiny_attn: Any) -> None:
    """qwen3 (like llama) has no ``make_cache``: mlx-lm gives it one KVCache per layer, and the
    KV budget sizes it (it once logged "KV memory budget: none" for such models)."""
    model, _ = tiny_attn
    assert not hasattr(model, "make_cache")
    g = kv_geometry(model)
    assert g is not None and g.kv_elements > 0 and g.recurrent_bytes == 0
