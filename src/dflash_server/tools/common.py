"""Shared by convert and train: writing drafter folders, measuring acceptance and logit error."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import save_config, save_model

from dflash_server.adaptive.policy import FixedBlock
from dflash_server.drafters.dflash import DFlashDraftModel
from dflash_server.drafters.protocol import Drafter
from dflash_server.generation.row import Row
from dflash_server.generation.sampling import SamplingParams, TokenSampler
from dflash_server.generation.speculative import SpeculativeDecoder
from dflash_server.generation.target import TargetModel


def weights_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def check_out(out: Path, force: bool, other: str = "") -> None:
    """Refuse an ``--out`` that would overwrite something: a file, or a folder with files in it
    unless ``--force`` (``other``: another way out, named in the message)."""
    if out.is_file():
        raise ValueError(f"--out {out} is a file: give a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(
            f"--out {out} already holds files: pass --force to overwrite them{other}, or choose "
            "another folder"
        )


def save_drafter(
    draft: DFlashDraftModel, out: Path, config: dict[str, Any], card: Sequence[str]
) -> None:
    """Write the published layout: config.json, model*.safetensors (no embedding/lm_head), README.

    Weights go through mlx-lm's ``save_model`` and the config through its ``save_config``, so
    quantized exports follow mlx-lm's convention (a ``quantization`` block, packed Linear weights).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors"):  # a smaller re-export must not leave stale shards
        old.unlink()
    save_model(out, draft)
    save_config(dict(config), out / "config.json")
    (out / "README.md").write_text("\n".join(card) + "\n")


def model_card(title: str, lines: Sequence[str], config: dict[str, Any]) -> list[str]:
    dflash = config.get("dflash_config", {})
    return [
        "---",
        "library_name: mlx",
        "tags: [dflash, speculative-decoding, mlx]",
        "---",
        f"# {title}",
        "",
        *lines,
        "",
        f"* layers {config.get('num_hidden_layers')}, hidden {config.get('hidden_size')}, "
        f"block size {config.get('block_size')}, taps {dflash.get('target_layer_ids')}, "
        f"mask id {dflash.get('mask_token_id')}",
        f"* quantization: {json.dumps(config.get('quantization')) if 'quantization' in config else 'none'}",
        "",
        "Load with `dflash_server.load_draft(path, target)`; serve with "
        "`dflash-serve --target <target> --draft <this folder>`.",
    ]


@dataclass
class DecodeResult:
    tokens: list[list[int]]
    tau: float
    tokens_per_s: float
    seconds: float


def decode(
    model: nn.Module,
    draft: Drafter | None,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    block_size: int | None = None,
) -> DecodeResult:
    """Greedy-decode each prompt (no EOS stop, so every run has the same length); tau and tok/s.

    tok/s counts generated tokens after the prefill's first token over decode time only.
    """
    taps = draft.config.target_layer_ids if draft is not None else ()
    target = TargetModel(model, taps)
    size = (block_size or draft.config.block_size) if draft is not None else 1
    outs, cycles, committed, generated, seconds = [], 0, 0, 0, 0.0
    for prompt in prompts:
        decoder = SpeculativeDecoder(
            Row(target, draft, TokenSampler(SamplingParams(), 0), FixedBlock(size))
        )
        out: list[int] = []
        start = 0.0
        for i, chunk in enumerate(decoder.generate(list(prompt), max_tokens)):
            if i == 0:
                start = time.perf_counter()
            out.extend(chunk.tokens)
        seconds += time.perf_counter() - start
        outs.append(out)
        generated += len(out) - 1
        cycles += decoder.stats.cycles
        committed += decoder.stats.cycles + decoder.stats.accepted
    tau = committed / cycles if cycles else 0.0
    return DecodeResult(outs, tau, generated / max(seconds, 1e-9), seconds)


def logit_error(
    reference: DFlashDraftModel,
    other: DFlashDraftModel,
    model: nn.Module,
    sample: Sequence[int],
    anchors: int = 8,
) -> dict[str, float]:
    """Compare two drafters' block logits on a real sample through the inference path.

    The target's taps of ``sample`` form the context; blocks are drafted at ``anchors`` evenly
    spaced anchor positions. Reports max |delta logit|, mean KL(reference || other), top-1 agreement.
    """
    B = reference.config.block_size
    target = TargetModel(model, reference.config.target_layer_ids)
    ids = mx.array(list(sample))[None]
    _, taps = target.forward(ids, None, None)
    assert taps is not None, "the target is tapped for the drafter"
    spread = cast("list[float]", mx.linspace(1, len(sample) - 1, anchors).tolist())
    positions = sorted({max(1, round(p)) for p in spread})
    max_abs, kl, agree, rows = 0.0, 0.0, 0.0, 0
    for a in positions:
        block = mx.array([[sample[a]] + [reference.config.mask_token_id] * (B - 1)])
        ref = reference(block, taps[:, :a], reference.make_cache(), 1)[0].astype(mx.float32)
        oth = other(block, taps[:, :a], other.make_cache(), 1)[0].astype(mx.float32)
        lp, lq = nn.log_softmax(ref, axis=-1), nn.log_softmax(oth, axis=-1)
        max_abs = max(max_abs, cast(float, mx.abs(ref - oth).max().item()))
        kl += cast(float, (mx.exp(lp) * (lp - lq)).sum().item())
        agree += cast(int, (mx.argmax(ref, -1) == mx.argmax(oth, -1)).sum().item())
        rows += ref.shape[0]
    return {"max_abs_logit": max_abs, "mean_kl": kl / rows, "top1_agreement": agree / rows}
