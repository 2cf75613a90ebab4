"""The drafter a training run starts from: an existing checkpoint, or a fresh config for a target."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import dequantize_model

from dflash_server.drafters.config import DFlashConfig, default_target_layer_ids
from dflash_server.drafters.dflash import DFlashDraftModel
from dflash_server.models.target_parts import find_target_parts

_MASK_NAMES = ("<|mask|>", "<|MASK|>", "<mask>", "[MASK]")


def default_mask_id(tokenizer: Any, rows: int) -> int:
    """A mask token the tokenizer names, else the first embedding row it never produces."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    vocab = hf.get_vocab()
    for name in _MASK_NAMES:
        if name in vocab and vocab[name] < rows:
            return int(vocab[name])
    spare = len(hf)
    if spare >= rows:
        raise ValueError(
            f"the target's {rows} embedding rows are all tokenizer tokens: pass --mask-id "
            "(an id whose row is otherwise unused)"
        )
    return spare


def default_taps(num_layers: int, num_taps: int = 5) -> list[int]:
    """The published spread (N=32: 1, 8, 15, 22, 29); shallow targets, where that formula repeats
    layers, get distinct layers from 1 to the last instead."""
    taps = list(default_target_layer_ids(num_layers, min(num_taps, num_layers)))
    if len(set(taps)) < len(taps) or not all(0 <= t < num_layers for t in taps):
        k = min(num_taps, max(1, num_layers - 1))
        taps = sorted({round(1 + i * (num_layers - 2) / max(1, k - 1)) for i in range(k)})
    return taps


def fresh_config(args: argparse.Namespace, model: nn.Module, tokenizer: Any) -> dict[str, Any]:
    """A drafter config sized from the target (attention shape, width), published conventions
    otherwise (rope theta 1e7, taps spread over the depth); a JSON ``--init`` overrides keys."""
    parts = find_target_parts(model)
    targs = getattr(getattr(model, "language_model", model), "args", None)
    n, H = parts.num_layers, parts.hidden_size
    heads = int(getattr(targs, "num_attention_heads", 0) or max(1, H // 128))
    taps = [int(t) for t in args.taps.split(",")] if args.taps else default_taps(n)
    cfg: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": H,
        "num_hidden_layers": args.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(targs, "num_key_value_heads", 0) or heads),
        "head_dim": int(getattr(targs, "head_dim", 0) or H // heads),
        "intermediate_size": int(getattr(targs, "intermediate_size", 0) or 3 * H),
        "vocab_size": parts.vocab_size,
        "rms_norm_eps": float(getattr(targs, "rms_norm_eps", 1e-6)),
        "rope_theta": 1e7,
        "max_position_embeddings": int(getattr(targs, "max_position_embeddings", 32768)),
        "block_size": args.block_size or 16,
        "num_target_layers": n,
        "dflash_config": {
            "target_layer_ids": taps,
            "mask_token_id": (
                args.mask_id
                if args.mask_id is not None
                else default_mask_id(tokenizer, parts.vocab_size)
            ),
        },
    }
    if args.init != "new":
        overrides = json.loads(Path(args.init).read_text())
        if not isinstance(overrides, dict):
            raise ValueError(f"--init {args.init}: expected a JSON object of config keys")
        dflash = {**cfg["dflash_config"], **(overrides.pop("dflash_config", None) or {})}
        cfg = {**cfg, **overrides, "dflash_config": dflash}
    return cfg


def refuse_unsupported(config: dict[str, Any], where: str) -> None:
    """Training covers DFlash (v1) drafters only; say why for the other families."""
    arch = (config.get("architectures") or ["DFlashDraftModel"])[0]
    if arch == "DFlash2DraftModel":
        raise ValueError(
            f"{where}: cannot train a DFlash2 drafter. The batched training forward implements "
            "DFlash's layers only (not DFlash2's dynamic convolutions), and the candidate "
            "selector's codebooks have no published training objective; training only part of "
            "the model would silently change what the selector expects. Train a DFlash "
            "(DFlashDraftModel) drafter instead."
        )
    if arch != "DFlashDraftModel":
        raise ValueError(f"{where}: training supports DFlashDraftModel drafters, not {arch!r}")


def init_drafter(
    args: argparse.Namespace, model: nn.Module, tokenizer: Any
) -> tuple[DFlashDraftModel, dict[str, Any], str]:
    """(float32 drafter bound to ``model``, its config.json dict, the dtype to save in)."""
    from dflash_server.drafters.registry import load_draft
    from dflash_server.engine.loader import DRAFT_PATTERNS, resolve_model

    is_json = args.init != "new" and Path(args.init).suffix == ".json"
    if args.init == "new" or is_json:
        try:
            config = fresh_config(args, model, tokenizer)
            refuse_unsupported(config, f"--init {args.init}")
            draft = DFlashDraftModel(DFlashConfig.from_dict(config))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad drafter config: {exc}") from None
        # The output feeds the target's lm_head: start from the target's own final-norm gain so
        # initial logits have the scale that head expects (random init starts at loss >> ln V).
        draft.norm.weight = find_target_parts(model).backbone.norm.weight.astype(mx.float32)
        mx.eval(draft.parameters())
        dtype = "float32"
    else:
        path = resolve_model(args.init, "--init drafter", DRAFT_PATTERNS)
        config = json.loads((path / "config.json").read_text())
        refuse_unsupported(config, f"--init {args.init}")
        for key in ("quantization", "quantization_config"):
            config.pop(key, None)  # trained in float: the result is saved unquantized
        draft = load_draft(path)
        dequantize_model(draft)
        dtype = str(draft.fc.weight.dtype).removeprefix("mlx.core.")
        draft.set_dtype(mx.float32)  # fp32 master weights whatever the checkpoint's dtype
    draft.train()
    return draft.bind(model), config, dtype
