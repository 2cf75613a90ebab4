"""``dflash-serve train --family dspark|eagle3``: each training forward equals the drafter's own
drafting on the same weights, a run saves the published layout that ``load_drafter`` loads and
that decodes exactly, fine-tuning a published folder keeps its frozen copies, resume continues
exactly, training raises tau on a learnable corpus (slow), and flags that do not fit the family
are refused naming the fix."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.utils import save_model

from dflash_server.drafters.dspark import DSparkConfig, DSparkDraftModel
from dflash_server.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from dflash_server.drafters.protocol import DraftRow
from dflash_server.drafters.registry import load_drafter
from dflash_server.generation.target import TargetModel
from dflash_server.testing import _CORPUS, build_target
from dflash_server.testing.layouts import write_dspark, write_eagle3
from dflash_server.tools.target_fit import fit_lm
from dflash_server.tools.train import main, train
from dflash_server.tools.train_args import build_parser
from dflash_server.tools.train_data import target_forward
from dflash_server.tools.train_dspark import dspark_outputs
from dflash_server.tools.train_eagle3 import init_eagle3, ttt_logits
from dflash_server.tools.train_families import resolve_family
from test_batching import make_decoder, plain_greedy, tokens_of

TEXT = " ".join(_CORPUS.split()[:40]) + "\n"  # ~135 tokens, repeated: a learnable cycle
FAST = ["--layers", "1", "--batch-size", "2", "--seq-len", "48", "--anchors", "8", "--quiet"]


class Forced:
    """A greedy-looking sampler that proposes the given tokens and records the logits it was
    shown: drafting fed the labels, as the training forward is teacher-forced on them."""

    deterministic = True

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.seen, self.processors = tokens, [], []

    def propose(self, logits: mx.array, history: Any) -> tuple[mx.array, None]:
        self.seen.append(logits[0])
        return mx.array([self.tokens[len(self.seen) - 1]], dtype=mx.int32), None


def _inputs(model: Any, taps: tuple[int, ...], T: int, seed: int) -> tuple[mx.array, ...]:
    mx.random.seed(seed)
    tokens, labels = mx.random.randint(0, 300, (2, T)), mx.random.randint(0, 300, (2, T))
    return tokens, labels, target_forward(TargetModel(model, taps), tokens, labels=False)[0]


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_dspark_training_forward_equals_drafting(kind: str, tiny_hybrid: Any, tmp_path: Path):
    """Each anchor's rows (Markov bias on the previous label included) are the logits drafting
    shows its sampler when fed those labels; the confidence head's, its ``_confidence``."""
    model, _ = tiny_hybrid
    draft = load_drafter(write_dspark(tmp_path / kind, model, markov=kind, block_size=5), model)
    assert isinstance(draft, DSparkDraftModel)
    tokens, labels, taps = _inputs(model, draft.config.target_layer_ids, 24, 1)
    anchors = mx.array([[1, 7, 18, 9], [2, 2, 13, 18]])  # repeats and the last valid anchor
    logits, confidence = dspark_outputs(draft, tokens, labels, taps, anchors)
    assert confidence is not None
    P, mask = draft.config.block_size - 1, draft.config.mask_token_id
    for n in range(2):
        for k in range(anchors.shape[1]):
            a = anchors[n, k].item()
            cache = draft.make_cache()
            draft.append_context(taps[n : n + 1, :a], cache, tokens[n, :a])
            block = mx.array([[tokens[n, a].item()] + [mask] * P])
            forced = Forced(labels[n, a + 1 : a + 1 + P].tolist())
            draft.propose([DraftRow(block, cache, forced)])
            assert mx.allclose(mx.stack(forced.seen), logits[n, k], atol=1e-4).item(), (n, a)
            h = draft.hidden_states(block[:, :P], None, cache)[0]
            previous = mx.array([tokens[n, a].item(), *labels[n, a + 1 : a + P].tolist()])
            want = draft._confidence(h, previous)
            assert mx.allclose(want, mx.sigmoid(confidence[n, k]), atol=1e-5).item()


def _fresh_eagle3(model: Any, layers: int) -> Eagle3Drafter:
    args = argparse.Namespace(init="new", taps=None, draft_vocab=None, layers=layers,
                              block_size=4, target="t")  # fmt: skip
    return init_eagle3(args, model, None, np.zeros((1, 8), np.int32))[0]


@pytest.mark.parametrize("variant", ["speculators", "draft-vocab", "specforge", "two-layers"])
def test_eagle3_ttt_equals_drafting(variant: str, tiny_hybrid: Any, tmp_path: Path) -> None:
    """Step j of row i is the j-th draft's logits after committed positions 0..i+1, drafting
    fed the labels as its earlier drafts: its own outputs, keys of earlier steps and RoPE
    positions included (a reduced vocabulary: at the drafted ids; two layers: the second
    reads the first's context)."""
    model, _ = tiny_hybrid
    if variant == "two-layers":
        head = _fresh_eagle3(model, 2)
    else:
        layout = "specforge" if variant == "specforge" else "speculators"
        vocab = 100 if variant == "draft-vocab" else None
        folder = write_eagle3(tmp_path / variant, model, layout=layout, draft_vocab=vocab)
        head = load_drafter(folder, model)
    assert isinstance(head, Eagle3Drafter)
    steps, T = 3, 20
    tokens, labels, taps = _inputs(model, head.config.target_layer_ids, T, 2)
    logits = ttt_logits(head, tokens, labels, taps, steps)
    for n in range(2):
        for i in (0, 6, T - 2 - steps, T - 3):  # the last row with every step, one without
            cache = head.make_cache()
            head.append_context(taps[n : n + 1, : i + 1], cache, tokens[n, : i + 1])
            block = mx.array([[tokens[n, i + 1].item()] + [0] * steps])
            forced = Forced([labels[n, min(i + 2 + j, T - 1)].item() for j in range(steps)])
            head.propose([DraftRow(block, cache, forced)])
            for j in range(min(steps, T - 2 - i)):
                want = (
                    forced.seen[j] if head.target_ids is None else forced.seen[j][head.target_ids]
                )
                assert mx.allclose(logits[j][n, i], want, atol=1e-4).item(), (n, i, j)


def _run(target: Path, data: Path, out: Path, family: str, *extra: str) -> dict[str, Any]:
    argv = ["--target", str(target), "--data", str(data), "--out", str(out), "--family", family]
    return train([*argv, *FAST, "--eval-prompts", "0", *extra], log=lambda _: None)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(TEXT * 12)
    return path


@pytest.mark.parametrize("family", ["dspark", "eagle3"])
def test_a_run_saves_what_load_drafter_serves(
    family: str, tiny_attn_path: Path, corpus: Path, tmp_path: Path
) -> None:
    """The saved folder is the family's published layout (DeepSpec's / speculators' config,
    the target's embedding copied in), loads as that family with the trained weights, and
    decodes greedy token-identical to plain decoding."""
    out = tmp_path / family
    # EAGLE-3 from the data's tokens (one-hot in its draft vocabulary), DSpark from the target's.
    extra = ["--draft-vocab", "200", "--labels", "data"] if family == "eagle3" else []
    extra += ["--markov-kind", "rnn"] if family == "dspark" else []
    summary = _run(tiny_attn_path, corpus, out, family, "--steps", "3", "--block-size", "4",
                   *extra)  # fmt: skip
    assert np.isfinite(summary["final_loss"]), summary
    raw = json.loads((out / "config.json").read_text())
    weights = mx.load(str(out / "model.safetensors"))
    model, tokenizer = mlx_lm.load(str(tiny_attn_path))
    draft: Any = load_drafter(out, model)
    if family == "dspark":
        assert raw["architectures"] == ["Qwen3DSparkModel"] and raw["block_size"] == 3
        assert raw["markov_head_type"] == "rnn" and raw["enable_confidence_head"]
        assert isinstance(draft, DSparkDraftModel) and draft.config.block_size == 4
        assert draft.config.own_embedding and draft.config.own_head
        assert DSparkConfig.from_dict(raw, list(weights)) == draft.config
    else:
        assert raw["speculators_model_type"] == "eagle3" and raw["draft_vocab_size"] == 200
        spec = raw["speculators_config"]["proposal_methods"][0]
        assert spec["speculative_tokens"] == 3 and raw["eagle_aux_hidden_state_layer_ids"]
        assert isinstance(draft, Eagle3Drafter) and draft.config.block_size == 4
        assert weights["t2d"].sum().item() == 200 and weights["d2t"].shape == (200,)
        assert Eagle3Config.from_dict(raw, list(weights)).draft_vocab_size == 200
    assert mx.array_equal(weights["embed_tokens.weight"], model.model.embed_tokens.weight).item()
    state = mx.load(str(out / "training" / "state.safetensors"))
    assert mx.array_equal(weights["fc.weight"], state["param.fc.weight"]).item()  # trained
    prompt = tokenizer.encode(TEXT[:50])
    got = tokens_of(make_decoder(model, draft, 4).generate(prompt, 20))
    assert got == plain_greedy(model, prompt, 20)


@pytest.mark.parametrize("family", ["dspark", "eagle3"])
def test_fine_tuning_a_published_folder(
    family: str, tiny_attn: Any, corpus: Path, tiny_attn_path: Path, tmp_path: Path
) -> None:
    """``--init`` a DeepSpec / speculators folder (a reduced vocabulary with d2t): its copies of
    the target's embedding (and head) stay frozen, its other weights train, and the result
    keeps its shape; fresh-drafter flags are refused beside it."""
    model, _ = tiny_attn
    if family == "dspark":
        init = write_dspark(tmp_path / "init", model, block_size=3, markov="gated")
    else:
        init = write_eagle3(tmp_path / "init", model, draft_vocab=150, block_size=3)
    out = tmp_path / "out"
    _run(tiny_attn_path, corpus, out, family, "--init", str(init), "--steps", "2")
    before, after = (
        mx.load(str(init / "model.safetensors")),
        mx.load(str(out / "model.safetensors")),
    )
    assert set(after) == set(before)  # same layout
    frozen = ["lm_head.weight"] if family == "dspark" else ["d2t", "t2d"]  # speculators': trains
    for name in ["embed_tokens.weight", *frozen]:
        assert mx.array_equal(before[name], after[name]).item(), name
    assert not mx.array_equal(before["fc.weight"], after["fc.weight"]).item()
    flag = ["--markov-rank", "8"] if family == "dspark" else ["--draft-vocab", "20"]
    err = tmp_path / "x"
    with pytest.raises(ValueError, match="shape a fresh drafter"):
        _run(tiny_attn_path, corpus, err, family, "--init", str(init), *flag)


@pytest.mark.parametrize("family", ["dspark", "eagle3"])
def test_resume_continues_exactly(
    family: str, tiny_attn_path: Path, corpus: Path, tmp_path: Path
) -> None:
    """4 steps straight = 2 steps, then 2 more with --resume (same weights and AdamW state);
    the target's final states also come from a hidden-state cache."""
    extra = ["--block-size", "3", "--lr", "1e-2"]
    _run(tiny_attn_path, corpus, tmp_path / "straight", family, "--steps", "4", *extra)
    _run(tiny_attn_path, corpus, tmp_path / "split", family, "--steps", "2", *extra)
    _run(tiny_attn_path, corpus, tmp_path / "split", family, "--steps", "4", "--resume", *extra)
    a = mx.load(str(tmp_path / "straight" / "training" / "state.safetensors"))
    b = mx.load(str(tmp_path / "split" / "training" / "state.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        assert np.allclose(np.array(a[k]), np.array(b[k]), atol=1e-6), k
    cache = tmp_path / "cache"
    summary = _run(tiny_attn_path, corpus, tmp_path / "c", family, "--steps", "2", *extra,
                   "--hidden-states", "cache", "--cache-dir", str(cache))  # fmt: skip
    assert np.isfinite(summary["final_loss"])
    assert "final" in mx.load(str(next(cache.glob("shard-*.safetensors"))))
    other = "eagle3" if family == "dspark" else "dspark"
    with pytest.raises(ValueError, match=f"holds a --family {family} run"):
        _run(tiny_attn_path, corpus, tmp_path / "split", other, "--steps", "5", "--resume")


def test_max_seconds_ends_a_run_on_time(tiny_attn_path: Path, corpus: Path, tmp_path: Path):
    """A time budget stops training before --steps; the run still evaluates and saves."""
    out = tmp_path / "timed"
    summary = _run(tiny_attn_path, corpus, out, "dspark", "--steps", "100000",
                   "--max-seconds", "0.3", "--block-size", "3")  # fmt: skip
    assert 1 <= summary["steps"] < 1000 and (out / "config.json").exists(), summary
    history = json.loads((out / "training" / "trainer_state.json").read_text())["history"]
    assert history["train"][-1]["step"] == summary["steps"]


def _resolve(*argv: str) -> argparse.Namespace:
    args = build_parser().parse_args(["--target", "t", "--data", "d", "--out", "o", *argv])
    resolve_family(args)
    return args


def test_flags_resolve_per_family() -> None:
    """--mtp is --family mtp; each family gets its published defaults (DSpark: DeepSpec's block
    7 = verify 8; EAGLE-3: one layer, 7 TTT steps), which its own flags override."""
    from dflash_server.drafters.dspark import MARKOV_KINDS
    from dflash_server.tools import train_args, train_families

    assert set(train_args.FAMILIES) == set(train_families.FAMILIES)  # the parser's own copies
    assert train_args.MARKOV_KINDS == MARKOV_KINDS
    assert _resolve("--mtp").family == "mtp" and _resolve("--family", "mtp").mtp
    assert (_resolve().family, _resolve().block_size, _resolve().layers) == ("dflash", 16, 5)
    assert (_resolve("--family", "dspark").block_size, _resolve("--family", "dspark").layers) == (
        8, 5,
    )  # fmt: skip
    eagle = _resolve("--family", "eagle3")
    assert (eagle.block_size, eagle.layers) == (8, 1)
    assert _resolve("--family", "eagle3", "--ttt-steps", "3").block_size == 4
    assert _resolve("--family", "eagle3", "--block-size", "5").block_size == 5


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--mtp", "--family", "dspark"], "--mtp is --family mtp"),
        (["--markov-rank", "8"], "--markov-rank is a --family dspark flag, not dflash's"),
        (["--family", "dspark", "--ttt-steps", "3"], "--ttt-steps is a --family eagle3 flag"),
        (["--family", "eagle3", "--no-confidence-head"], "--no-confidence-head is a --family"),
        (["--family", "eagle3", "--block-size", "5", "--ttt-steps", "3"], "--ttt-steps + 1"),
        (["--family", "eagle3", "--ttt-steps", "0"], "--ttt-steps 0: must be >= 1"),
        (["--family", "dspark", "--markov-rank", "0", "--markov-kind", "rnn"], "no Markov head"),
        (["--family", "dspark", "--markov-rank", "-1"], "must be >= 0"),
        (["--family", "dspark", "--ce-weight", "0", "--tv-weight", "0"], "not both 0"),
        (["--family", "dspark", "--block-size", "1"], "DSpark needs >= 2"),
        (["--family", "dspark", "--init", "cfg.json"], "a JSON config sets up a DFlash drafter"),
        (["--family", "eagle3", "--init", "f", "--draft-vocab", "9"], "shape a fresh drafter"),
    ],
)
def test_flags_that_do_not_fit_the_family_are_refused(argv: list[str], needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("+", r"\+")):
        _resolve(*argv)


def test_a_folder_of_another_family_names_the_flag(
    tiny_attn: Any, tiny_attn_path: Path, corpus: Path, tmp_path: Path, capsys: Any
) -> None:
    """--init of a DSpark folder with --family dflash (or eagle3) says which --family trains
    it; a --draft-vocab the target cannot hold is refused; both as one line from the CLI."""
    model, _ = tiny_attn
    dspark = write_dspark(tmp_path / "d", model)
    base = ["--target", str(tiny_attn_path), "--data", str(corpus), *FAST, "--steps", "1"]
    for family in ("dflash", "eagle3"):
        assert main([*base, "--out", str(tmp_path / family), "--family", family,
                     "--init", str(dspark)]) == 2  # fmt: skip
        assert "holds a DSpark drafter" in (err := capsys.readouterr().err)
        assert "train it with --family dspark" in err and err.count("\n") == 1
    out = str(tmp_path / "v")
    assert main([*base, "--out", out, "--family", "eagle3", "--draft-vocab", "100000"]) == 2
    assert "--draft-vocab 100000: between 1 and the target's" in capsys.readouterr().err


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny qwen3 fitted to a repeated sentence (~12 s): its greedy output continues it."""
    root = tmp_path_factory.mktemp("fitted")
    path = build_target(root / "target", arch="qwen3", hidden_size=64, num_hidden_layers=2)
    model, tokenizer = mlx_lm.load(str(path))
    fit_lm(model, tokenizer.encode(TEXT * 20), steps=60, batch_size=8, seq_len=64, lr=1e-2)
    save_model(path, model)
    (root / "corpus.txt").write_text(TEXT * 20)
    return path, root / "corpus.txt"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["dspark", "eagle3"])
def test_training_raises_tau(family: str, fitted: tuple[Path, Path], tmp_path: Path) -> None:
    """60 steps on the fitted target's own text: held-out tau (the real speculative loop) goes
    from about one token per cycle to most of each 4-wide block."""
    target, data = fitted
    argv = ["--target", str(target), "--data", str(data), "--out", str(tmp_path / family)]
    argv += ["--family", family, "--layers", "1", "--block-size", "4", "--batch-size", "4"]
    argv += ["--seq-len", "64", "--anchors", "16", "--steps", "60", "--lr", "5e-3", "--quiet"]
    argv += ["--eval-prompts", "2", "--eval-prompt-len", "16", "--eval-tokens", "32"]
    summary = train(argv, log=lambda _: None)
    assert summary["tau_before"] < 2.0 and summary["tau_after"] > 2.8, summary
