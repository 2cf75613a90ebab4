"""DSpark drafters: both published packagings load unmodified, drafts equal mlx-vlm's on the same
weights, each Markov kind and the confidence cut follow their formulas, and decoding stays exact
(greedy lone and batched, sampled law, prefix hits, quantized exports)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from dflash_server.adaptive.policy import FixedBlock
from dflash_server.drafters.dspark import DSparkConfig, DSparkDraftModel
from dflash_server.drafters.protocol import DraftRow
from dflash_server.drafters.registry import family_of, load_drafter
from dflash_server.engine.prefix_cache import PrefixCache
from dflash_server.generation.pair import ModelPair
from dflash_server.generation.request import BlockPolicy, GenerationRequest
from dflash_server.generation.sampling import SamplingParams, TokenSampler
from dflash_server.generation.stream import generate
from dflash_server.testing.layouts import write_dspark
from test_adaptive import Scripted
from test_batching import make_decoder, new_batch, plain_greedy, step_rows, tokens_of

# deepseek-ai/dspark_qwen3_4b_block7's config.json keys (a Qwen3-4B config copied by DeepSpec's
# trainer, its DSpark keys at the top level), as the trainer writes them.
DEEPSPEC_4B = {
    "architectures": ["Qwen3DSparkModel"],
    "model_type": "qwen3",
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 5,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "max_position_embeddings": 40960,
    "layer_types": ["full_attention"] * 5,
    "tie_word_embeddings": False,
    "num_target_layers": 36,
    "block_size": 7,
    "mask_token_id": 151669,
    "target_layer_ids": [1, 9, 17, 25, 33],
    "num_anchors": 512,
    "markov_rank": 256,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
}
# SpecForge's packaging of the same heads: DFlash's config with the DSpark keys in dflash_config.
SPECFORGE = {
    **{k: v for k, v in DEEPSPEC_4B.items() if k not in (
        "architectures", "block_size", "mask_token_id", "target_layer_ids", "num_anchors",
        "markov_rank", "markov_head_type", "enable_confidence_head",
        "confidence_head_with_markov")},
    "architectures": ["DFlashDraftModel"],
    "dflash_config": {"projector_type": "dspark", "block_size": 7, "mask_token_id": 151669,
                      "target_layer_ids": [1, 9, 17, 25, 33], "markov_rank": 256,
                      "markov_head_type": "vanilla", "enable_confidence_head": True},
}  # fmt: skip


def test_both_packagings_parse() -> None:
    """Block 7 counts proposals: verified 8 wide; the embedding and head come with DeepSpec's
    weights and from the target otherwise; a legacy name or a Markov key is claimed too."""
    deepspec = DSparkConfig.from_dict(DEEPSPEC_4B, ["embed_tokens.weight", "lm_head.weight"])
    specforge = DSparkConfig.from_dict(SPECFORGE, [])
    for config in (deepspec, specforge):
        assert config.block_size == 8 and config.markov_rank == 256
        assert config.target_layer_ids == (1, 9, 17, 25, 33) and config.mask_token_id == 151669
        assert config.enable_confidence_head and config.sample_from_anchor
    assert (deepspec.own_embedding, deepspec.own_head) == (True, True)
    assert (specforge.own_embedding, specforge.own_head) == (False, False)
    legacy = {**DEEPSPEC_4B, "architectures": ["DSparkDraftModel"]}
    anchored = {**SPECFORGE, "dspark_bonus_anchor": True}
    for raw in (DEEPSPEC_4B, SPECFORGE, legacy, anchored):
        assert family_of(raw).name == "DSpark"
    assert DSparkConfig.from_dict(anchored).block_size == 7  # its block counts the anchor
    plain_dflash = {**SPECFORGE, "dflash_config": {"block_size": 16, "mask_token_id": 1}}
    assert family_of(plain_dflash).name == "DFlash"
    with pytest.raises(ValueError, match="markov_head_type 'lstm'"):
        DSparkConfig.from_dict({**DEEPSPEC_4B, "markov_head_type": "lstm"})
    with pytest.raises(ValueError, match="confidence head with Markov features but no Markov"):
        DSparkConfig.from_dict({**DEEPSPEC_4B, "markov_rank": 0})


def mlx_vlm_dspark(folder: Path, target: Any) -> Any:
    """mlx-vlm's DSpark drafter on the folder's weights (it reads the SpecForge keys only, and
    always borrows the target's head: DeepSpec's copy of it is the same matrix)."""
    from mlx_vlm.speculative.drafters.dspark import Model, ModelConfig

    raw = json.loads((folder / "config.json").read_text())
    if "dflash_config" not in raw:
        keys = ("block_size", "mask_token_id", "target_layer_ids", "markov_rank",
                "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")  # fmt: skip
        raw = {**raw, "dflash_config": {k: raw.pop(k) for k in keys if k in raw}}
    theirs = Model(ModelConfig.from_dict(raw))
    weights = theirs.sanitize(dict(mx.load(str(folder / "model.safetensors"))))
    weights.pop("lm_head.weight", None)
    theirs.load_weights(list(weights.items()))
    super(Model, theirs).bind(target)  # its own check wants an mlx-vlm target object
    return theirs


def taps_for(draft: Any, n: int, seed: int) -> mx.array:
    features = len(draft.config.target_layer_ids) * draft.config.hidden_size
    return mx.random.normal((1, n, features), key=mx.random.key(seed))


def row_of(draft: Any, taps: mx.array, anchor: int, width: int, sampler: Any) -> DraftRow:
    cache = draft.make_cache()
    draft.append_context(taps, cache, mx.arange(taps.shape[1]))
    block = mx.array([[anchor] + [draft.config.mask_token_id] * (width - 1)])
    return DraftRow(block, cache, sampler)


@pytest.mark.parametrize("layout", ["deepspec", "specforge"])
def test_drafts_equal_mlx_vlm(layout: str, tiny_hybrid: Any, tmp_path: Path) -> None:
    """Greedy drafts at several widths and contexts equal mlx-vlm's; a sampled draft's log q is
    mlx-vlm's Markov-corrected law given the drafts before it."""
    model, _ = tiny_hybrid
    folder = write_dspark(tmp_path / layout, model, layout=layout, block_size=7)
    ours, theirs = load_drafter(folder, model), mlx_vlm_dspark(folder, model)
    assert isinstance(ours, DSparkDraftModel) and ours.family == "DSpark"
    greedy = TokenSampler(SamplingParams())
    for seed, (context, width, anchor) in enumerate([(9, 8, 5), (23, 5, 40), (4, 2, 7)]):
        taps = taps_for(ours, context, seed)
        drafts, log_q = ours.propose([row_of(ours, taps, anchor, width, greedy)])[0]
        want = theirs.draft_block(anchor, taps, theirs.make_cache(), width, lambda x: x.argmax(-1))
        assert log_q is None and drafts.tolist() == want[0].tolist()
    taps = taps_for(ours, 12, 7)
    sampled = TokenSampler(SamplingParams(temperature=1.0), seed=3)
    drafts, log_q = ours.propose([row_of(ours, taps, 9, 8, sampled)])[0]
    laws, forced = [], iter(drafts.tolist())

    def follow(logits: mx.array) -> mx.array:  # record mlx-vlm's law, take our draft
        laws.append(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        return mx.array([next(forced)])

    theirs.draft_block(9, taps, theirs.make_cache(), 8, follow)
    assert mx.allclose(log_q, mx.concatenate(laws), atol=1e-4).item()


def numpy_walk(draft: DSparkDraftModel, taps: mx.array, anchor: int, width: int) -> list[int]:
    """Greedy drafts written from DeepSpec's formulas in numpy, apart from the model code."""
    cache = draft.make_cache()
    draft.append_context(taps, cache, mx.arange(taps.shape[1]))
    block = mx.array([[anchor] + [draft.config.mask_token_id] * (width - 2)])
    h = np.array(draft.hidden_states(block, None, cache)[0])
    base = np.array(draft.target_head().logits(mx.array(h)))
    flat = {k: np.array(v) for k, v in tree_flatten(draft.markov_head.parameters())}
    w1, w2 = flat["markov_w1.weight"], flat["markov_w2.weight"]

    def sigmoid(x: np.ndarray) -> np.ndarray:
        return 1 / (1 + np.exp(-x))

    out, prev, state = [], anchor, np.zeros(w1.shape[1])
    for i in range(width - 1):
        e = w1[prev]
        if draft.markov_head.kind == "gated":
            g = flat["gate_proj.weight"] @ np.concatenate([h[i], e]) + flat["gate_proj.bias"]
            bias = w2 @ (sigmoid(g) * e)
        else:  # rnn
            z = flat["joint_proj.weight"] @ np.concatenate([state, e, h[i]])
            gate, cand, output = np.split(z + flat["joint_proj.bias"], 3)
            state = sigmoid(gate) * state + (1 - sigmoid(gate)) * np.tanh(cand)
            bias = w2 @ np.tanh(output)
        prev = int(np.argmax(base[i] + bias))
        out.append(prev)
    return out


@pytest.mark.parametrize("kind", ["gated", "rnn"])
def test_other_markov_kinds_follow_their_formulas(kind: str, tiny_hybrid: Any, tmp_path: Path):
    model, _ = tiny_hybrid
    folder = write_dspark(tmp_path / kind, model, markov=kind, rank=32, confidence=False)
    draft = load_drafter(folder, model)
    draft.markov_head.markov_w2.weight = 20 * draft.markov_head.markov_w2.weight  # decisive
    taps = taps_for(draft, 11, 2)
    drafts = draft.propose([row_of(draft, taps, 5, 8, TokenSampler(SamplingParams()))])[0][0]
    assert drafts.tolist() == numpy_walk(draft, taps, 5, 8)


def test_confidence_head_cuts_blocks(tiny_hybrid: Any, tmp_path: Path) -> None:
    """With a threshold, each row's block ends before its first draft whose confidence is below
    it (DeepSpec's rule), rows cut apart in one pass; decoding stays exact, lone and batched."""
    model, tokenizer = tiny_hybrid
    draft = load_drafter(write_dspark(tmp_path / "c", model), model)
    greedy = TokenSampler(SamplingParams())
    rows = [row_of(draft, taps_for(draft, n, n), 5 + n, 8, greedy) for n in (6, 13, 9)]
    whole = [d.tolist() for d, _ in draft.propose(rows)]
    confidences = []
    for row, drafts in zip(rows, whole):
        h = draft.hidden_states(row.block[:, :-1], None, row.cache)[0]
        previous = mx.array([row.block[0, 0].item(), *drafts[:-1]])
        confidences.append(draft._confidence(h, previous).tolist())
    threshold = float(np.median(np.concatenate(confidences)))
    draft.config.confidence_threshold = threshold
    cut = [d.tolist() for d, _ in draft.propose(rows)]
    for drafts, conf, got in zip(whole, confidences, cut):
        keep = next((i for i, c in enumerate(conf) if c < threshold), len(drafts))
        assert got == drafts[:keep]
    assert {len(c) for c in cut} != {7}  # some block was cut

    prompts = [tokenizer.encode(p) for p in ("def fibonacci(n):", "The quick brown fox")]
    lone = [tokens_of(make_decoder(model, draft, 8).generate(p, 30)) for p in prompts]
    assert lone == [plain_greedy(model, p, 30) for p in prompts]
    specs = {i: (make_decoder(model, draft, 8).row, p, 30) for i, p in enumerate(prompts)}
    out = step_rows(new_batch(model), specs, start={1: 2})
    assert [tokens_of(out[i]) for i in range(2)] == lone


@pytest.fixture(scope="module")
def dspark(tiny_hybrid: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    model, _ = tiny_hybrid
    return load_drafter(write_dspark(tmp_path_factory.mktemp("dspark") / "d", model), model)


def test_greedy_equals_plain_lone_and_batched(tiny_hybrid: Any, dspark: Any) -> None:
    """Widths changing, rows joining and leaving, a sampled row beside them: each row as alone,
    the greedy ones as plain decoding."""
    model, tokenizer = tiny_hybrid
    ids = [tokenizer.encode(p) for p in ("def fibonacci(n):", "The quick brown fox", "x y")]
    sampled = SamplingParams(temperature=1.0, top_p=0.9)
    makes = {
        "w8": (lambda: make_decoder(model, dspark, 8), ids[0], 36),
        "w3": (lambda: make_decoder(model, dspark, 3), ids[1], 30),
        "widths": (lambda: make_decoder(model, dspark, 8,
                                        policy=Scripted([2, 8, 1, 5, 3], 8)), ids[2], 33),
        "sampled": (lambda: make_decoder(model, dspark, 4, sampling=sampled, seed=5), ids[1], 25),
        "plain": (lambda: make_decoder(model, None, 1), ids[2], 20),
    }  # fmt: skip
    rows = {k: (make().row, p, n) for k, (make, p, n) in makes.items()}
    out = step_rows(new_batch(model), rows, start={"w3": 2, "widths": 1, "sampled": 3})
    for key, (make, prompt, n) in makes.items():
        lone = tokens_of(make().generate(prompt, n))
        assert tokens_of(out[key]) == lone, key
        if key != "sampled":
            assert lone == plain_greedy(model, prompt, n), key


def test_rows_drafted_together_equal_each_alone(dspark: Any) -> None:
    """One pass for rows of different contexts and widths: each row's drafts and log q as its
    own pass gives them (the Markov walk runs all rows at each position)."""
    params = SamplingParams(temperature=0.8)

    def rows() -> list[DraftRow]:
        return [row_of(dspark, taps_for(dspark, n, n), 7 + i, width, TokenSampler(params, i))
                for i, (n, width) in enumerate([(5, 8), (23, 3), (9, 6)])]  # fmt: skip

    together = dspark.propose(rows())
    alone = [dspark.propose([row])[0] for row in rows()]
    for (d1, q1), (d2, q2) in zip(together, alone):
        assert d1.tolist() == d2.tolist() and mx.allclose(q1, q2, atol=1e-4).item()


@pytest.mark.slow
def test_sampled_output_follows_the_target_law(tiny_hybrid: Any, dspark: Any) -> None:
    from test_sampling import exact_law, total_variation, tv_tolerance

    model, tokenizer = tiny_hybrid
    prompt = tokenizer.encode("The quick brown fox")
    params = SamplingParams(temperature=1.5, top_k=2)
    exact = exact_law(model, prompt, params)
    n, counts = 480, Counter()
    for seed in range(n):
        policy = FixedBlock(4) if seed % 2 else Scripted([1, 3, 2], 4)
        run = make_decoder(model, dspark, 4, sampling=params, seed=seed, policy=policy)
        counts[tuple(tokens_of(run.generate(prompt, 3)))] += 1
    assert total_variation(counts, exact, n) < tv_tolerance(len(exact), n, factor=2.0)


def test_prefix_cache_hit_equals_cold(tiny_hybrid: Any, dspark: Any) -> None:
    model, tokenizer = tiny_hybrid
    system = tokenizer.encode("def fibonacci(n): return n if n < 2 else")
    prompts = [system + tokenizer.encode(" fib(n - 1)"), system + tokenizer.encode(" x")]
    pair = ModelPair.of(model, tokenizer, dspark)
    cache = PrefixCache(1 << 30)

    def run(prompt: list[int], prefix: Any) -> tuple[list[int], Any]:
        request = GenerationRequest(tuple(prompt), 20, checkpoints=(len(system),),
                                    block=BlockPolicy(6))  # fmt: skip
        out = list(generate(pair, request, prefill_step_size=8, prefix=prefix))
        return [t for r in out for t in r.tokens], out[-1].stats

    run(prompts[0], cache)
    warm, stats = run(prompts[1], cache)
    assert stats.cached_tokens >= len(system)
    assert warm == run(prompts[1], None)[0] == plain_greedy(model, prompts[1], 20)


@pytest.mark.parametrize("bits", [4, 6])
def test_quantized_exports_load_and_stay_exact(bits: int, tiny_hybrid: Any, tmp_path: Path):
    model, tokenizer = tiny_hybrid
    folder = write_dspark(tmp_path / f"q{bits}", model, rank=32, quantize_bits=bits)
    assert "quantization" in json.loads((folder / "config.json").read_text())
    draft = load_drafter(folder, model)
    assert hasattr(draft.markov_head.markov_w2, "scales")  # loaded packed, as exported
    prompt = tokenizer.encode("def fibonacci(n):")
    assert tokens_of(make_decoder(model, draft, 8).generate(prompt, 24)) == plain_greedy(
        model, prompt, 24
    )


def test_a_drafter_for_another_target_is_refused(tiny_attn: Any, tiny_hybrid: Any, tmp_path):
    """Built for the hybrid target (4 layers), loaded for another: refused naming what differs;
    a checkpoint whose Markov table has another vocabulary is refused naming the tensor."""
    model, _ = tiny_hybrid
    folder = write_dspark(tmp_path / "d", model)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "num_target_layers": 9}))
    with pytest.raises(ValueError, match="trained on a 9-layer target"):
        load_drafter(folder, model)
    (folder / "config.json").write_text(json.dumps(raw))
    weights = dict(mx.load(str(folder / "model.safetensors")))
    weights["markov_head.markov_w1.weight"] = weights["markov_head.markov_w1.weight"][:-8]
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    with pytest.raises(ValueError, match=r"markov_head\.markov_w1\.weight"):
        load_drafter(folder, model)
