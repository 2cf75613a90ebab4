"""The target's own MTP head as a drafter, and serving with no drafter: exact like DFlash."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.utils import save_model

from dflash_server.adaptive.policy import FixedBlock
from dflash_server.drafters.mtp import load_mtp
from dflash_server.engine.loader import load_models
from dflash_server.engine.prefix_cache import PrefixCache
from dflash_server.engine.summary import describe
from dflash_server.generation.pair import ModelPair
from dflash_server.generation.request import BlockPolicy, GenerationRequest
from dflash_server.generation.row import Row
from dflash_server.generation.sampling import SamplingParams, TokenSampler
from dflash_server.generation.speculative import SpeculativeDecoder
from dflash_server.generation.stream import generate
from dflash_server.generation.target import TargetModel
from dflash_server.models.loading import load_arrays
from dflash_server.testing import _CORPUS, build_target
from dflash_server.tools.target_fit import fit_lm
from dflash_server.tools.train import train
from server_fixtures import make_app, run_server
from test_adaptive import Scripted
from test_batching import new_batch, step_rows, tokens_of

TEXT = " ".join(_CORPUS.split()[:40]) + "\n"  # a sentence the fitted target continues


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A hybrid qwen3_5 target with a random head in its checkpoint, fitted to a repeated
    sentence, and a head trained for it with ``train --mtp`` (a split export): a head that
    drafts well, so long acceptances and rollbacks happen."""
    root = tmp_path_factory.mktemp("mtp")
    path = build_target(root / "target", arch="qwen3_5", mtp=True)
    model, tokenizer = mlx_lm.load(str(path))
    fit_lm(model, tokenizer.encode(TEXT * 20), steps=60, batch_size=8, seq_len=64, lr=1e-2)
    save_model(path, model)
    (root / "data.txt").write_text(TEXT * 20)
    argv = ["--target", str(path), "--data", str(root / "data.txt"), "--out", str(root / "head")]
    argv += ["--mtp", "--block-size", "4", "--steps", "100", "--batch-size", "4"]
    argv += ["--seq-len", "64", "--lr", "5e-3", "--eval-prompts", "2", "--eval-prompt-len", "16"]
    summary = train([*argv, "--eval-tokens", "32", "--quiet"], log=lambda _: None)
    assert summary["tau_before"] < 1.5 < 2.5 < summary["tau_after"], summary  # it learned
    return path, root / "head"


@pytest.fixture(scope="module")
def pair(fitted: tuple[Path, Path]) -> tuple[Any, Any, Any]:
    path, head = fitted
    model, tokenizer = mlx_lm.load(str(path))
    return model, tokenizer, load_mtp(head, model)


def plain(model: Any, prompt: list[int], n: int) -> list[int]:
    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def decoder(model: Any, head: Any, policy: Any, **kw: Any) -> SpeculativeDecoder:
    sampler = TokenSampler(kw.pop("sampling", SamplingParams()), kw.pop("seed", None))
    taps = head.config.target_layer_ids if head is not None else ()
    return SpeculativeDecoder(Row(TargetModel(model, taps), head, sampler, policy, **kw))


@pytest.mark.parametrize(
    "policy",
    [lambda: FixedBlock(2), lambda: FixedBlock(4), lambda: Scripted([1, 3, 2, 4, 1, 1, 4], 4)],
    ids=["width 2", "width 4", "widths changing"],
)
@pytest.mark.slow
def test_greedy_equals_plain_decoding(pair: tuple[Any, Any, Any], policy: Any) -> None:
    model, tokenizer, head = pair
    prompt = tokenizer.encode(TEXT[:60])
    lone = decoder(model, head, policy())
    assert tokens_of(lone.generate(prompt, 48)) == plain(model, prompt, 48)
    if type(lone.row.policy) is FixedBlock and lone.row.policy.block_size == 4:
        assert lone.stats.tau > 2.0  # long acceptances: every rollback path ran


@pytest.mark.slow
def test_batched_rows_equal_their_lone_runs(pair: tuple[Any, Any, Any]) -> None:
    """MTP rows of different widths (one sampled, seeded) beside a plain row, joining at
    different rounds: each row as alone."""
    model, tokenizer, head = pair
    ids = [tokenizer.encode(TEXT[:60]), tokenizer.encode(TEXT[30:90]), tokenizer.encode("x y")]
    sampled = SamplingParams(temperature=1.0, top_p=0.9)
    makes = {
        "w4": (lambda: decoder(model, head, FixedBlock(4)), ids[0], 40),
        "w2": (lambda: decoder(model, head, FixedBlock(2)), ids[1], 30),
        "widths": (lambda: decoder(model, head, Scripted([2, 4, 1, 3], 4)), ids[0], 35),
        "sampled": (lambda: decoder(model, head, FixedBlock(3), sampling=sampled, seed=5),
                    ids[1], 30),
        "plain": (lambda: decoder(model, None, FixedBlock(1)), ids[2], 25),
    }  # fmt: skip
    rows = {k: (make().row, p, n) for k, (make, p, n) in makes.items()}
    out = step_rows(new_batch(model), rows, start={"w2": 2, "plain": 1, "sampled": 3})
    for key, (make, prompt, n) in makes.items():
        assert tokens_of(out[key]) == tokens_of(make().generate(prompt, n)), key
    assert tokens_of(out["w4"]) == plain(model, ids[0], 40)


@pytest.mark.slow
def test_prefix_cache_hit_equals_cold(pair: tuple[Any, Any, Any]) -> None:
    model, tokenizer, head = pair
    system = tokenizer.encode(TEXT[:50])
    prompts = [system + tokenizer.encode(TEXT[50:70]), system + tokenizer.encode(TEXT[50:64])]
    mtp_pair = ModelPair.of(model, tokenizer, head)
    cache = PrefixCache(1 << 30)

    def run(prompt: list[int], prefix: Any) -> tuple[list[int], Any]:
        request = GenerationRequest(
            tuple(prompt), 24, checkpoints=(len(system),), block=BlockPolicy(4)
        )
        out = list(generate(mtp_pair, request, prefill_step_size=16, prefix=prefix))
        return [t for r in out for t in r.tokens], out[-1].stats

    run(prompts[0], cache)  # leaves the shared prefix (and the head's state there) cached
    warm, stats = run(prompts[1], cache)
    assert stats.cached_tokens >= len(system)
    assert warm == run(prompts[1], None)[0] == plain(model, prompts[1], 24)


@pytest.mark.slow
def test_sampled_output_follows_the_target_law(pair: tuple[Any, Any, Any]) -> None:
    """Joint law of 3 sampled tokens with MTP drafts (q = the head's distribution, one
    pass per draft) against the exact law."""
    from test_sampling import exact_law, total_variation, tv_tolerance

    model, tokenizer, head = pair
    prompt = tokenizer.encode(TEXT[:40])
    params = SamplingParams(temperature=1.5, top_k=2, repetition_penalty=1.2)
    exact = exact_law(model, prompt, params)
    n, counts = 480, Counter()
    for seed in range(n):
        policy = FixedBlock(3) if seed % 2 else Scripted([1, 2, 3], 3)
        run = decoder(model, head, policy, sampling=params, seed=seed)
        counts[tuple(tokens_of(run.generate(prompt, 3)))] += 1
    assert total_variation(counts, exact, n) < tv_tolerance(len(exact), n, factor=2.0)


def test_rows_drafted_together_equal_each_alone(tmp_path: Path) -> None:
    """One head pass per step for rows of different contexts and widths (their K/V read as one
    padded batch): each row's drafts and log q as its own passes give them, caches unchanged."""
    from dflash_server.drafters.protocol import DraftRow

    path = build_target(tmp_path / "t", arch="qwen3_5", mtp=True)
    model, _ = mlx_lm.load(str(path))
    head = load_mtp(path, model)
    params = SamplingParams(temperature=0.8)

    def rows() -> list[DraftRow]:
        out = []
        for i, (context, width) in enumerate([(5, 6), (17, 3), (1, 5), (9, 2)]):
            cache = head.make_cache()
            taps = mx.random.normal((1, context, 64), key=mx.random.key(i))
            tokens = mx.random.randint(0, 200, (context,), key=mx.random.key(10 + i))
            head.append_context(taps, cache, tokens)
            block = mx.array([[7 + i] + [0] * (width - 1)])
            out.append(DraftRow(block, cache, TokenSampler(params, i)))
        return out

    together, apart = rows(), rows()
    got = head.propose(together)
    want = [head.propose([row])[0] for row in apart]
    for (d1, q1), (d2, q2), a, b in zip(got, want, together, apart):
        assert d1.tolist() == d2.tolist() and mx.allclose(q1, q2, atol=1e-4).item()
        assert [c.offset for c in a.cache] == [c.offset for c in b.cache]


def test_quantized_export_is_exact(tmp_path: Path) -> None:
    """A 6-bit target whose checkpoint carries a 6-bit head: ``--draft mtp`` loads it packed."""
    path = build_target(tmp_path / "q6", arch="qwen3_5", quantize_bits=6, mtp=True)
    assert any(k.endswith(".scales") for k in load_arrays(path / "model-mtp.safetensors"))
    model, tokenizer = mlx_lm.load(str(path))
    head = load_mtp(path, model)
    prompt = tokenizer.encode("def fibonacci(n):")
    assert tokens_of(decoder(model, head, FixedBlock(4)).generate(prompt, 24)) == plain(
        model, prompt, 24
    )


def test_a_head_that_does_not_fit_is_refused(tmp_path: Path, tiny_hybrid: Any) -> None:
    model, _ = tiny_hybrid
    other = build_target(tmp_path / "wide", arch="qwen3_5", hidden_size=128, mtp=True)
    with pytest.raises(ValueError, match="does not fit"):
        load_mtp(other, model)  # a head for another target's sizes
    broken = build_target(tmp_path / "broken", arch="qwen3_5", mtp=True)
    shard = broken / "model-mtp.safetensors"
    arrays = load_arrays(shard)
    arrays["mtp.fc.weight"] = arrays["mtp.fc.weight"][:, :10]
    mx.save_safetensors(str(shard), arrays)
    model, _ = mlx_lm.load(str(broken))
    with pytest.raises(ValueError, match=r"fc\.weight"):
        load_mtp(broken, model)
    with pytest.raises(ValueError, match="no MTP head"):
        load_mtp(build_target(tmp_path / "plain", arch="qwen3_5"), model)


@pytest.mark.slow
def test_serving_with_mtp_and_with_no_drafter(fitted: tuple[Path, Path]) -> None:
    """``--draft mtp`` (the head in the target's checkpoint: random here, still exact) and
    ``--target`` alone (suffix drafts and plain decoding) both serve; the log says which."""
    path, _ = fitted
    summary = load_models(str(path), None, suffix_tokens=48).summary
    assert summary.draft is None and summary.mtp_available
    log = describe(summary)
    assert "no drafter: suffix drafts and plain decoding" in log and "--draft mtp" in log
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    body |= {"temperature": 0}
    answers = []
    for draft in ("mtp", None):
        app = make_app(path, draft, served_model_name="m", enable_thinking=False)
        with run_server(app) as srv:
            health = httpx.get(f"{srv.base_url}/health").json()
            assert health["draft_family"] == ("MTP" if draft else None)
            reply = httpx.post(f"{srv.base_url}/v1/chat/completions", json=body, timeout=60).json()
            plain_reply = httpx.post(
                f"{srv.base_url}/v1/chat/completions",
                json=body | {"speculative": False},
                timeout=60,
            ).json()
        assert reply["choices"][0]["message"] == plain_reply["choices"][0]["message"]
        answers.append(reply["choices"][0]["message"]["content"])
    assert answers[0] == answers[1]


@pytest.mark.slow
def test_split_export_loads_as_a_drafter_folder(fitted: tuple[Path, Path]) -> None:
    path, head = fitted
    config = json.loads((head / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_mtp"
    models = load_models(str(path), str(head))
    assert models.summary.draft_family == "MTP" and models.summary.block_size == 4


def test_convert_splits_the_head_out(tmp_path: Path) -> None:
    """``dflash-serve convert TARGET --mtp --q-bits 6``: the head of a checkpoint as its own
    6-bit folder, which ``--draft FOLDER`` loads beside the target, exactly."""
    from dflash_server.tools.convert import main as convert

    path = build_target(tmp_path / "t", arch="qwen3_5", mtp=True)
    out = tmp_path / "head-6bit"
    assert convert([str(path), "--mtp", "--q-bits", "6", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 6
    models = load_models(str(path), str(out), measure=False)
    model, tokenizer = models.pair.model, models.pair.tokenizer
    prompt = tokenizer.encode("def fibonacci(n):")
    got = decoder(model, models.pair.draft, FixedBlock(4)).generate(prompt, 24)
    assert tokens_of(got) == plain(model, prompt, 24)


def test_a_head_trained_for_an_attention_target_loads(tmp_path: Path) -> None:
    """``train --mtp --init new`` on a plain attention (qwen3) target: its split export loads
    with the tensors it saved, and drafts exactly."""
    path = build_target(tmp_path / "t", arch="qwen3")
    (tmp_path / "data.txt").write_text(TEXT * 8)
    out = tmp_path / "head"
    argv = ["--target", str(path), "--data", str(tmp_path / "data.txt"), "--out", str(out)]
    argv += ["--mtp", "--steps", "2", "--batch-size", "2", "--seq-len", "32", "--eval-prompts"]
    train([*argv, "0", "--quiet"], log=lambda _: None)
    model, tokenizer = mlx_lm.load(str(path))
    head = load_mtp(out, model)
    saved = load_arrays(out / "model.safetensors")
    loaded = dict(tree_flatten(head.parameters()))
    assert set(saved) == {f"mtp.{k}" for k in loaded}
    assert all(mx.array_equal(saved[f"mtp.{k}"], v).item() for k, v in loaded.items())
    prompt = tokenizer.encode(TEXT[:60])
    got = decoder(model, head, FixedBlock(4)).generate(prompt, 24)
    assert tokens_of(got) == plain(model, prompt, 24)
