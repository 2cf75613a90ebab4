"""The DFlash drafter: a small block-diffusion model conditioned on the target's hidden states.

One forward pass proposes a whole block. The block attends to itself bidirectionally and to the
"context": features of the committed tokens, taken from the target's tapped layers and injected as
extra keys/values in every draft layer (DFlash paper, "KV injection"). Parameter names mirror the
published checkpoints (z-lab/Qwen3.5-*-DFlash), which carry no embedding and no lm_head: those are
borrowed from the target with ``bind``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

if TYPE_CHECKING:
    from dflash_server.generation.sampling import TokenSampler

_REQUIRED_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "rms_norm_eps",
    "max_position_embeddings",
)


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> tuple[int, ...]:
    """Taps spread over the target's depth, as the reference trainer picks them."""
    if num_taps == 1:
        return (num_target_layers // 2,)
    step = (num_target_layers - 4) / (num_taps - 1)
    return tuple(round(1 + i * step) for i in range(num_taps))


@dataclass
class DFlashConfig:
    """Drafter hyper-parameters; field names follow the reference ``dflash.model_mlx``."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None = None
    mask_token_id: int = 0
    rope_scaling: dict[str, Any] | None = None
    layer_types: tuple[str, ...] = field(default_factory=tuple)
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        self.target_layer_ids = tuple(int(i) for i in self.target_layer_ids)
        if not self.layer_types:
            self.layer_types = ("full_attention",) * self.num_hidden_layers
        self.layer_types = tuple(self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"drafter config: layer_types has {len(self.layer_types)} entries but "
                f"num_hidden_layers is {self.num_hidden_layers}; they must match"
            )
        unknown = set(self.layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"drafter config: unsupported layer_types {sorted(unknown)}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("drafter config: sliding_attention layers need 'sliding_window'")
        if self.block_size < 2:
            raise ValueError(f"drafter config: block_size must be >= 2, got {self.block_size}")

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> DFlashConfig:
        """Parse a drafter ``config.json`` (flat keys plus nested ``dflash_config``)."""
        missing = [k for k in _REQUIRED_KEYS if k not in cfg]
        if missing:
            raise ValueError(
                f"drafter config.json is missing required key(s): {', '.join(missing)}"
            )
        dflash = cfg.get("dflash_config") or {}
        rope = cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta", rope.get("rope_theta"))
        if rope_theta is None:
            raise ValueError(
                "drafter config.json is missing required key: rope_theta "
                "(top level or rope_parameters.rope_theta)"
            )
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is None and rope.get("rope_type", rope.get("type", "default")) != "default":
            rope_scaling = rope
        if "mask_token_id" not in dflash and "mask_token_id" not in cfg:
            raise ValueError("drafter config.json is missing dflash_config.mask_token_id")
        num_target_layers = cfg.get("num_target_layers")
        layer_ids = dflash.get("target_layer_ids", cfg.get("target_layer_ids"))
        if layer_ids is None:
            if num_target_layers is None:
                raise ValueError(
                    "drafter config.json has neither dflash_config.target_layer_ids nor "
                    "num_target_layers, so the tapped target layers are unknown"
                )
            layer_ids = default_target_layer_ids(num_target_layers, cfg["num_hidden_layers"])
        return cls(
            hidden_size=cfg["hidden_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg["num_key_value_heads"],
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg["rms_norm_eps"],
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg["max_position_embeddings"],
            block_size=int(dflash.get("block_size", cfg.get("block_size", 16))),
            target_layer_ids=tuple(layer_ids),
            num_target_layers=num_target_layers,
            mask_token_id=int(dflash.get("mask_token_id", cfg.get("mask_token_id"))),
            rope_scaling=rope_scaling,
            layer_types=tuple(cfg.get("layer_types") or ()),
            sliding_window=cfg.get("sliding_window"),
        )

    def to_dict(self) -> dict[str, Any]:
        """The HF-style ``config.json`` this config was (or could have been) read from."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        dflash = {"target_layer_ids": list(out.pop("target_layer_ids"))}
        dflash["mask_token_id"] = out.pop("mask_token_id")
        out["layer_types"] = list(out["layer_types"])
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            **out,
            "dflash_config": dflash,
        }


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashAttention(nn.Module):
    """Queries from the block; keys/values from the cached context plus the block, no mask."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        dim, hd = config.hidden_size, config.head_dim
        self.n_heads, self.n_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.scale = hd**-0.5
        sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.window = config.sliding_window if sliding else None
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=config.rms_norm_eps)
        self.rope = initialize_rope(
            hd, config.rope_theta, False, config.rope_scaling, config.max_position_embeddings
        )

    def _keys_values(self, x: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        B, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return self.rope(k, offset=offset), v

    def append_context(self, context: mx.array, cache: KVCache) -> None:
        """Project committed positions once; only context K/V is ever cached."""
        cache.update_and_fetch(*self._keys_values(context, cache.offset))

    def __call__(self, x: mx.array, cache: KVCache) -> mx.array:
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=cache.offset)
        k_blk, v_blk = self._keys_values(x, cache.offset)
        if cache.keys is None:
            keys, values = k_blk, v_blk
        else:
            start = 0 if self.window is None else max(0, cache.offset - (self.window - 1))
            keys = mx.concatenate([cache.keys[..., start : cache.offset, :], k_blk], axis=2)
            values = mx.concatenate([cache.values[..., start : cache.offset, :], v_blk], axis=2)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=None)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x: mx.array, cache: KVCache) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class _BoundTarget:
    """The target's embedding and head; a plain object so they never join the drafter's weights."""

    def __init__(self, embed_tokens: nn.Module, lm_head: Any):
        self.embed_tokens, self.lm_head = embed_tokens, lm_head


class DFlashDraftModel(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self.layers = [DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self._bound: _BoundTarget | None = None

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def bind(self, target: nn.Module) -> DFlashDraftModel:
        """Borrow the target's embedding and lm_head after checking that the pair fits."""
        from dflash_server.models.target_parts import find_target_parts

        parts = find_target_parts(target)
        check_pair(self.config, parts.hidden_size, parts.vocab_size, parts.num_layers)
        self._bound = _BoundTarget(parts.embed_tokens, parts.lm_head)
        return self

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def append_context(self, target_hidden: mx.array, cache: list[KVCache]) -> None:
        """Add committed positions' tapped features (``[B, S, L*H]``) to the context cache."""
        context = self.hidden_norm(self.fc(target_hidden))
        for layer, c in zip(self.layers, cache):
            layer.self_attn.append_context(context, c)

    def __call__(
        self,
        block_ids: mx.array,
        target_hidden: mx.array | None,
        cache: list[KVCache],
        logits_start: int = 0,
    ) -> mx.array:
        """Logits for a block; ``target_hidden`` holds the taps of positions new since last call.

        Row j >= 1 predicts the token at block position j (row 0 is the committed anchor).
        """
        if self._bound is None:
            raise RuntimeError("DFlashDraftModel.bind(target) must be called before drafting")
        if target_hidden is not None and target_hidden.shape[1] > 0:
            self.append_context(target_hidden, cache)
        h = self._bound.embed_tokens(block_ids)
        for layer, c in zip(self.layers, cache):
            h = layer(h, c)
        return self._bound.lm_head(self.norm(h[:, logits_start:]))

    def propose(
        self,
        block_ids: mx.array,
        target_hidden: mx.array | None,
        cache: list[KVCache],
        sampler: TokenSampler,
        history: mx.array | None,
    ) -> tuple[mx.array, mx.array | None]:
        """Drafts for block positions 1..B-1 and the log-probs ``log q`` they were drawn from
        (None when greedy): the contract the decoder relies on, whatever the drafter family."""
        logits = self(block_ids, target_hidden, cache, logits_start=1)[0]
        return sampler.propose(logits, history)


def check_pair(config: DFlashConfig, hidden_size: int, vocab_size: int, num_layers: int) -> None:
    """Raise a ValueError naming the mismatch when a drafter does not fit a target."""
    problems = []
    if config.hidden_size != hidden_size:
        problems.append(f"hidden_size {config.hidden_size} != target's {hidden_size}")
    if not 0 <= config.mask_token_id < vocab_size:
        problems.append(
            f"mask_token_id {config.mask_token_id} outside the target's {vocab_size} rows"
        )
    if config.vocab_size != vocab_size:
        problems.append(f"vocab_size {config.vocab_size} != target's {vocab_size}")
    bad = [i for i in config.target_layer_ids if not 0 <= i < num_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} outside the target's {num_layers} layers")
    if config.num_target_layers is not None and config.num_target_layers != num_layers:
        problems.append(f"trained on a {config.num_target_layers}-layer target, got {num_layers}")
    if problems:
        raise ValueError(
            "drafter does not fit this target: "
            + "; ".join(problems)
            + ". Pick the drafter trained for this target (e.g. a 9B drafter for a 9B target)."
        )
