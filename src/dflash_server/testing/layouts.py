"""Random-weight drafter folders in the published layouts of the other drafter families, sized to
a tiny target: what a user downloads, written offline in milliseconds (tests and benchmarks).

* DSpark: DeepSpec's ``Qwen3DSparkModel`` (its keys at the top level, its own copies of the
  target's embedding and head) or SpecForge's (``dflash_config.projector_type: "dspark"``, the
  target's embedding and head borrowed).
* EAGLE-3: RedHat's speculators ``Eagle3Speculator`` (aux ids naming layer inputs, its own copy
  of the target's embedding) or SpecForge's ``LlamaForCausalLMEagle3`` (``eagle_config`` ids
  naming layer outputs, ``midlayer.*`` weights, the target's embedding borrowed).
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


EAGLE3_LAYOUTS = ("speculators", "specforge")


def write_eagle3(
    path: Path,
    target: Any,
    *,
    layout: str = "speculators",
    draft_vocab: int | None = None,
    fc_norm: bool = False,
    norm_before_residual: bool | None = None,
    quantize_bits: int | None = None,
    seed: int = 0,
    block_size: int = 5,
    model_type: str = "llama",
) -> Path:
    """Write a random EAGLE-3 head for ``target`` in ``layout`` and return ``path``.

    Both layouts tap the target's layers 0, L/2 - 1 and L - 2 (speculators' aux ids are those
    plus one); ``block_size - 1`` speculative tokens (speculators' key; SpecForge names none, so
    ``block_size`` is written as ours). ``draft_vocab``: a smaller draft vocabulary of random
    target ids with the trainers' ``d2t``/``t2d`` maps; ``fc_norm``: EAGLE 3.1's per-tap norms;
    ``norm_before_residual``: None is the layout's own default (speculators' RedHat heads: on;
    SpecForge: off); ``model_type`` "qwen3": a layer with per-head q/k norms. Norm weights are
    random, so each norm counts."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import quantize_model, save_config

    from dflash_server.drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from dflash_server.models.target_parts import find_target_parts

    if layout not in EAGLE3_LAYOUTS:
        raise ValueError(f"layout must be one of {EAGLE3_LAYOUTS}, not {layout!r}")
    parts = find_target_parts(target)
    n, vocab = parts.num_layers, parts.vocab_size
    layer, _ = _model_keys(target, 1)
    del layer["layer_types"]
    layer["model_type"] = model_type
    taps = [0, max(0, n // 2 - 1), n - 2]
    heads: dict[str, Any] = {"draft_vocab_size": draft_vocab or vocab}
    if fc_norm:
        heads["fc_norm"] = True
    if layout == "speculators":
        method = {"proposal_type": "greedy", "speculative_tokens": block_size - 1,
                  "accept_tolerance": 0.0, "verifier_accept_k": 1}  # fmt: skip
        raw: dict[str, Any] = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": layer,
            "eagle_aux_hidden_state_layer_ids": [t + 1 for t in taps],
            "norm_before_residual": norm_before_residual is not False,
            **heads,
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [method],
                                   "verifier": {"architectures": [], "name_or_path": "target"}},
        }  # fmt: skip
        names = ["embed_tokens.weight"]
    else:
        raw = {"architectures": ["LlamaForCausalLMEagle3"], **layer, **heads,
               "eagle_config": {"eagle_aux_hidden_state_layer_ids": taps},
               "block_size": block_size}  # fmt: skip
        if norm_before_residual:
            raw["norm_before_residual"] = True
        names = []
    mx.random.seed(seed)
    draft: Any = Eagle3Drafter(Eagle3Config.from_dict(raw, names))
    params: dict[str, Any] = dict(tree_flatten(draft.parameters()))
    norms = [(k, 1 + 0.2 * mx.random.normal(v.shape)) for k, v in params.items() if "norm" in k]
    draft.update(tree_unflatten(norms))
    if layout == "speculators":  # the trainer keeps a copy of the target's embedding
        draft.embed_tokens.weight = _dense(parts.embed_tokens)
    if quantize_bits is not None:
        draft, raw = quantize_model(draft, raw, 32, quantize_bits)
    weights = dict(tree_flatten(draft.parameters()))
    if layout == "specforge":  # the EAGLE repository's name for the layer
        weights = {k.replace("layers.0.", "midlayer.", 1): v for k, v in weights.items()}
    if draft_vocab:
        rng = np.random.default_rng(seed)
        hot = np.sort(rng.choice(vocab, draft_vocab, replace=False))
        weights["d2t"] = mx.array(hot - np.arange(draft_vocab), dtype=mx.int64)
        weights["t2d"] = mx.array(np.isin(np.arange(vocab), hot))
    mx.eval(weights)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    save_config(raw, path / "config.json")
    return path
