"""DFlash2 drafters: published layout, config keys, the new parts tied to known behaviour,
loading (plain, ``.weight``-spelled, quantized), lossless greedy and exact sampled decoding."""

from __future__ import annotations

import json
from argparse import Namespace
from collections import Counter

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import quantize_model

from dflash_server import DFlashDraftModel, load_draft, stream_generate
from dflash_server.adaptive.policy import FixedBlock
from dflash_server.drafters.dflash2 import DFlash2Config, DFlash2DraftModel
from dflash_server.drafters.protocol import DraftRow
from dflash_server.generation.row import Row
from dflash_server.generation.sampling import SamplingParams, TokenSampler
from dflash_server.generation.speculative import SpeculativeDecoder
from dflash_server.generation.target import TargetModel
from dflash_server.testing import random_dflash2_drafter
from dflash_server.tools.common import save_drafter
from test_sampling import total_variation, tv_tolerance

# z-lab/dflash tests/fixtures/dflash2-config.json (a published DFlash2 config), as downloaded.
PUBLISHED_DFLASH2 = {
    "architectures": ["DFlash2DraftModel"],
    "attention_bias": False,
    "is_causal": False,
    "dflash_config": {
        "block_size": 16,
        "conv_group_size": 16,
        "conv_kernel_size": 2,
        "final_logit_softcapping": 20.0,
        "mask_token_id": 201818,
        "output_multiplier": 0.19611613513818404,
        "selector_rank": 256,
        "selector_top_k": 16,
        "target_layer_ids": [1, 13, 25, 37, 49],
    },
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 6656,
    "intermediate_size": 19968,
    "layer_types": ["sliding_attention"] * 5,
    "max_position_embeddings": 131072,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 5,
    "num_key_value_heads": 8,
    "num_target_layers": 52,
    "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
    "sliding_window": 2048,
    "tie_word_embeddings": False,
    "use_sliding_window": True,
    "vocab_size": 202048,
}
# Its safetensors header (dflash2-safetensors-header.json): 6 top-level tensors, 15 per layer,
# all bf16; the codebooks carry no ".weight" suffix.
PUBLISHED_TOP = {
    "candidate_selector.hidden_projection.weight": (256, 6656),
    "candidate_selector.predecessor_codebook": (202048, 256),
    "candidate_selector.successor_codebook": (202048, 256),
    "fc.weight": (6656, 33280),
    "hidden_norm.weight": (6656,),
    "norm.weight": (6656,),
}
PUBLISHED_LAYER = {
    "attention_conv.base_kernel": (2, 2, 6656),
    "attention_conv.kernel_projection.weight": (1664, 6656),
    "input_layernorm.weight": (6656,),
    "mlp.down_proj.weight": (6656, 19968),
    "mlp.gate_proj.weight": (19968, 6656),
    "mlp.up_proj.weight": (19968, 6656),
    "mlp_conv.base_kernel": (2, 2, 6656),
    "mlp_conv.kernel_projection.weight": (1664, 6656),
    "post_attention_layernorm.weight": (6656,),
    "self_attn.k_norm.weight": (128,),
    "self_attn.k_proj.weight": (1024, 6656),
    "self_attn.o_proj.weight": (6656, 4096),
    "self_attn.q_norm.weight": (128,),
    "self_attn.q_proj.weight": (4096, 6656),
    "self_attn.v_proj.weight": (1024, 6656),
}


def test_module_tree_is_the_published_layout():
    config = DFlash2Config.from_dict(PUBLISHED_DFLASH2)
    shapes = {k: v.shape for k, v in tree_flatten(DFlash2DraftModel(config).parameters())}
    want = dict(PUBLISHED_TOP)
    for i in range(5):
        want.update({f"layers.{i}.{k}": v for k, v in PUBLISHED_LAYER.items()})
    assert len(shapes) == 81
    assert shapes == want


def test_published_config_parses_and_round_trips():
    c = DFlash2Config.from_dict(PUBLISHED_DFLASH2)
    assert (c.block_size, c.mask_token_id, c.target_layer_ids) == (16, 201818, (1, 13, 25, 37, 49))
    assert (c.conv_kernel_size, c.conv_group_size, c.selector_rank, c.selector_top_k) == (
        2,
        16,
        256,
        16,
    )
    assert (c.final_logit_softcapping, c.output_multiplier) == (20.0, 0.19611613513818404)
    assert (c.is_causal, c.sliding_window, c.rope_theta) == (False, 2048, 5e5)
    assert DFlash2Config.from_dict(c.to_dict()) == c
    assert c.to_dict()["architectures"] == ["DFlash2DraftModel"]


@pytest.mark.parametrize(
    ("path", "message"),
    [
        (("dflash_config", "conv_kernel_size"), "dflash_config.conv_kernel_size"),
        (("dflash_config", "conv_group_size"), "dflash_config.conv_group_size"),
        (("dflash_config", "selector_rank"), "dflash_config.selector_rank"),
        (("dflash_config", "selector_top_k"), "dflash_config.selector_top_k"),
        (("dflash_config", "mask_token_id"), "mask_token_id"),
        (("dflash_config", "block_size"), "block_size"),
        (("dflash_config",), "dflash_config"),
        (("sliding_window",), "sliding_window"),
        (("hidden_size",), "hidden_size"),
    ],
)
def test_missing_keys_are_named(path, message):
    cfg = json.loads(json.dumps(PUBLISHED_DFLASH2))
    parent = cfg if len(path) == 1 else cfg[path[0]]
    del parent[path[-1]]
    with pytest.raises(ValueError, match=message):
        DFlash2Config.from_dict(cfg)


def with_config(draft: DFlash2DraftModel, model, cls=DFlash2DraftModel, **changes):
    """The same weights under another config (v1 class: its subset of the weights)."""
    config = DFlash2Config(**{**draft.config.__dict__, **changes})
    other = cls(config)
    other.load_weights(
        [
            (k, v)
            for k, v in tree_flatten(draft.parameters())
            if cls is DFlash2DraftModel or ("conv" not in k and "selector" not in k)
        ]
    )
    return other.bind(model)


def context(draft, n: int, seed: int = 0) -> mx.array:
    width = len(draft.config.target_layer_ids) * draft.config.hidden_size
    return mx.random.normal((1, n, width), key=mx.random.key(seed))


def block_of(draft, anchor: int = 5, size: int | None = None) -> mx.array:
    size = size or draft.config.block_size
    return mx.array([[anchor] + [draft.config.mask_token_id] * (size - 1)])


def logits_after(draft, chunks: list[int], block: mx.array) -> mx.array:
    """Logits of ``block`` after appending the context in chunks of the given sizes."""
    cache, start, taps = draft.make_cache(), 0, context(draft, sum(chunks))
    for n in chunks[:-1]:
        draft.append_context(taps[:, start : start + n], cache)
        start += n
    return draft(block, taps[:, start:], cache)


def test_is_causal_is_honoured(tiny_hybrid):
    model, _ = tiny_hybrid
    draft = random_dflash2_drafter(model, block_size=4, sliding_window=64)
    derived = with_config(draft, model, is_causal=None)  # key absent: sliding layers are causal
    causal = with_config(draft, model, is_causal=True)
    assert [layer.self_attn.causal for layer in draft.layers] == [False, False]
    assert all(layer.self_attn.causal for layer in derived.layers)
    block = block_of(draft)
    changed = mx.concatenate([block[:, :-1], mx.array([[7]])], axis=1)  # last position differs
    for d, sees_later in ((draft, True), (causal, False), (derived, False)):
        a, b = (logits_after(d, [6], x)[0, 1] for x in (block, changed))
        assert mx.allclose(a, b, atol=1e-5).item() is not sees_later


def identity_convs(draft: DFlash2DraftModel) -> None:
    for layer in draft.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.base_kernel = mx.zeros_like(conv.base_kernel).at[:, 0, :].add(1.0)
            conv.kernel_projection.weight = mx.zeros_like(conv.kernel_projection.weight)


def test_identity_convs_reduce_to_dflash(tiny_hybrid):
    """Base tap 0 = 1, other taps and projections 0: the DFlash2 forward is DFlash's."""
    model, _ = tiny_hybrid
    draft = random_dflash2_drafter(model, block_size=6, sliding_window=8)
    before = logits_after(draft, [5, 9], block_of(draft))
    identity_convs(draft)
    v1 = with_config(draft, model, cls=DFlashDraftModel)
    assert type(v1) is DFlashDraftModel
    ours, theirs = (logits_after(d, [5, 9], block_of(draft)) for d in (draft, v1))
    assert mx.allclose(ours, theirs, atol=1e-4).item()
    assert not mx.allclose(before, ours, atol=1e-3).item()  # the random convs did matter


def walk(h: np.ndarray, logits: np.ndarray, anchor: int, sel) -> list[int]:
    """Brute-force greedy selector walk, written independently of the model code."""
    pred, succ = np.array(sel.predecessor_codebook), np.array(sel.successor_codebook)
    proj = h @ np.array(sel.hidden_projection.weight).T
    path, prev = [], anchor
    for i in range(len(h)):
        cands = np.argsort(-logits[i])[: sel.top_k]
        scores = logits[i, cands] + succ[cands] @ (pred[prev] * proj[i])
        prev = int(cands[np.argmax(scores)])
        path.append(prev)
    return path


def propose_one(draft, block, taps, sampler):
    """One row's proposal on a fresh context of ``taps``."""
    cache = draft.make_cache()
    draft.append_context(taps, cache)
    return draft.propose([DraftRow(block, cache, sampler)])[0]


def test_selector_walk(tiny_hybrid):
    """Greedy proposals = an independent brute-force walk; zero codebooks = the top-1 tokens."""
    model, _ = tiny_hybrid
    draft = random_dflash2_drafter(model, block_size=8)
    sel = draft.candidate_selector
    sel.successor_codebook = 10 * sel.successor_codebook  # make the Markov term decisive
    greedy = TokenSampler(SamplingParams())
    taps, block = context(draft, 9), block_of(draft)
    h = np.array(draft.hidden_states(block, taps, draft.make_cache())[0, 1:])
    logits = np.array(draft(block, taps, draft.make_cache(), logits_start=1)[0])
    top1 = np.argmax(logits, axis=-1).tolist()
    drafts, log_q = propose_one(draft, block, taps, greedy)
    assert log_q is None
    assert drafts.tolist() == walk(h, logits, 5, sel) != top1
    sel.predecessor_codebook = mx.zeros_like(sel.predecessor_codebook)
    sel.successor_codebook = mx.zeros_like(sel.successor_codebook)
    assert propose_one(draft, block, taps, greedy)[0].tolist() == top1


def test_sampled_proposals_follow_their_log_q(tiny_hybrid):
    """Each draft is drawn from the log_q row returned with it (row 1 given the row-0 draft)."""
    model, _ = tiny_hybrid
    draft = random_dflash2_drafter(model, block_size=3, top_k=6)
    h = draft.hidden_states(block_of(draft), context(draft, 4), draft.make_cache())[0, 1:]
    logits = draft(block_of(draft), context(draft, 4), draft.make_cache(), logits_start=1)[0]
    sampler = TokenSampler(SamplingParams(temperature=2.0), seed=3)
    n, first, second, laws = 2000, Counter(), {}, {}
    for _ in range(n):
        drafts, log_q = draft.candidate_selector.propose(h, logits, mx.array(5), sampler)
        d0, d1 = drafts.tolist()
        first[d0] += 1
        second.setdefault(d0, Counter())[d1] += 1
        laws.setdefault(d0, log_q)
    q0 = np.exp(np.array(laws[d0][0]))
    assert np.isclose(q0.sum(), 1, atol=1e-5) and (q0 > 0).sum() == 6  # candidates only
    assert total_variation(first, dict(enumerate(q0)), n) < tv_tolerance(6, n)
    d0, count = first.most_common(1)[0]
    q1 = dict(enumerate(np.exp(np.array(laws[d0][1]))))
    assert total_variation(second[d0], q1, count) < tv_tolerance(6, count)


def test_sliding_window_context(tiny_hybrid):
    model, _ = tiny_hybrid
    draft = random_dflash2_drafter(model, block_size=4, sliding_window=16)
    full = with_config(draft, model, layer_types=("full_attention",) * 2, sliding_window=None)
    block = block_of(draft)
    short = [logits_after(d, [5, 6], block) for d in (draft, full)]  # 11 + 4 < 16
    assert mx.allclose(*short, atol=1e-5).item()
    long = [logits_after(d, [9, 14], block) for d in (draft, full)]
    assert not mx.allclose(*long, atol=1e-3).item()
    # The window is per query position; chunking the context does not change it.
    for chunks in ([23], [1, 1, 21], [20, 3]):
        assert mx.allclose(logits_after(draft, chunks, block), long[0], atol=1e-5).item()
    cache = draft.make_cache()
    draft.append_context(context(draft, 300), cache)
    assert cache[0].size == 15 and cache[0].offset == 300  # window - 1 entries kept
    # snapshot/restore (prefix caches): a restored cache drafts exactly like the original.
    restored = draft.make_cache()
    for c, r in zip(cache, restored):
        r.restore(c.snapshot())
    a, b = (draft(block, None, c) for c in (cache, restored))
    assert mx.array_equal(a, b).item()
    more = context(draft, 3, seed=2)
    a, b = (draft(block, more, c) for c in (cache, restored))
    assert mx.allclose(a, b, atol=1e-6).item() and restored[0].offset == 303


def save(draft, path, extra: dict | None = None, weights: dict | None = None):
    path.mkdir(parents=True, exist_ok=True)
    weights = weights if weights is not None else dict(tree_flatten(draft.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps({**draft.config.to_dict(), **(extra or {})}))
    return path


def test_save_load_round_trip(tiny_hybrid, tmp_path):
    model, _ = tiny_hybrid
    draft = random_dflash2_drafter(model, block_size=6)
    loaded = load_draft(save(draft, tmp_path / "d"), target=model)
    assert isinstance(loaded, DFlash2DraftModel) and loaded.family == "DFlash2"
    assert mx.allclose(
        logits_after(draft, [7], block_of(draft)), logits_after(loaded, [7], block_of(draft))
    )
    # MLX exports built on an Embedding spell the codebooks ".weight": same model.
    weights = dict(tree_flatten(draft.parameters()))
    for name in ("predecessor_codebook", "successor_codebook"):
        key = f"candidate_selector.{name}"
        weights[f"{key}.weight"] = weights.pop(key)
    spelled = load_draft(save(draft, tmp_path / "w", weights=weights), target=model)
    assert mx.array_equal(
        spelled.candidate_selector.successor_codebook, draft.candidate_selector.successor_codebook
    )
    del weights["layers.1.mlp_conv.base_kernel"]
    with pytest.raises(ValueError, match=r"missing 1: layers\.1\.mlp_conv\.base_kernel"):
        load_draft(save(draft, tmp_path / "bad", weights=weights))


def test_quantized_load(tiny_hybrid, tmp_path):
    model, tokenizer = tiny_hybrid
    draft = random_dflash2_drafter(model, block_size=4)
    reference = logits_after(draft, [7], block_of(draft))
    raw = draft.config.to_dict()
    qdraft, config = quantize_model(draft, raw, 32, 8)  # reads draft.quant_predicate
    save_drafter(qdraft, tmp_path / "q", config, ["card"])
    loaded = load_draft(tmp_path / "q", target=model)
    layer = loaded.layers[0]
    assert isinstance(layer.self_attn.q_proj, nn.QuantizedLinear)
    assert isinstance(layer.mlp.down_proj, nn.QuantizedLinear)
    assert isinstance(loaded.fc, nn.QuantizedLinear)
    assert type(layer.attention_conv.kernel_projection) is nn.Linear  # kept in high precision
    assert type(loaded.candidate_selector.hidden_projection) is nn.Linear
    assert mx.allclose(logits_after(loaded, [7], block_of(draft)), reference, atol=0.5).item()
    ids = tokenizer.encode("The quick brown")
    plain = [
        t for r in stream_generate(model, None, tokenizer, ids, max_tokens=12) for t in r.tokens
    ]
    spec = [
        t
        for r in stream_generate(model, loaded, tokenizer, ids, 4, max_tokens=12)
        for t in r.tokens
    ]
    assert spec == plain
    # A peer export that packed the conv projections too loads them packed.
    peer = random_dflash2_drafter(model, block_size=4)
    nn.quantize(peer, group_size=32, bits=4)
    path = save(peer, tmp_path / "peer", {"quantization": {"group_size": 32, "bits": 4}})
    conv = load_draft(path).layers[1].mlp_conv.kernel_projection
    assert isinstance(conv, nn.QuantizedLinear)


class Planted(DFlash2DraftModel):
    """Test double: the real DFlash2 pass and selector, row logits pulled toward planted tokens
    (``plant``: absolute position -> token) by ``bias``, the real logits scaled by ``keep``."""

    plant: dict[int, int]
    bias, keep = 30.0, 1.0

    def block_states(self, rows):
        self.anchor = rows[0].cache[0].offset  # absolute position of block position 0 (alone)
        return super().block_states(rows)

    def bind(self, target):
        super().bind(target)
        real = self.head.logits

        def planted(h):
            rows = [self.plant.get(self.anchor + 1 + i, -1) for i in range(h.shape[-2])]
            hit = mx.arange(real(h).shape[-1]) == mx.array(rows)[:, None]
            return self.keep * real(h) + self.bias * hit

        self.head.logits = planted
        return self


def planted(draft, model, plant, **kw) -> Planted:
    double = Planted(draft.config)
    double.load_weights(tree_flatten(draft.parameters()))
    double.plant = plant
    for k, v in kw.items():
        setattr(double, k, v)
    return double.bind(model)


@pytest.mark.parametrize("block_size", [4, 8])
def test_greedy_is_lossless(tiny_hybrid, block_size):
    model, tokenizer = tiny_hybrid
    draft = random_dflash2_drafter(model, block_size=8)
    for prompt in ("def fibonacci(n):", "<|im_start|>user\nhi<|im_end|>\n"):
        ids = tokenizer.encode(prompt)
        plain = [
            t for r in stream_generate(model, None, tokenizer, ids, max_tokens=32) for t in r.tokens
        ]
        spec = list(stream_generate(model, draft, tokenizer, ids, block_size, max_tokens=32))
        assert [t for r in spec for t in r.tokens] == plain
        # Proposals that are mostly right (planted, with mistakes): long accepts stay lossless.
        wrong = {len(ids) + k for k in (3, 9, 10, 20)}
        plant = {len(ids) + k: (t + int(len(ids) + k in wrong)) for k, t in enumerate(plain)}
        double = planted(draft, model, plant)
        out = list(stream_generate(model, double, tokenizer, ids, block_size, max_tokens=32))
        assert [t for r in out for t in r.tokens] == plain
        assert out[-1].stats.tau > 2


@pytest.mark.slow
def test_sampled_decoding_follows_the_target(tiny_hybrid):
    """Joint law of the first 3 tokens vs exact; the selector's q decides accept/resample."""
    model, tokenizer = tiny_hybrid
    prompt = tokenizer.encode("The quick brown")
    params = SamplingParams(temperature=1.5, top_k=2, repetition_penalty=1.2)
    draft = random_dflash2_drafter(model, block_size=4)
    target = TargetModel(model, draft.config.target_layer_ids)

    def law(prefix: list[int]) -> dict[int, float]:
        sampler = TokenSampler(params)
        ids = prompt + prefix
        logits = target.forward(mx.array(ids)[None], target.make_cache(), slice(-1, None))[0]
        logits = sampler.process(logits[0], mx.array(ids[-20:]))
        return {i: v for i, v in enumerate(mx.exp(sampler.logprobs(logits))[0].tolist()) if v > 0}

    exact = {
        (t0, t1, t2): p0 * p1 * p2
        for t0, p0 in law([]).items()
        for t1, p1 in law([t0]).items()
        for t2, p2 in law([t0, t1]).items()
    }
    best = max(exact, key=exact.get)
    # Real logits damped, the likeliest t1 nudged up: q mixes it with other candidates.
    double = planted(draft, model, {len(prompt) + 1: best[1]}, bias=3.0, keep=0.1)
    n, counts, accepted = 600, Counter(), 0
    for seed in range(n):
        decoder = SpeculativeDecoder(
            Row(target, double, TokenSampler(params, seed=seed), FixedBlock(4))
        )
        counts[tuple(t for c in decoder.generate(prompt, 3) for t in c.tokens)] += 1
        accepted += decoder.stats.accepted
    assert 0.1 * n < accepted < 0.9 * n  # both accept and resample paths ran
    assert total_variation(counts, exact, n) < tv_tolerance(len(exact), n, factor=2.0)


def test_convert_and_train(tiny_hybrid, tiny_hybrid_path, tmp_path):
    """convert works on DFlash2 (conv/selector stay unquantized, published key names);
    train refuses to fine-tune one, saying why."""
    from dflash_server.tools.convert import convert
    from dflash_server.tools.train_init import init_drafter

    model, tokenizer = tiny_hybrid
    src = save(random_dflash2_drafter(model, block_size=4), tmp_path / "src")
    report = convert(src, tmp_path / "out", q_bits=8, q_group_size=32, target=tiny_hybrid_path)
    assert report["logit_error"]["top1_agreement"] > 0.9
    names = set(mx.load(str(tmp_path / "out" / "model.safetensors")))
    assert "candidate_selector.predecessor_codebook" in names
    assert "layers.0.self_attn.q_proj.scales" in names
    assert "layers.0.attention_conv.kernel_projection.scales" not in names
    assert isinstance(load_draft(tmp_path / "out"), DFlash2DraftModel)
    with pytest.raises(ValueError, match="DFlash2"):
        init_drafter(Namespace(init=str(src)), model, tokenizer)
