"""``dflash-serve convert``: quantized/cast drafters load, stay lossless in the loop, report errors."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from dflash_server import load_draft, stream_generate
from dflash_server.cli import main as cli_main
from dflash_server.testing import random_drafter
from dflash_server.tools.convert import convert, main


@pytest.fixture(scope="module")
def drafter_dir(tiny_hybrid, tmp_path_factory) -> Path:
    model, _ = tiny_hybrid
    draft = random_drafter(model, block_size=8)
    path = tmp_path_factory.mktemp("drafters") / "fp32"
    path.mkdir()
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(draft.parameters())))
    (path / "config.json").write_text(json.dumps({**draft.config.to_dict(), "extra_key": 1}))
    return path


def greedy(model, draft, tokenizer, prompt: str, n: int = 24) -> list[int]:
    return [
        t for r in stream_generate(model, draft, tokenizer, prompt, max_tokens=n) for t in r.tokens
    ]


def test_quantize_round_trip_is_lossless(tiny_hybrid, tiny_hybrid_path, drafter_dir, tmp_path):
    model, tokenizer = tiny_hybrid
    out = tmp_path / "q4"
    report = convert(drafter_dir, out, q_bits=4, q_group_size=64, target=tiny_hybrid_path)
    assert report["bytes_after"] < 0.35 * report["bytes_before"]
    assert 4 < report["bits_per_weight"] < 6
    err = report["logit_error"]
    assert err["top1_agreement"] >= 0.9 and err["mean_kl"] < 0.05, err

    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert config["quantization_config"] == config["quantization"]  # mlx-lm writes both
    assert config["extra_key"] == 1  # keys the tool does not know survive the conversion
    assert "Converted from" in (out / "README.md").read_text()
    # mlx-lm's packed layout: uint32 weight + scales + biases, embedding/lm_head still absent.
    weights = mx.load(str(out / "model.safetensors"))
    assert weights["fc.weight"].dtype == mx.uint32 and "fc.scales" in weights
    assert not any("embed" in k or "lm_head" in k for k in weights)

    draft = load_draft(out, target=model)
    assert isinstance(draft.layers[0].mlp.down_proj, nn.QuantizedLinear)
    for prompt in ("def fibonacci(n):", "The quick brown fox"):
        assert greedy(model, draft, tokenizer, prompt) == greedy(model, None, tokenizer, prompt)


def test_cast_and_requantize(tiny_hybrid, drafter_dir, tmp_path):
    model, _ = tiny_hybrid
    bf16 = tmp_path / "bf16"
    report = convert(drafter_dir, bf16, dtype="bfloat16")
    assert report["bytes_after"] < 0.55 * report["bytes_before"]
    assert load_draft(bf16).fc.weight.dtype == mx.bfloat16
    assert json.loads((bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    # A quantized source is dequantized first, then re-quantized with the new settings.
    q4, q8 = tmp_path / "q4", tmp_path / "q8"
    convert(drafter_dir, q4, q_bits=4)
    convert(q4, q8, q_bits=8, q_group_size=32)
    loaded = load_draft(q8, target=model)
    assert (loaded.fc.bits, loaded.fc.group_size) == (8, 32)


def test_cli_report_and_errors(drafter_dir, tiny_hybrid_path, tmp_path, capsys):
    out = tmp_path / "cli"
    argv = [str(drafter_dir), "--out", str(out), "--q-bits", "6", "--target", str(tiny_hybrid_path)]
    assert cli_main(["convert", *argv]) == 0  # dispatched by the dflash-serve entry point
    text = capsys.readouterr().out
    assert "size:" in text and "->" in text and "top-1 agreement" in text
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 6

    assert main([str(drafter_dir), "--out", str(tmp_path / "x")]) == 2
    assert "nothing to do" in capsys.readouterr().err
    assert main([str(drafter_dir), "--out", str(drafter_dir), "--q-bits", "4"]) == 2
    assert "--out must differ" in capsys.readouterr().err
    assert main([str(tmp_path / "missing"), "--out", str(tmp_path / "y"), "--q-bits", "4"]) != 0
    with pytest.raises(SystemExit):  # argparse: bits outside 4|5|6|8
        main([str(drafter_dir), "--out", str(tmp_path / "z"), "--q-bits", "3"])


def test_out_with_files_needs_force_and_model_errors_are_one_line(drafter_dir, tmp_path, capsys):
    out = tmp_path / "bf16"
    argv = [str(drafter_dir), "--out", str(out), "--dtype", "bfloat16"]
    assert main(argv) == 0
    capsys.readouterr()
    assert main(argv) == 2  # a second run would overwrite the first one's folder
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already holds files: pass --force" in err
    assert main([*argv, "--force"]) == 0
    capsys.readouterr()
    # As dflash-serve words them: a missing folder, a hub id with the hub unreachable (offline).
    for source, needle in ((tmp_path / "missing", "no such folder"), ("nobody-xyz/d", "hub is")):
        assert main([str(source), "--out", str(tmp_path / "x"), "--q-bits", "4"]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1 and "Traceback" not in err
