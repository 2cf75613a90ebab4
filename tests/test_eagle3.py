"""EAGLE-3 drafters: both published layouts load unmodified, drafts and their law equal mlx-vlm's
on the same weights (a reduced draft vocabulary and EAGLE 3.1's per-tap norms included), rows
drafted together equal each alone, and decoding stays exact (greedy lone and batched, sampled
law, prefix hits, quantized exports); a head that does not fit its target is refused."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import mlx_lm
import pytest
from mlx_lm.models.cache import KVCache

from dflash_server.adaptive.policy import FixedBlock
from dflash_server.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from dflash_server.drafters.protocol import DraftRow
from dflash_server.drafters.registry import family_of, load_drafter
from dflash_server.engine.prefix_cache import PrefixCache
from dflash_server.generation.pair import ModelPair
from dflash_server.generation.request import BlockPolicy, GenerationRequest
from dflash_server.generation.sampling import SamplingParams, TokenSampler
from dflash_server.generation.stream import generate
from dflash_server.generation.target import TargetModel
from dflash_server.testing import build_target
from dflash_server.testing.layouts import write_eagle3
from test_adaptive import Scripted
from test_batching import make_decoder, new_batch, plain_greedy, step_rows, tokens_of

# RedHatAI/Qwen3-8B-speculator.eagle3's config.json (speculators 0.1): a Llama layer sized like
# Qwen3-8B's, a 32k draft vocabulary, no aux ids (EAGLE's default for the verifier's depth).
REDHAT_QWEN3_8B = {
    "architectures": ["Eagle3Speculator"],
    "auto_map": {"": "eagle3.Eagle3SpeculatorConfig"},
    "draft_vocab_size": 32000,
    "has_no_defaults_at_init": False,
    "norm_before_residual": True,
    "speculators_config": {
        "algorithm": "eagle3",
        "default_proposal_method": "greedy",
        "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                              "speculative_tokens": 3, "verifier_accept_k": 1}],
        "verifier": {"architectures": ["Qwen3ForCausalLM"], "name_or_path": "Qwen/Qwen3-8B"},
    },
    "speculators_model_type": "eagle3",
    "speculators_version": "0.1.0.dev42",
    "torch_dtype": "float32",
    "transformer_layer_config": {
        "attention_bias": False, "attention_dropout": 0.0, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
        "intermediate_size": 12288, "max_position_embeddings": 40960, "mlp_bias": False,
        "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 1,
        "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000, "torch_dtype": "bfloat16",
        "use_cache": True, "vocab_size": 151936,
    },
    "transformers_version": "4.53.2",
}  # fmt: skip
# SpecForge's configs/qwen3-8b-eagle3.json, with the eagle_config its trainer records (capture
# layers: layer outputs, as SGLang reads them).
SPECFORGE_QWEN3_8B = {
    "architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 1,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    "draft_vocab_size": 32000,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 17, 32]},
}  # fmt: skip
# SpecForge's configs/qwen3-30B-A3B-eagle3.1.json: EAGLE 3.1's per-tap norms.
SPECFORGE_31 = {**{k: v for k, v in SPECFORGE_QWEN3_8B.items() if k != "eagle_config"},
                "hidden_size": 2048, "num_key_value_heads": 4, "fc_norm": True,
                "norm_output": True}  # fmt: skip


def test_published_configs_parse() -> None:
    """Both layouts are claimed; speculators' aux ids name layer inputs (tap = aux - 1), so
    RedHat's default (2, L/2, L-3) and SpecForge's recorded outputs pick the same layers."""
    redhat = Eagle3Config.from_dict(REDHAT_QWEN3_8B, ["embed_tokens.weight"])
    assert redhat.block_size == 4 and redhat.draft_vocab_size == 32000  # 3 speculative tokens
    assert redhat.norm_before_residual and redhat.own_embedding and not redhat.qk_norm
    with pytest.raises(RuntimeError, match="bind it first"):
        redhat.target_layer_ids  # noqa: B018 - the default follows the target's depth
    redhat.depth = 36
    aux = {**REDHAT_QWEN3_8B, "eagle_aux_hidden_state_layer_ids": [2, 18, 33]}
    explicit = Eagle3Config.from_dict(aux)
    specforge = Eagle3Config.from_dict(SPECFORGE_QWEN3_8B)
    assert redhat.target_layer_ids == explicit.target_layer_ids == (1, 17, 32)
    assert specforge.target_layer_ids == (1, 17, 32) and specforge.block_size == 8
    assert not specforge.own_embedding and not specforge.norm_before_residual
    v31 = Eagle3Config.from_dict(SPECFORGE_31)
    assert v31.fc_norm and v31.norm_logits and not v31.feed_normed and v31.taps is None
    # speculators' norm_output feeds the normed output to the next step (SpecForge's does not)
    assert Eagle3Config.from_dict({**REDHAT_QWEN3_8B, "norm_output": True}).feed_normed
    qwen3 = {**REDHAT_QWEN3_8B["transformer_layer_config"], "model_type": "qwen3"}
    assert Eagle3Config.from_dict({**REDHAT_QWEN3_8B, "transformer_layer_config": qwen3}).qk_norm
    eagle_repo = {**SPECFORGE_QWEN3_8B, "architectures": ["LlamaForCausalLM"]}
    for raw in (REDHAT_QWEN3_8B, SPECFORGE_QWEN3_8B, SPECFORGE_31, eagle_repo):
        assert family_of(raw).name == "EAGLE-3"
    with pytest.raises(ValueError, match="embedding output"):
        Eagle3Config.from_dict({**REDHAT_QWEN3_8B, "eagle_aux_hidden_state_layer_ids": [0, 18]})


def mlx_vlm_eagle3(folder: Path, target: Any) -> tuple[Any, list[mx.array]]:
    """mlx-vlm's EAGLE-3 drafter on the folder's weights (it reads speculators' keys and the
    ``layers.0`` names only), and the checkpoint's per-tap norms, which it does not know."""
    from mlx_vlm.speculative.drafters.eagle3 import Model, ModelConfig

    raw = json.loads((folder / "config.json").read_text())
    if "transformer_layer_config" not in raw:
        raw = {"transformer_layer_config": raw, "draft_vocab_size": raw["draft_vocab_size"],
               "norm_before_residual": raw.get("norm_before_residual", False)}  # fmt: skip
    weights = {k.replace("midlayer.", "layers.0."): v
               for k, v in mx.load(str(folder / "model.safetensors")).items()}  # fmt: skip
    fc_norms = [
        weights.pop(f"fc_norm.{i}.weight") for i in range(3) if f"fc_norm.{i}.weight" in weights
    ]
    theirs = Model(ModelConfig.from_dict(raw))
    theirs.load_weights(list(theirs.sanitize(weights).items()), strict=False)
    theirs.bind(target)  # the target's embedding (the speculators copy is the same matrix)
    return theirs, fc_norms


def context(seed: int, n: int, width: int = 64) -> tuple[mx.array, mx.array]:
    """Random taps ([1, n, 3 * width]) and tokens ([n]) of ``n`` committed positions."""
    taps = mx.random.normal((1, n, 3 * width), key=mx.random.key(seed))
    return taps, mx.random.randint(0, 200, (n,), key=mx.random.key(100 + seed))


def row_of(draft: Any, seed: int, n: int, anchor: int, width: int, sampler: Any) -> DraftRow:
    cache = draft.make_cache()
    taps, tokens = context(seed, n)
    draft.append_context(taps, cache, tokens)
    return DraftRow(mx.array([[anchor] + [0] * (width - 1)]), cache, sampler)


@pytest.mark.parametrize(
    "layout, options",
    [("speculators", {}), ("specforge", {"draft_vocab": 96, "fc_norm": True})],
    ids=["speculators", "specforge-d2t-fc_norm"],
)
def test_drafts_equal_mlx_vlm(layout: str, options: dict, tiny_hybrid: Any, tmp_path: Path):
    """Greedy drafts over several contexts and widths equal mlx-vlm's; a sampled draft's log q
    is mlx-vlm's law given the drafts before it, at each draft id's target id (-inf elsewhere).
    mlx-vlm has no per-tap norms: it reads taps normed by the checkpoint's fc_norm weights."""
    model, _ = tiny_hybrid
    folder = write_eagle3(tmp_path / layout, model, layout=layout, **options)
    ours = load_drafter(folder, model)
    assert isinstance(ours, Eagle3Drafter) and ours.family == "EAGLE-3"
    assert ours.config.target_layer_ids == (0, 1, 2)  # aux ids 1, 2, 3 / outputs 0, 1, 2
    theirs, fc_norms = mlx_vlm_eagle3(folder, model)
    eps = ours.config.rms_norm_eps

    def drafts_of_theirs(seed: int, n: int, anchor: int, width: int, sampler: Any) -> mx.array:
        taps, tokens = context(seed, n)
        if fc_norms:
            chunks = mx.split(taps, 3, axis=-1)
            taps = mx.concatenate([mx.fast.rms_norm(x, w, eps) for x, w in zip(chunks, fc_norms)],
                                  axis=-1)  # fmt: skip
        theirs.reset(model)
        greedy = sampler is None
        theirs.prefill_from_target_hidden(tokens[None], taps, anchor, sampler, greedy=greedy)
        return theirs.draft_block(anchor, taps[:, -1:], None, width, sampler, greedy=greedy)[0]

    greedy = TokenSampler(SamplingParams())
    for seed, (n, width, anchor) in enumerate([(9, 6, 5), (23, 4, 40), (1, 3, 7), (4, 2, 9)]):
        drafts, log_q = ours.propose([row_of(ours, seed, n, anchor, width, greedy)])[0]
        want = drafts_of_theirs(seed, n, anchor, width, None)
        assert log_q is None and drafts.tolist() == want.tolist()
    sampled = TokenSampler(SamplingParams(temperature=1.0), seed=3)
    drafts, log_q = ours.propose([row_of(ours, 7, 12, 9, 6, sampled)])[0]
    hot = ours.target_ids if ours.target_ids is not None else mx.arange(log_q.shape[1])
    draft_ids = {t: d for d, t in enumerate(hot.tolist())}
    laws, forced = [], iter(drafts.tolist())

    def follow(logits: mx.array) -> mx.array:  # record mlx-vlm's law, take our draft
        laws.append(logits[0] - mx.logsumexp(logits[0], axis=-1, keepdims=True))
        return mx.array([[draft_ids[next(forced)]]])

    drafts_of_theirs(7, 12, 9, 6, follow)
    assert mx.allclose(log_q[:, hot], mx.concatenate(laws), atol=1e-4).item()
    assert int(mx.isinf(log_q).sum().item()) == log_q.size - hot.size * log_q.shape[0]


PROMPTS = ("def fibonacci(n):", "The quick brown fox", "x y", "import numpy as np")


def fit(draft: Eagle3Drafter, model: Any, prompts: list[list[int]], steps: int = 25) -> None:
    """Fit the head to the target's greedy continuations of ``prompts`` (entry i, taps_i with
    x_{i+1}, learns the target's token after x_{i+1}), its draft vocabulary the tokens seen as
    EAGLE-3's trainers pick it: drafts get accepted, so every commit path runs."""
    seqs = [ids + plain_greedy(model, ids, 32) for ids in prompts]
    tokens = mx.array([seq[: min(map(len, seqs))] for seq in seqs])
    target = TargetModel(model, draft.config.target_layer_ids)
    logits, taps = target.forward(tokens, target.make_cache(), slice(None))
    labels = logits.argmax(-1)[:, 1:]
    seen = sorted(set(labels.flatten().tolist()))
    rest = [t for t in range(draft.config.vocab_size) if t not in seen]
    hot = sorted(seen + rest[: draft.config.draft_vocab_size - len(seen)])
    draft.set_vocabulary(mx.array(hot) - mx.arange(len(hot)))
    labels = mx.array([[hot.index(t) for t in row] for row in labels.tolist()])

    def loss(d: Eagle3Drafter) -> mx.array:
        h = d.layers[0](d.project(taps)[:, :-1], d.embed(tokens[:, 1:]), "causal", KVCache())
        return nn.losses.cross_entropy(d.lm_head(d.norm(h)), labels).mean()

    optimizer, step = optim.Adam(learning_rate=3e-3), nn.value_and_grad(draft, loss)
    for _ in range(steps):
        optimizer.update(draft, step(draft)[1])
        mx.eval(draft.parameters(), optimizer.state)


@pytest.fixture(scope="module")
def eagle(tiny_hybrid: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A speculators head with a Qwen3 layer (q/k norms) and a 96-token draft vocabulary,
    fitted to the tiny target on ``PROMPTS``."""
    model, tokenizer = tiny_hybrid
    root = tmp_path_factory.mktemp("eagle3")
    folder = write_eagle3(root / "d", model, draft_vocab=96, model_type="qwen3", block_size=6)
    draft = load_drafter(folder, model)
    fit(draft, model, [tokenizer.encode(p) for p in PROMPTS])
    return draft


def test_rows_drafted_together_equal_each_alone(eagle: Any) -> None:
    """One pass per step for rows of different contexts and widths (their K/V read as one
    padded batch): each row's drafts and log q as its own passes give them; no cache changes."""
    params = SamplingParams(temperature=0.8)

    def rows() -> list[DraftRow]:
        return [row_of(eagle, i, n, 7 + i, width, TokenSampler(params, i))
                for i, (n, width) in enumerate([(5, 6), (17, 3), (1, 5), (9, 2)])]  # fmt: skip

    def state(row: DraftRow) -> list[Any]:  # each layer's live K/V, and the pending g
        return [(c.offset, c.snapshot()[:2] if c.offset else ()) for c in row.cache]

    together, apart = rows(), rows()
    before = [state(row) for row in together + apart]
    got = eagle.propose(together)
    want = [eagle.propose([row])[0] for row in apart]
    for (d1, q1), (d2, q2) in zip(got, want):
        assert d1.tolist() == d2.tolist() and mx.allclose(q1, q2, atol=1e-4).item()
    for old, row in zip(before, together + apart):
        for (n0, arrays0), (n1, arrays1) in zip(old, state(row)):
            assert n0 == n1 and all(mx.array_equal(a, b).item() for a, b in zip(arrays0, arrays1))


def test_greedy_equals_plain_lone_and_batched(tiny_hybrid: Any, eagle: Any) -> None:
    """Widths changing, rows joining and leaving, a sampled row beside them: each row as alone,
    the greedy ones as plain decoding."""
    model, tokenizer = tiny_hybrid
    ids = [tokenizer.encode(p) for p in PROMPTS]
    sampled = SamplingParams(temperature=1.0, top_p=0.9)
    makes = {
        "w6": (lambda: make_decoder(model, eagle, 6), ids[0], 36),
        "w3": (lambda: make_decoder(model, eagle, 3), ids[1], 30),
        "widths": (lambda: make_decoder(model, eagle, 6,
                                        policy=Scripted([2, 6, 1, 5, 3], 6)), ids[2], 33),
        "sampled": (lambda: make_decoder(model, eagle, 4, sampling=sampled, seed=5), ids[1], 25),
        "plain": (lambda: make_decoder(model, None, 1), ids[2], 20),
    }  # fmt: skip
    rows = {k: (make().row, p, n) for k, (make, p, n) in makes.items()}
    out = step_rows(new_batch(model), rows, start={"w3": 2, "widths": 1, "sampled": 3})
    for key, (make, prompt, n) in makes.items():
        lone = tokens_of(make().generate(prompt, n))
        assert tokens_of(out[key]) == lone, key
        if key != "sampled":
            assert lone == plain_greedy(model, prompt, n), key
    accepting = make_decoder(model, eagle, 6)
    list(accepting.generate(ids[3], 30))
    assert accepting.stats.tau > 1.5  # drafts were accepted: multi-token commits ran


@pytest.mark.slow
def test_sampled_output_follows_the_target_law(tiny_hybrid: Any, eagle: Any) -> None:
    """Joint law of 3 sampled tokens with EAGLE-3 drafts (q: the head's law over its draft
    vocabulary, zero elsewhere) against the exact law."""
    from test_sampling import exact_law, total_variation, tv_tolerance

    model, tokenizer = tiny_hybrid
    prompt = tokenizer.encode("The quick brown fox")
    params = SamplingParams(temperature=1.5, top_k=2)
    exact = exact_law(model, prompt, params)
    n, counts = 480, Counter()
    for seed in range(n):
        policy = FixedBlock(4) if seed % 2 else Scripted([1, 3, 2], 4)
        run = make_decoder(model, eagle, 4, sampling=params, seed=seed, policy=policy)
        counts[tuple(tokens_of(run.generate(prompt, 3)))] += 1
    assert total_variation(counts, exact, n) < tv_tolerance(len(exact), n, factor=2.0)


def test_prefix_cache_hit_equals_cold(tiny_hybrid: Any, eagle: Any) -> None:
    model, tokenizer = tiny_hybrid
    system = tokenizer.encode("def fibonacci(n): return n if n < 2 else")
    prompts = [system + tokenizer.encode(" fib(n - 1)"), system + tokenizer.encode(" x")]
    pair = ModelPair.of(model, tokenizer, eagle)
    cache = PrefixCache(1 << 30)

    def run(prompt: list[int], prefix: Any, cut: int = len(system)) -> tuple[list[int], Any]:
        request = GenerationRequest(tuple(prompt), 20, checkpoints=(cut,), block=BlockPolicy(5))
        out = list(generate(pair, request, prefill_step_size=8, prefix=prefix))
        return [t for r in out for t in r.tokens], out[-1].stats

    run(prompts[0], cache)  # leaves the shared prefix (and the head's state there) cached
    warm, stats = run(prompts[1], cache)
    assert stats.cached_tokens >= len(system)
    assert warm == run(prompts[1], None)[0] == plain_greedy(model, prompts[1], 20)
    # A one-token prompt leaves the head no K/V entry yet (its token waits for the next one):
    # its snapshot is an empty context.
    assert run(system[:1], cache, 1)[0] == plain_greedy(model, system[:1], 20)


@pytest.mark.parametrize("bits, layout", [(4, "speculators"), (6, "specforge")])
def test_quantized_exports_load_and_stay_exact(
    bits: int, layout: str, tiny_hybrid: Any, tmp_path: Path
) -> None:
    model, tokenizer = tiny_hybrid
    folder = tmp_path / f"q{bits}"
    write_eagle3(folder, model, layout=layout, draft_vocab=64, quantize_bits=bits)
    assert json.loads((folder / "config.json").read_text())["quantization"]["bits"] == bits
    draft = load_drafter(folder, model)
    assert draft.layers[0].self_attn.q_proj.bits == bits and hasattr(draft.lm_head, "scales")
    prompt = tokenizer.encode("def fibonacci(n):")
    got = tokens_of(make_decoder(model, draft, 5).generate(prompt, 24))
    assert got == plain_greedy(model, prompt, 24)


def test_a_head_that_does_not_fit_is_refused(tiny_hybrid: Any, tmp_path: Path) -> None:
    """A head for a wider target, taps past the target's depth, a tensor of the wrong shape and
    a reduced vocabulary without its d2t map: each refused naming the cause."""
    model, _ = tiny_hybrid
    wide, _ = mlx_lm.load(str(build_target(tmp_path / "wide", arch="qwen3", hidden_size=128)))
    with pytest.raises(
        ValueError,
        match=r"128-wide hidden states \(fc\.weight: 3 x 128\), the target.s are 64 wide",
    ):
        load_drafter(write_eagle3(tmp_path / "wide-head", wide), model)
    folder = write_eagle3(tmp_path / "d", model, draft_vocab=64)
    raw = json.loads((folder / "config.json").read_text())
    past = {**raw, "eagle_aux_hidden_state_layer_ids": [1, 2, 9]}  # tap 8 of a 4-layer target
    (folder / "config.json").write_text(json.dumps(past))
    with pytest.raises(ValueError, match=r"taps \[8\].*4 layers"):
        load_drafter(folder, model)
    (folder / "config.json").write_text(json.dumps(raw))
    weights = dict(mx.load(str(folder / "model.safetensors")))
    mx.save_safetensors(str(folder / "model.safetensors"),
                        {**weights, "fc.weight": weights["fc.weight"][:, :100]})  # fmt: skip
    with pytest.raises(ValueError, match=r"fc\.weight"):
        load_drafter(folder, model)
    del weights["d2t"]
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    with pytest.raises(ValueError, match="no d2t"):
        load_drafter(folder, model)
