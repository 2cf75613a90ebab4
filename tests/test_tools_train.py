"""``dflash-serve train``: the batched objective equals inference, training raises tau, resume, errors."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.utils import save_model

from dflash_server import DFlashConfig, DFlashDraftModel, load_draft, stream_generate
from dflash_server.cli import main as cli_main
from dflash_server.generation.target import TargetModel
from dflash_server.testing import _CORPUS, build_target, random_drafter
from dflash_server.tools.target_fit import fit_lm
from dflash_server.tools.train import main, train
from dflash_server.tools.train_data import target_forward
from dflash_server.tools.train_forward import draft_logits

FAST = ["--layers", "1", "--block-size", "4", "--batch-size", "4", "--seq-len", "64", "--quiet"]


TEXT = " ".join(_CORPUS.split()[:40]) + "\n"  # ~135 tokens, repeated: a learnable cycle


@pytest.fixture(scope="module")
def trained_target(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny qwen3 fitted to a repeated sentence (~4 s): its greedy output continues the text."""
    root = tmp_path_factory.mktemp("trained")
    path = build_target(root / "target", arch="qwen3", hidden_size=64, num_hidden_layers=2)
    model, tokenizer = mlx_lm.load(str(path))
    loss = fit_lm(model, tokenizer.encode(TEXT * 20), steps=60, batch_size=8, seq_len=64, lr=1e-2)
    assert loss < 0.5, loss
    save_model(path, model)
    data = root / "data"
    data.mkdir()
    (data / "corpus.txt").write_text(TEXT * 20)
    (data / "blob.bin").write_bytes(b"\x00\xff" * 64)  # skipped: not text
    return path, data


@pytest.mark.parametrize("window", [None, 5])
def test_batched_training_forward_equals_inference(tiny_hybrid, window):
    model, _ = tiny_hybrid
    draft = random_drafter(model, block_size=6, num_layers=2)
    if window is not None:  # one sliding-window layer: the mask must apply the window too
        cfg = {**draft.config.__dict__, "sliding_window": window}
        cfg["layer_types"] = ("sliding_attention", "full_attention")
        sliding = DFlashDraftModel(DFlashConfig(**cfg))
        sliding.load_weights(_flat(draft))
        draft = sliding.bind(model)
    target = TargetModel(model, draft.config.target_layer_ids)
    mx.random.seed(1)
    tokens = mx.random.randint(0, 350, (2, 24))
    taps = target_forward(target, tokens, labels=False)[0]
    anchors = mx.array([[1, 7, 18, 9], [2, 2, 13, 18]])  # repeats and the last valid anchor
    batched = draft_logits(draft, tokens, taps, anchors)
    B, mask = draft.config.block_size, draft.config.mask_token_id
    for n in range(2):
        for k in range(anchors.shape[1]):
            a = anchors[n, k].item()
            block = mx.array([[tokens[n, a].item()] + [mask] * (B - 1)])
            ref = draft(block, taps[n : n + 1, :a], draft.make_cache(), logits_start=1)[0]
            assert mx.allclose(batched[n, k], ref, atol=1e-4, rtol=1e-4), (n, a)


def _flat(module) -> list:
    from mlx.utils import tree_flatten

    return tree_flatten(module.parameters())


def test_target_labels_are_greedy_predictions(tiny_attn):
    model, _ = tiny_attn
    tokens = mx.array([[5, 40, 77, 3, 9, 120, 61, 8]])
    taps, labels = target_forward(TargetModel(model, (1,)), tokens, labels=True)
    greedy = mx.argmax(model(tokens), axis=-1)
    assert labels[0, 0].item() == 5 and labels[0, 1:].tolist() == greedy[0, :-1].tolist()
    assert taps.shape == (1, 8, 64)


@pytest.mark.slow
def test_training_raises_tau_and_checkpoint_is_lossless(trained_target, tmp_path):
    target, data = trained_target
    out = tmp_path / "draft"
    argv = ["--target", str(target), "--data", str(data), "--out", str(out), *FAST]
    argv += ["--steps", "100", "--anchors", "48", "--lr", "5e-3", "--eval-prompts", "2"]
    argv += ["--eval-prompt-len", "16", "--eval-tokens", "32"]
    summary = train(argv, log=lambda _: None)
    # Untrained: ~1 token per cycle; trained: most of each 4-token block (3.3-3.4 seen).
    assert summary["tau_before"] < 1.5 and summary["tau_after"] > 2.3, summary
    config = json.loads((out / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == [1]  # 2-layer target
    assert not any("embed" in k or "lm_head" in k for k in mx.load(str(out / "model.safetensors")))
    model, tokenizer = mlx_lm.load(str(target))
    draft = load_draft(out, target=model)
    prompt = TEXT[:40]
    got = [
        t for r in stream_generate(model, draft, tokenizer, prompt, max_tokens=24) for t in r.tokens
    ]
    plain = [
        t for r in stream_generate(model, None, tokenizer, prompt, max_tokens=24) for t in r.tokens
    ]
    assert got == plain


def test_resume_continues_exactly_and_cache_mode(trained_target, tmp_path):
    target, data = trained_target
    common = ["--target", str(target), "--data", str(data), *FAST, "--anchors", "8"]
    common += ["--eval-prompts", "0", "--lr", "1e-2"]
    train([*common, "--out", str(tmp_path / "straight"), "--steps", "4"], log=lambda _: None)
    train([*common, "--out", str(tmp_path / "split"), "--steps", "2"], log=lambda _: None)
    logs: list[str] = []
    train([*common, "--out", str(tmp_path / "split"), "--steps", "4", "--resume"], log=logs.append)
    assert "resumed at step 2" in logs
    a = mx.load(str(tmp_path / "straight" / "training" / "state.safetensors"))
    b = mx.load(str(tmp_path / "split" / "training" / "state.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        assert np.allclose(np.array(a[k]), np.array(b[k]), atol=1e-6), k

    cache = tmp_path / "cache"
    argv = [*common, "--out", str(tmp_path / "c"), "--steps", "2", "--hidden-states", "cache"]
    logs.clear()
    summary = train([*argv, "--cache-dir", str(cache)], log=logs.append)
    assert "hidden-state cache built" in logs and np.isfinite(summary["final_loss"])
    assert (cache / "meta.json").exists() and list(cache.glob("shard-*.safetensors"))
    logs.clear()
    train([*argv, "--cache-dir", str(cache), "--steps", "3", "--resume"], log=logs.append)
    assert "hidden-state cache built" not in logs  # same windows and target: reused


def test_bad_inputs_give_clear_errors(trained_target, tiny_hybrid, tmp_path, capsys):
    target, data = trained_target
    base = ["--target", str(target), "--out", str(tmp_path / "o"), *FAST, "--steps", "1"]

    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli_main(["train", *base, "--data", str(empty)]) == 2
    assert "not enough training text" in capsys.readouterr().err

    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "fine"}\n{"oops": 1}\n')
    assert main([*base, "--data", str(bad_json)]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err

    # A drafter made for another target (4 layers, taps up to 3) does not fit the 2-layer one.
    other = random_drafter(tiny_hybrid[0], block_size=4)
    folder = tmp_path / "other"
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), dict(_flat(other)))
    (folder / "config.json").write_text(json.dumps(other.config.to_dict()))
    assert main([*base, "--data", str(data), "--init", str(folder)]) == 2
    assert "does not fit this target" in capsys.readouterr().err

    bad_cfg = tmp_path / "cfg.json"
    bad_cfg.write_text(json.dumps({"block_size": 1}))
    assert main([*base, "--data", str(data), "--init", str(bad_cfg)]) == 2
    assert "bad drafter config" in capsys.readouterr().err

    assert main([*base, "--data", str(data), "--seq-len", "4"]) == 2
    assert "--seq-len 4" in capsys.readouterr().err
    assert main([*base, "--data", str(data), "--resume"]) == 2
    assert "no training/trainer_state.json" in capsys.readouterr().err


def test_out_with_files_and_model_errors(trained_target, tmp_path, capsys):
    """An --out that holds files needs --force (or --resume); a target that is not there is one
    line, as dflash-serve words it. Both before anything loads."""
    target, data = trained_target
    out = tmp_path / "o"
    out.mkdir()
    (out / "notes.txt").write_text("an earlier run's folder")
    base = ["--data", str(data), "--out", str(out), *FAST, "--steps", "1"]
    assert main(["--target", str(target), *base]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pass --force" in err and "--resume" in err
    for missing, needle in ((tmp_path / "missing", "no such folder"), ("nobody-xyz/t", "hub is")):
        assert main(["--target", str(missing), *base, "--force"]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1 and "Traceback" not in err
