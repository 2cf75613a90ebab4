"""Random-weight drafter folders in the published layouts of the other drafter families, sized to
a tiny target: what a user downloads, written offline in milliseconds (tests and benchmarks).

* DSpark: DeepSpec's ``Qwen3DSparkModel`` (its keys at the top level, its own copies of the
  target's embedding and head) or SpecForge's (``dflash_config.projector_type: "dspark"``, the
  target's embedding and head borrowed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

DSPARK_LAYOUTS = ("deepspec", "specforge")


def _model_keys(target: Any, num_layers: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A tiny drafter's Qwen3 model keys, and its DFlash keys (taps, mask id), for ``target``."""
    from dflash_server.testing import _tiny_drafter_fields

    fields = _tiny_drafter_fields(target, 2, num_layers)
    model = {k: fields[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                    "num_key_value_heads", "head_dim", "intermediate_size",
                                    "vocab_size", "rms_norm_eps", "rope_theta",
                                    "max_position_embeddings")}  # fmt: skip
    model.update(model_type="qwen3", hidden_act="silu", attention_bias=False,
                 layer_types=["full_attention"] * num_layers, tie_word_embeddings=False)  # fmt: skip
    dflash = {"target_layer_ids": list(fields["target_layer_ids"]),
              "mask_token_id": fields["mask_token_id"]}  # fmt: skip
    return model, {**dflash, "num_target_layers": fields["num_target_layers"]}


def write_dspark(
    path: Path,
    target: Any,
    *,
    layout: str = "deepspec",
    block_size: int = 7,
    markov: str = "vanilla",
    rank: int = 16,
    confidence: bool = True,
    confidence_with_markov: bool = True,
    num_layers: int = 2,
    seed: int = 0,
    quantize_bits: int | None = None,
) -> Path:
    """Write a random DSpark drafter for ``target`` in ``layout`` and return ``path``.

    ``block_size`` counts proposals, as the checkpoints do (verified ``block_size + 1`` wide);
    ``markov``: the Markov head's kind (``rank`` 0: none); DeepSpec's layout carries the
    target's embedding and head copied in, as its trainer writes them."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import quantize_model, save_config, save_model

    from dflash_server.drafters.dspark import DSparkConfig, DSparkDraftModel
    from dflash_server.models.target_parts import find_target_parts

    if layout not in DSPARK_LAYOUTS:
        raise ValueError(f"layout must be one of {DSPARK_LAYOUTS}, not {layout!r}")
    model_keys, dflash = _model_keys(target, num_layers)
    heads: dict[str, Any] = {
        "markov_rank": rank,
        "enable_confidence_head": confidence,
    }
    if rank:
        heads["markov_head_type"] = markov
    if confidence:
        heads["confidence_head_with_markov"] = confidence_with_markov
    if layout == "deepspec":
        raw: dict[str, Any] = {
            "architectures": ["Qwen3DSparkModel"],
            **model_keys,
            **dflash,
            "block_size": block_size,
            "num_anchors": 512,
            **heads,
        }
        names = ["embed_tokens.weight", "lm_head.weight"]
    else:
        raw = {
            "architectures": ["DFlashDraftModel"],
            **model_keys,
            "num_target_layers": dflash.pop("num_target_layers"),
            "dflash_config": {"projector_type": "dspark", "block_size": block_size,
                              **dflash, **heads},
        }  # fmt: skip
        names = []
    mx.random.seed(seed)
    draft = DSparkDraftModel(DSparkConfig.from_dict(raw, names))
    if layout == "deepspec":  # DeepSpec's trainer copies the target's embedding and head
        parts = find_target_parts(target)
        draft.embed_tokens.weight = _dense(parts.embed_tokens)
        head = parts.lm_head
        draft.lm_head.weight = (
            _dense(head) if hasattr(head, "weight") else draft.embed_tokens.weight
        )
    mx.eval(draft.parameters())
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if quantize_bits is not None:
        packed, raw = quantize_model(draft, raw, 32, quantize_bits)
        save_model(path, packed)
    else:
        weights = dict(tree_flatten(draft.parameters()))
        mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    save_config(raw, path / "config.json")
    return path


def _dense(module: Any) -> Any:
    """A layer's weight as a dense float matrix (dequantized where it is packed)."""
    import mlx.core as mx

    if hasattr(module, "scales"):
        return mx.dequantize(
            module.weight, module.scales, module.biases, module.group_size, module.bits
        )
    return module.weight
