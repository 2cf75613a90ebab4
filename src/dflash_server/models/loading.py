"""Load targets (through mlx-lm) and drafters from a local folder or a hub repo.

Drafters are dispatched on ``config.json``'s ``architectures``: DFlash, DFlash2 and "assistant"
exports (see ``variants``); each family may rename checkpoint keys before a strict load. The
target's own MTP head loads from its checkpoint's ``mtp.*`` tensors (``load_mtp``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import infer_quant_config

from dflash_server.models.dflash2 import DFlash2Config, DFlash2DraftModel
from dflash_server.models.drafter import DFlashConfig, DFlashDraftModel
from dflash_server.models.mtp import DEFAULT_BLOCK, MTPConfig, MTPDrafter
from dflash_server.models.variants import assistant_kwargs
from dflash_server.models.window import default_window

_DRAFT_PATTERNS = ["*.safetensors", "*.json"]
NO_LIMIT = int(1e30)  # what transformers itself uses for "no maximum length"


def resolve_model_path(repo_or_path: str | Path, allow_patterns: list[str] | None = None) -> Path:
    """A local folder as is; otherwise a hub snapshot (cached, progress bar, HF_HUB_OFFLINE aware)."""
    path = Path(repo_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise FileNotFoundError(f"{path} is a file; pass the model's folder")
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(repo_or_path), allow_patterns=allow_patterns))


def load_arrays(path: str | Path) -> dict[str, mx.array]:
    """The tensors of a ``.safetensors`` file (``mx.load``, typed for what it returns here)."""
    return cast("dict[str, mx.array]", mx.load(str(path)))


def flat_arrays(tree: Any) -> list[tuple[str, mx.array]]:
    """``mlx.utils.tree_flatten`` of a parameter or optimizer-state tree, typed."""
    from mlx.utils import tree_flatten

    return cast("list[tuple[str, mx.array]]", tree_flatten(tree))


# What mlx-lm's ``Model.shard`` splits evenly over the ranks (Qwen3.5 and other families).
_SPLIT = (
    "num_attention_heads",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)


def shard_problem(config: dict[str, Any], ranks: int) -> str | None:
    """Why a model with this ``config.json`` cannot be tensor-sharded over ``ranks``, or None.
    KV heads may also be fewer than the ranks (mlx-lm repeats them) if they divide it; an
    untied LM head is split by vocabulary."""
    text = config.get("text_config") or config
    counts = {name: text[name] for name in _SPLIT if isinstance(text.get(name), int)}
    if not text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)):
        counts["vocab_size"] = text.get("vocab_size", 0)
    for name, count in counts.items():
        if count % ranks:
            return f"its {name} ({count}) does not split over {ranks} ranks"
    kv = text.get("num_key_value_heads")
    if isinstance(kv, int) and kv % ranks and ranks % kv:
        return f"its num_key_value_heads ({kv}) neither divides nor is divided by {ranks} ranks"
    return None


def load(
    path_or_repo: str | Path, group: Any = None, **kwargs: Any
) -> tuple[nn.Module, TokenizerWrapper]:
    """Load a target model and its tokenizer with mlx-lm (any architecture mlx-lm supports);
    with an MLX distributed ``group``, tensor-sharded over its ranks (mlx-lm's ``Model.shard``:
    each rank keeps only its slice of every sharded layer)."""
    if group is not None:
        from mlx_lm.utils import sharded_load

        config = json.loads((Path(path_or_repo) / "config.json").read_text())
        if (problem := shard_problem(config, group.size())) is not None:
            raise ValueError(f"{problem}: launch a number of ranks that splits it")

        model, tokenizer = sharded_load(str(path_or_repo), tensor_group=group, **kwargs)
    else:
        from mlx_lm import load as mlx_lm_load

        model, tokenizer = mlx_lm_load(str(path_or_repo), **kwargs)[:2]
    # The context limit is the model config's (and the server's --context-length); the
    # tokenizer's own limit only warns of "indexing errors" that cannot happen here.
    tokenizer.model_max_length = NO_LIMIT
    return model, tokenizer


@dataclass(frozen=True)
class DrafterFamily:
    """How one published layout maps onto a model class: config parser and key remapping."""

    name: str
    model_class: type[DFlashDraftModel]
    parse: Callable[[dict[str, Any]], DFlashConfig]
    remap: Callable[[dict[str, mx.array], dict[str, Any]], dict[str, mx.array]]


def _same(weights: dict[str, mx.array], raw: dict[str, Any]) -> dict[str, mx.array]:
    return weights


def _remap_assistant(weights: dict[str, mx.array], raw: dict[str, Any]) -> dict[str, mx.array]:
    """``encoder.fc.*`` -> ``fc.*``, ``encoder.output_norm_enc.*`` -> ``hidden_norm.*``."""
    prefixes = {"encoder.fc.": "fc.", "encoder.output_norm_enc.": "hidden_norm."}
    out = {}
    for k, v in weights.items():
        for old, new in prefixes.items():
            if k.startswith(old):
                k = new + k[len(old) :]
                break
        out[k] = v
    return out


def _remap_dflash2(weights: dict[str, mx.array], raw: dict[str, Any]) -> dict[str, mx.array]:
    """Codebooks are stored bare (``candidate_selector.predecessor_codebook``), as the model
    names them; MLX exports built on an Embedding spell them ``.weight``, possibly packed."""
    out = dict(weights)
    for name in ("predecessor_codebook", "successor_codebook"):
        key = f"candidate_selector.{name}"
        if f"{key}.weight" not in out:
            continue
        if key in out:
            raise ValueError(f"drafter weights hold both {key} and {key}.weight")
        weight = out.pop(f"{key}.weight")
        if f"{key}.scales" in out:  # kept in higher precision here: unpack once at load
            scales, biases = out.pop(f"{key}.scales"), out.pop(f"{key}.biases", None)
            if biases is None or scales.dtype == mx.uint8:
                raise ValueError(f"{key}: only affine-quantized codebooks can be loaded")
            rank = int(raw["dflash_config"]["selector_rank"])
            group, bits = rank // scales.shape[-1], weight.shape[-1] * 32 // rank
            weight = mx.dequantize(weight, scales, biases, group, bits)
        out[key] = weight
    return out


FAMILIES: dict[str, DrafterFamily] = {
    "DFlashDraftModel": DrafterFamily("DFlash", DFlashDraftModel, DFlashConfig.from_dict, _same),
    "DFlash2DraftModel": DrafterFamily(
        "DFlash2", DFlash2DraftModel, DFlash2Config.from_dict, _remap_dflash2
    ),
}
_ASSISTANT = DrafterFamily(
    "assistant", DFlashDraftModel, lambda c: DFlashConfig(**assistant_kwargs(c)), _remap_assistant
)


def drafter_family(raw: dict[str, Any]) -> DrafterFamily:
    """The family a ``config.json`` declares (``architectures[0]``); unknown ones are refused.

    No ``architectures`` key: a DFlash (v1) export, as older ones were written.
    """
    arch = (raw.get("architectures") or ["DFlashDraftModel"])[0]
    if arch in FAMILIES:
        return FAMILIES[arch]
    if isinstance(arch, str) and arch.endswith("AssistantModel"):
        return _ASSISTANT
    known = ", ".join([*FAMILIES, "*AssistantModel (DFlash weights under encoder.* names)"])
    raise ValueError(
        f"unsupported drafter architecture {arch!r} (config.json 'architectures'); "
        f"this server loads: {known}"
    )


def load_draft(
    path_or_repo: str | Path,
    target: nn.Module | None = None,
    sliding_window_size: int | None = None,
) -> DFlashDraftModel:
    """Load a drafter unmodified (DFlash, DFlash2 or an "assistant" export; MLX-quantized
    exports included). Binds ``target`` if given. ``sliding_window_size`` (as in the reference)
    bounds the context of its full-attention layers (sinks + newest, ``models/window.py``);
    default: the config's ``sliding_window_size``, else the whole context."""
    path = resolve_model_path(path_or_repo, _DRAFT_PATTERNS)
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"no config.json in {path}: is this a DFlash drafter folder?")
    raw = json.loads(config_file.read_text())
    family = drafter_family(raw)
    config = family.parse(raw)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(load_arrays(f))
    weights = family.remap(weights, raw)
    model = family.model_class(config)
    model.family = family.name
    if (quantization := raw.get("quantization")) is not None:
        quantize_like_checkpoint(model, quantization, weights)
    load_weights_strict(model, weights, source=f"{path} ({family.name} layout)")
    model.eval()
    mx.eval(model.parameters())
    model.set_window(sliding_window_size or default_window(model))
    if target is not None:
        model.bind(target)
    return model


def quantize_like_checkpoint(
    model: nn.Module, quantization: dict[str, Any], weights: dict[str, mx.array]
) -> None:
    """Swap in quantized layers where the checkpoint stores packed weights (mlx-lm's convention)."""

    def predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
        if isinstance(quantization.get(path), dict):  # per-module override
            return quantization[path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return infer_quant_config(path, module, weights)

    nn.quantize(
        model,
        group_size=quantization.get("group_size", 64),
        bits=quantization.get("bits", 4),
        mode=quantization.get("mode", "affine"),
        class_predicate=predicate,
    )


def load_weights_strict(model: nn.Module, weights: dict[str, mx.array], source: str) -> None:
    """Load with a readable error listing missing/unexpected/mis-shaped tensors."""
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    shapes = [
        f"{k}: checkpoint {tuple(weights[k].shape)} vs model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in weights and weights[k].shape != v.shape
    ]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)}: {', '.join(missing[:8])}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)}: {', '.join(unexpected[:8])}")
        if shapes:
            parts.append(f"wrong shape: {'; '.join(shapes[:4])}")
        raise ValueError(
            f"drafter weights in {source} do not match its config.json ({' | '.join(parts)}). "
            "Is this a drafter checkpoint, with a config.json from the same export?"
        )
    model.load_weights(list(weights.items()), strict=True)


def mtp_weights(path: Path) -> dict[str, mx.array]:
    """The ``mtp.*`` tensors of a checkpoint folder (the target's, or a split export), named as
    the head names them (``fc.weight``, ``layers.0.self_attn.q_proj.weight``, ...)."""
    files = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.exists():  # only the shards that hold the head, when the index names them
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        names = {v for k, v in weight_map.items() if "mtp." in k}
        files = [f for f in files if f.name in names] or files
    out: dict[str, mx.array] = {}
    for f in files:
        for key, value in load_arrays(f).items():
            if key.startswith("mtp.") or ".mtp." in key:
                out[key.split("mtp.", 1)[1]] = value
    return out


def has_mtp(path: Path) -> bool:
    """Whether a target checkpoint folder carries its MTP head."""
    raw = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    text = raw.get("text_config", raw)
    return bool(text.get("mtp_num_hidden_layers")) and bool(mtp_weights(path))


def load_mtp(path_or_repo: str | Path, target: nn.Module) -> MTPDrafter:
    """Load the MTP head from a checkpoint folder that holds ``mtp.*`` tensors: the target's
    own (``--draft mtp``) or a split export, quantized or not; bound to ``target``."""
    path = resolve_model_path(path_or_repo, _DRAFT_PATTERNS)
    raw = json.loads((path / "config.json").read_text())
    text = dict(raw.get("text_config", raw))
    if not text.get("mtp_num_hidden_layers"):
        raise ValueError(
            f"{path} has no MTP head (config.json: no mtp_num_hidden_layers); pass a DFlash "
            "drafter, the original checkpoint that carries mtp.* tensors, or no --draft"
        )
    weights = mtp_weights(path)
    if not weights:
        raise ValueError(
            f"no mtp.* tensors in {path}: MLX conversions usually drop them; use the original "
            "checkpoint, or a split MTP export (dflash-serve convert keeps the head)"
        )
    config = MTPConfig(text, block_size=int(raw.get("block_size", DEFAULT_BLOCK)))
    if _unsanitized(path):  # the original layout stores zero-centred norms (weight + 1)
        weights = {k: v + 1.0 if k.endswith("norm.weight") and v.ndim == 1 else v
                   for k, v in weights.items()}  # fmt: skip
    weights = _sanitize_layers(weights, target, config)
    model = MTPDrafter(config)
    if (quantization := raw.get("quantization")) is not None:
        quantize_like_checkpoint(model, quantization, weights)
    load_weights_strict(model, weights, source=f"{path} (MTP head)")
    model.eval()
    mx.eval(model.parameters())
    return model.bind(target)


def _unsanitized(path: Path) -> bool:
    """Whether the folder is in the original (Hugging Face) layout, as mlx-lm tells: a Gated
    DeltaNet conv1d weight not yet moved to MLX's layout."""
    for f in sorted(path.glob("*.safetensors")):
        for key, value in load_arrays(f).items():
            if key.endswith("conv1d.weight"):
                return value.shape[-1] != 1
    return False


def _sanitize_layers(
    weights: dict[str, mx.array], target: nn.Module, config: MTPConfig
) -> dict[str, mx.array]:
    """The head's decoder layers as mlx-lm sanitizes the target's (e.g. stacked MoE experts):
    each is renamed as a full-attention target layer, sanitized by the target, renamed back."""
    sanitize = getattr(target, "sanitize", None)
    if sanitize is None:
        return weights
    interval = config.layer_args().full_attention_interval
    own = {f"model.language_model.layers.{interval * (i + 1) - 1}.": f"layers.{i}."
           for i in range(config.num_hidden_layers)}  # fmt: skip
    renamed = {}
    for key, value in weights.items():
        for theirs, mine in own.items():
            if key.startswith(mine):
                key = theirs + key[len(mine) :]
        renamed[key] = value
    out = {}
    for key, value in sanitize(renamed).items():
        for theirs, mine in own.items():
            # Qwen3.5's sanitize moves them under language_model.model.; a plain attention
            # target's (a head trained for it with train --mtp) leaves the names as they were.
            for name in (theirs.replace("model.language_model.", "language_model.model."), theirs):
                if key.startswith(name):
                    key = mine + key[len(name) :]
                    break
        out[key.removeprefix("language_model.model.").removeprefix("language_model.")] = value
    return out
