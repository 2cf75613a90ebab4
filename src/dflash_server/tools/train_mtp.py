"""``dflash-serve train --mtp``: train (or fine-tune) the target's multi-token-prediction head.

The head reads the target's final hidden state at position i and the token at i+1, and predicts
the token at i+2 (``models/mtp.py``). Training runs it over whole sequences at once, with a causal
mask, teacher-forced on the data's tokens, against the target's greedy tokens (or the data's):
position i of that pass computes what inference computes for committed position i.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from dflash_server.drafters.mtp import DEFAULT_BLOCK, MTPConfig, MTPDrafter, load_mtp
from dflash_server.models.loading import flat_arrays
from dflash_server.tools.train_forward import TrainBatch


def init_mtp(args: argparse.Namespace, model: nn.Module) -> tuple[MTPDrafter, dict[str, Any], str]:
    """The head a run starts from: ``--init new`` (random, sized from the target), ``target``
    (the head in the target's own checkpoint) or an MTP folder; (head, its config, dtype)."""
    if args.init == "new":
        text = _text_config(Path(args.target))
        text.setdefault("mtp_num_hidden_layers", 1)
        head = MTPDrafter(MTPConfig(text, block_size=args.block_size or DEFAULT_BLOCK))
        head.set_dtype(mx.float32)
        mx.eval(head.parameters())
        head.bind(model)
    else:
        head = load_mtp(args.target if args.init == "target" else args.init, model)
    config = {"text": head.config.text, "block_size": head.config.block_size}
    dtype = str(next(v for _, v in flat_arrays(head.parameters())).dtype).removeprefix("mlx.core.")
    return head, config, dtype


def mtp_loss(
    head: MTPDrafter, batch: TrainBatch, weights: Any = None
) -> tuple[mx.array, mx.array, mx.array]:
    """(mean cross-entropy, accuracy, accuracy) of every position's next-next token."""
    embed, final_norm, lm_head = head.borrowed()
    hidden = final_norm(batch.taps[:, :-2])  # h_0 .. h_{T-3}
    emb = embed(batch.tokens[:, 1:-1])  # x_1 .. x_{T-2}
    m = head.fc(
        mx.concatenate([head.pre_fc_norm_embedding(emb), head.pre_fc_norm_hidden(hidden)], axis=-1)
    )
    mask = create_attention_mask(m, None)  # causal, as mlx-lm masks a prompt
    for layer in head.layers:
        m = layer(m, mask, None)
    logits = lm_head(head.norm(m)).astype(mx.float32)
    labels = batch.labels[:, 2:]  # what position i + 2 should hold
    loss = nn.losses.cross_entropy(logits, labels, reduction="mean")
    acc = (mx.argmax(logits, axis=-1) == labels).astype(mx.float32).mean()
    return loss, acc, acc


def save_mtp(
    head: MTPDrafter,
    out: Path,
    config: dict[str, Any],
    card: list[str],
    dtype: mx.Dtype | None = None,
    quantization: dict[str, Any] | None = None,
) -> None:
    """A split export: ``config.json`` (``model_type`` ``qwen3_5_mtp``, the target's text
    config, the widest block, mlx-lm's ``quantization`` block if packed) and the head's
    ``mtp.*`` tensors (floating ones cast to ``dtype``); ``--draft OUT`` loads it."""
    out.mkdir(parents=True, exist_ok=True)
    arrays = {
        f"mtp.{k}": v.astype(dtype) if dtype is not None and mx.issubdtype(v.dtype, mx.floating)
        else v
        for k, v in flat_arrays(head.parameters())
    }  # fmt: skip
    mx.save_safetensors(str(out / "model.safetensors"), arrays, metadata={"format": "mlx"})
    text = dict(config["text"])
    meta = {"model_type": "qwen3_5_mtp", "block_size": config["block_size"], "text_config": text}
    if quantization is not None:
        meta["quantization"] = quantization
    (out / "config.json").write_text(json.dumps(meta, indent=2))
    (out / "README.md").write_text("\n".join(card) + "\n")


def _text_config(target: Path) -> dict[str, Any]:
    from dflash_server.models.loading import resolve_model_path

    raw = json.loads((resolve_model_path(target) / "config.json").read_text())
    return dict(raw.get("text_config", raw))


def split_mtp(
    source: str | Path,
    out: str | Path,
    q_bits: int | None = None,
    q_group_size: int = 64,
    dtype: str | None = None,
) -> dict[str, Any]:
    """``dflash-serve convert SOURCE --mtp``: the MTP head of a target checkpoint (or of an MTP
    folder) written as its own split export, cast and/or quantized (mlx-lm's affine packing),
    so it can sit next to an MLX conversion of the target that dropped ``mtp.*``."""
    from mlx_lm.utils import quantize_model

    from dflash_server.models.loading import load, resolve_model_path

    src = resolve_model_path(source)
    model, _ = load(str(src))
    head = load_mtp(src, model)
    if dtype is not None:
        head.set_dtype(getattr(mx, dtype))
    quantization = None
    if q_bits is not None:
        _, config = quantize_model(head, {}, q_group_size, q_bits, mode="affine")
        quantization = config["quantization"]
    out = Path(out).expanduser()
    summary = ", ".join(f"{k}={v}" for k, v in (("q_bits", q_bits), ("dtype", dtype)) if v)
    card = [f"The MTP head of `{source}`, split out with `dflash-serve convert --mtp` "
            f"({summary or 'as stored'}).", "",
            "Serve with `dflash-serve --target <an MLX conversion of that model> --draft "
            "<this folder>`."]  # fmt: skip
    config = {"text": head.config.text, "block_size": head.config.block_size}
    save_mtp(head, out, config, card, quantization=quantization)
    load_mtp(out, model)  # round trip: fail here, not in the server
    return {"source": str(source), "out": str(out), "quantization": quantization}
