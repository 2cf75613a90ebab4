"""Load targets (through mlx-lm) from a local folder or a hub repo, and checkpoints into a
model's own classes unmodified (``load_checkpoint``: what every drafter family loads with,
``drafters/registry.py``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import infer_quant_config

NO_LIMIT = int(1e30)  # what transformers itself uses for "no maximum length"


def resolve_model_path(repo_or_path: str | Path, allow_patterns: list[str] | None = None) -> Path:
    """A local folder as is; otherwise a hub snapshot (cached, progress bar, HF_HUB_OFFLINE
    aware). ``owner/name/sub/folder`` names a folder inside a hub repo (some drafters ship in
    one, e.g. ``compressed/``): only that folder is fetched."""
    path = Path(repo_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise FileNotFoundError(f"{path} is a file; pass the model's folder")
        return path
    from huggingface_hub import snapshot_download

    repo, _, sub = str(repo_or_path).partition("/")
    name, _, sub = sub.partition("/")
    if not sub or str(repo_or_path).startswith((".", "/", "~")):
        return Path(snapshot_download(str(repo_or_path), allow_patterns=allow_patterns))
    patterns = [f"{sub}/{p}" for p in allow_patterns or ["*"]]
    folder = Path(snapshot_download(f"{repo}/{name}", allow_patterns=patterns)) / sub
    if not folder.is_dir():
        raise FileNotFoundError(f"{repo}/{name} has no folder {sub!r}")
    return folder


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


class KeptTokenizer:
    """A model's tokenizer kept from one of its loads to the next, while its folder's files
    (other than weights) are unchanged. With several models a reload then skips reading it,
    which holds Python's lock, so every other model's round, for up to a second (a large
    vocabulary is parsed in Rust)."""

    def __init__(self) -> None:
        self._key: str | None = None
        self._tokenizer: TokenizerWrapper | None = None

    def get(self, folder: Path) -> TokenizerWrapper | None:
        return self._tokenizer if self._key == self._key_of(folder) else None

    def keep(self, folder: Path, tokenizer: TokenizerWrapper) -> None:
        self._key, self._tokenizer = self._key_of(folder), tokenizer

    @staticmethod
    def _key_of(folder: Path) -> str:
        files = sorted(f for f in folder.iterdir() if f.is_file() and f.suffix != ".safetensors")
        stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
        return f"{folder.resolve()}: {stats}"


def load(
    path_or_repo: str | Path,
    group: Any = None,
    *,
    tokenizer: TokenizerWrapper | None = None,
    **kwargs: Any,
) -> tuple[nn.Module, TokenizerWrapper]:
    """Load a target model and its tokenizer with mlx-lm (any architecture mlx-lm supports);
    with an MLX distributed ``group``, tensor-sharded over its ranks (mlx-lm's ``Model.shard``:
    each rank keeps only its slice of every sharded layer). ``tokenizer``: the one an earlier
    load of this local folder read, used again (not with ``group``)."""
    if tokenizer is not None and group is None:
        from mlx_lm.utils import load_model

        return load_model(Path(path_or_repo), **kwargs)[0], tokenizer
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


def load_checkpoint(
    model: nn.Module,
    path: Path,
    raw: dict[str, Any],
    remap: Callable[[dict[str, mx.array]], dict[str, mx.array]] | None = None,
    *,
    source: str,
    weights: dict[str, mx.array] | None = None,
) -> None:
    """Load a folder's ``*.safetensors`` (or the given ``weights``) into ``model`` unmodified:
    renamed by ``remap``, quantized where the checkpoint is (``raw``: its config.json), checked
    strictly (``source`` names it in the error), evaluated, in eval mode."""
    if weights is None:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in {path}")
        weights = {}
        for f in files:
            weights.update(load_arrays(f))
    if remap is not None:
        weights = remap(weights)
    if (quantization := raw.get("quantization")) is not None:
        quantize_like_checkpoint(model, quantization, weights)
    load_weights_strict(model, weights, source=source)
    model.eval()
    mx.eval(model.parameters())


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
