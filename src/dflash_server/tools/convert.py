"""``dflash-serve convert``: quantize and/or cast a DFlash drafter into a self-contained folder.

Quantization is mlx-lm's (``quantize_model``: affine, per-group scales and biases, a
``quantization`` block in config.json), so the result loads with ``load_draft`` and with any tool
that reads mlx-lm quantized weights. With ``--target`` the new drafter's block logits are compared
with the original's on a text sample, through the real inference path.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx_lm.utils import compute_bits_per_weight, dequantize_model, quantize_model

from dflash_server.drafters.dflash import DFlashDraftModel
from dflash_server.drafters.registry import load_draft
from dflash_server.engine.blas import blas_hint
from dflash_server.engine.loader import (
    DRAFT_PATTERNS,
    TARGET_PATTERNS,
    ModelLoadError,
    resolve_model,
)
from dflash_server.models.loading import flat_arrays
from dflash_server.tools.common import (
    check_out,
    human_bytes,
    logit_error,
    model_card,
    save_drafter,
    weights_bytes,
)
from dflash_server.tools.convert_args import DTYPE_NAMES, build_parser

DTYPES = {name: getattr(mx, name) for name in DTYPE_NAMES}
SAMPLE_TEXT = (
    "Speculative decoding lets a small drafter propose several tokens that the large model then "
    "checks in a single forward pass.\n\ndef merge(a: list[int], b: list[int]) -> list[int]:\n"
    "    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n"
    "        else:\n            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n\n"
    "Question: what is 17 * 23? Answer: 17 * 23 = 391, because 17 * 20 = 340 and 17 * 3 = 51."
)


def convert(
    source: str | Path,
    out: str | Path,
    q_bits: int | None = None,
    q_group_size: int = 64,
    dtype: str | None = None,
    target: str | Path | None = None,
    sample_text: str = SAMPLE_TEXT,
    force: bool = False,
) -> dict[str, Any]:
    """Convert ``source`` into ``out``; return a report (sizes, bits per weight, logit error).
    An ``out`` that holds files is refused unless ``force``."""
    if q_bits is None and dtype is None:
        raise ValueError("nothing to do: give --q-bits and/or --dtype")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    src = resolve_model(str(source), "drafter", DRAFT_PATTERNS)
    out = Path(out).expanduser()
    if out.resolve() == src.resolve():
        raise ValueError("--out must differ from the source folder (it would overwrite it)")
    check_out(out, force)
    raw = json.loads((src / "config.json").read_text())
    draft = load_draft(src)
    config = {k: v for k, v in raw.items() if k not in ("quantization", "quantization_config")}
    if q_bits is not None and "quantization" in raw:
        dequantize_model(draft)  # re-quantize from the dequantized weights, not packed ones
    elif "quantization" in raw:
        config["quantization"] = raw["quantization"]
    if dtype is not None:
        draft.set_dtype(DTYPES[dtype])  # floating parameters only: packed weights stay uint32
        config["torch_dtype"] = dtype
    if q_bits is not None:
        if q_bits not in (2, 3, 4, 5, 6, 8):
            raise ValueError(f"--q-bits must be one of 2, 3, 4, 5, 6, 8, got {q_bits}")
        with contextlib.redirect_stdout(io.StringIO()):  # mlx-lm prints its own [INFO] line
            quantized, config = quantize_model(draft, config, q_group_size, q_bits, mode="affine")
            draft = cast(DFlashDraftModel, quantized)  # quantized in place, same class
        if not any(k.endswith(".scales") for k in _param_names(draft)):
            raise ValueError(
                f"no layer was quantized: no Linear input width is a multiple of "
                f"--q-group-size {q_group_size} (hidden size {raw['hidden_size']})"
            )
    mx.eval(draft.parameters())
    report: dict[str, Any] = {
        "source": str(source),
        "out": str(out),
        "bytes_before": weights_bytes(src),
        "bits_per_weight": round(float(compute_bits_per_weight(draft)), 3),
    }
    summary = [f"{k}={v}" for k, v in (("q_bits", q_bits), ("dtype", dtype)) if v is not None]
    card = [f"Converted from `{source}` with `dflash-serve convert` ({', '.join(summary)})."]
    if q_bits is not None:
        card.append(f"Affine {q_bits}-bit quantization, group size {q_group_size} (mlx-lm).")
    if target is not None:
        report["logit_error"] = _measure(src, draft, target, sample_text)
        card.append(f"Block-logit error vs the source on a sample: {report['logit_error']}.")
    save_drafter(
        draft, out, config, model_card(f"DFlash drafter ({', '.join(summary)})", card, config)
    )
    report["bytes_after"] = weights_bytes(out)
    load_draft(out)  # round trip: fail here, not in the server, if the folder does not load
    return report


def _param_names(model: Any) -> list[str]:
    return [k for k, _ in flat_arrays(model.parameters())]


def _measure(src: Path, converted: Any, target: str | Path, text: str) -> dict[str, float]:
    from dflash_server.models.loading import load

    model, tokenizer = load(str(resolve_model(str(target), "target", TARGET_PATTERNS)))
    reference = load_draft(src, target=model)
    converted.bind(model)
    ids = tokenizer.encode(text)[:512]
    if len(ids) < reference.config.block_size + 2:
        raise ValueError("the logit-error sample is too short; give a longer --sample-text")
    err = logit_error(reference, converted, model, ids)
    return {k: round(v, 5) for k, v in err.items()}


def main(argv: Sequence[str] | None = None) -> int:
    code = run(build_parser().parse_args(argv))
    if code == 0 and (hint := blas_hint()) is not None:  # after the report: errors stay one line
        print(f"dflash-serve convert: warning: {hint}", file=sys.stderr)
    return code


def run(args: argparse.Namespace) -> int:
    """``dflash-serve convert`` once its flags are parsed."""
    try:
        sample = Path(args.sample_file).read_text() if args.sample_file else SAMPLE_TEXT
        if args.mtp:
            from dflash_server.tools.train_mtp import split_mtp

            check_out(Path(args.out).expanduser(), args.force)
            result = split_mtp(args.source, args.out, args.q_bits, args.q_group_size, args.dtype)
            print(f"wrote {result['out']} (the MTP head of {result['source']})")
            return 0
        report = convert(
            args.source,
            args.out,
            args.q_bits,
            args.q_group_size,
            args.dtype,
            args.target,
            sample,
            force=args.force,
        )
    except (ValueError, FileNotFoundError, ModelLoadError) as exc:
        print(f"dflash-serve convert: error: {exc}", file=sys.stderr)
        return 2
    before, after = report["bytes_before"], report["bytes_after"]
    print(f"wrote {report['out']}")
    print(
        f"size: {human_bytes(before)} -> {human_bytes(after)} ({after / max(before, 1):.2f}x), "
        f"{report['bits_per_weight']} bits/weight"
    )
    if "logit_error" in report:
        e = report["logit_error"]
        print(
            f"block logits vs source: max |delta| {e['max_abs_logit']:.4f}, mean KL "
            f"{e['mean_kl']:.5f}, top-1 agreement {e['top1_agreement']:.1%}"
        )
    else:
        print("pass --target to measure the converted drafter's logit error against the source")
    return 0
