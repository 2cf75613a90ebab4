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
from dflash_server.models.loading import flat_arrays
from dflash_server.models.target_parts import find_target_parts

_MASK_NAMES = ("<|mask|>", "<|MASK|>", "<mask>", "[MASK]")
# The loader's family names (drafters/registry.py) and the --family that trains each.
FLAGS = {"DFlash": "dflash", "DSpark": "dspark", "EAGLE-3": "eagle3", "MTP": "mtp"}


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
    """``--family dflash`` trains DFlash (v1) drafters only; say why for the other layouts."""
    from dflash_server.drafters.registry import family_of

    arch = (config.get("architectures") or ["DFlashDraftModel"])[0]
    found = family_of(config).name
    if found in FLAGS and found != "DFlash":
        raise ValueError(f"{where} holds a {found} drafter: train it with --family {FLAGS[found]}")
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


def load_init(args: argparse.Namespace, model: nn.Module, family: str) -> tuple[Any, str]:
    """The ``--init`` folder (or hub id) as ``load_drafter`` loads it for serving, bound to
    ``model``, dequantized, in float32 and in training mode; and the dtype it was stored in.
    A folder of another family is refused naming the ``--family`` that trains it."""
    from dflash_server.drafters.registry import family_of, load_drafter
    from dflash_server.engine.loader import DRAFT_PATTERNS, resolve_model

    path = resolve_model(args.init, "--init drafter", DRAFT_PATTERNS)
    raw = json.loads((path / "config.json").read_text())
    found = family_of(raw).name
    if found != family:
        fix = f"train it with --family {FLAGS[found]}" if found in FLAGS else "it cannot train"
        raise ValueError(f"--init {args.init} holds a {found} drafter, not a {family} one: {fix}")
    draft: Any = load_drafter(path, model)
    dequantize_model(draft)
    dtype = float_dtype(draft)
    draft.set_dtype(mx.float32)  # fp32 master weights whatever the checkpoint's dtype
    draft.train()
    return draft, dtype


def float_dtype(module: nn.Module) -> str:
    """The dtype name of ``module``'s first floating parameter ("float32" if it has none)."""
    for _, v in flat_arrays(module.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            return str(v.dtype).removeprefix("mlx.core.")
    return "float32"


def dense_weight(layer: Any) -> mx.array:
    """A target embedding's or head's weight as a dense matrix (dequantized where packed), to
    copy into a drafter that carries its own (DeepSpec's DSpark, speculators' EAGLE-3)."""
    if hasattr(layer, "scales"):
        return mx.dequantize(
            layer.weight, layer.scales, layer.get("biases"), layer.group_size, layer.bits,
            getattr(layer, "mode", "affine"),
        )  # fmt: skip
    return layer.weight


def target_head_weights(model: nn.Module) -> tuple[mx.array, mx.array]:
    """(embedding, lm_head) weights of the target, dense; a tied head is the embedding."""
    parts = find_target_parts(model)
    embed = dense_weight(parts.embed_tokens)
    # A head module of its own, or the tied embedding's ``as_linear`` (a bound method).
    return embed, dense_weight(parts.lm_head) if isinstance(parts.lm_head, nn.Module) else embed
