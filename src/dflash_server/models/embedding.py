"""Embedding models: a decoder's backbone (Qwen3-Embedding: an mlx-lm ``qwen3`` model) read as
text embeddings: the last token's hidden state after the final norm, L2-normalised
(docs/api.md, "Embeddings"). mlx-lm builds and loads the model; its LM head is never built.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from dflash_server.models.loading import KeptTokenizer

# Inputs longer than this run alone, a chunk per step, through a cache (bounded memory); the
# shorter ones are batched, right-padded: causal attention never lets a token see the padding.
CHUNK_TOKENS = 512
DEFAULT_CONTEXT = 32768


class EmbeddingModel:
    """A loaded embedding model: its tokenizer, width, context and forward pass."""

    def __init__(self, model: Any, tokenizer: TokenizerWrapper, config: dict[str, Any]) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.backbone = model.model  # mlx-lm's backbone: hidden states after the final norm
        self.dimensions = int(config["hidden_size"])
        self.vocab_size = int(config["vocab_size"])
        context = config.get("max_position_embeddings")
        self.context_length = (
            context if isinstance(context, int) and context > 0 else DEFAULT_CONTEXT
        )

    @property
    def weight_bytes(self) -> int:
        from dflash_server.models.loading import flat_arrays

        return sum(a.nbytes for _, a in flat_arrays(self.model.parameters()))

    def encode(self, text: str) -> list[int]:
        """The model's tokens for ``text``, special tokens as its tokenizer adds them (Qwen3-
        Embedding's appends ``<|endoftext|>``, whose hidden state is the embedding)."""
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def embed_batch(self, rows: list[list[int]]) -> np.ndarray:
        """Unit vectors of short inputs (each at most ``CHUNK_TOKENS``), in order."""
        longest = max(len(r) for r in rows)
        ids = mx.array([r + [0] * (longest - len(r)) for r in rows])
        hidden = self.backbone(ids)
        last = hidden[mx.arange(len(rows)), mx.array([len(r) - 1 for r in rows])]
        return _normalised(last)

    def start_long(self) -> list[Any]:
        """The cache a long input is fed through, a chunk at a time (``feed``)."""
        return make_prompt_cache(self.model)

    def feed(self, cache: list[Any], tokens: list[int], last: bool) -> np.ndarray | None:
        """Run one chunk of a long input; its unit vector once ``last``."""
        hidden = self.backbone(mx.array([tokens]), cache=cache)
        if not last:
            mx.eval([c.state for c in cache])
            return None
        return _normalised(hidden[:, -1])[0]


def _normalised(vectors: mx.array) -> np.ndarray:
    v = vectors.astype(mx.float32)
    v = v / mx.maximum(mx.linalg.norm(v, axis=-1, keepdims=True), 1e-12)
    return np.array(v, dtype=np.float32)


def is_embedding_config(config: dict[str, Any]) -> bool:
    """Whether a checkpoint says it is an embedding model (Qwen3-Embedding's sentence-transformers
    files, or its name)."""
    names = " ".join(map(str, config.get("architectures") or [])) + str(config.get("_name_or_path"))
    return "embedding" in names.lower()


def load_embedding_model(
    path: Path, lazy: bool = False, kept: KeptTokenizer | None = None
) -> EmbeddingModel:
    """Load an embedding checkpoint with mlx-lm's own classes: the backbone only (weights saved
    without the ``model.`` prefix, as sentence-transformers saves Qwen3-Embedding, are read
    too). Raises ValueError naming what does not fit. ``lazy``: its weights are read when first
    evaluated; ``kept``: its tokenizer from an earlier load, and where to keep this one."""
    from mlx_lm.utils import _get_classes, load_model, load_tokenizer

    config = json.loads((path / "config.json").read_text())
    model_type = config.get("model_type")
    try:
        model_class, args_class = _get_classes(config)
    except ValueError as exc:
        raise ValueError(f"mlx-lm has no model type {model_type!r}: {exc}") from exc

    class Backbone(model_class):  # type: ignore[misc, valid-type]
        def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
            if not any(k.startswith("model.") for k in weights):
                weights = {f"model.{k}": v for k, v in weights.items()}
            weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
            parent = getattr(super(), "sanitize", None)
            return parent(weights) if parent is not None else weights

    model, config = load_model(
        path,
        model_config={"tie_word_embeddings": True},  # no LM head is built: it is never used
        lazy=lazy,
        get_model_classes=lambda config: (Backbone, args_class),
    )
    if not hasattr(model, "model"):
        raise ValueError(f"a {model_type!r} model has no backbone to embed with")
    tokenizer = (kept.get(path) if kept is not None else None) or load_tokenizer(path)
    if kept is not None:
        kept.keep(path, tokenizer)
    return EmbeddingModel(model, tokenizer, config)
