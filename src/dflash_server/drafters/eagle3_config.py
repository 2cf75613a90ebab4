"""``Eagle3Config``: an EAGLE-3 head's ``config.json`` in either published layout (RedHat's
speculators, SpecForge's / the EAGLE repository's), and the default taps (docs/design.md,
"Drafter families")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_BLOCK = 8  # the widest verify (1 + drafts) when the checkpoint names no depth
FIT = "use the speculator trained for this target (speculators_config.verifier names it)"


def default_taps(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's aux layers (2, L/2, L-3), as the outputs of the layers before them."""
    return (1, num_layers // 2 - 1, num_layers - 4)


@dataclass
class Eagle3Config:
    """The head's layer (the checkpoint's Llama / Qwen3 keys) and its EAGLE-3 options."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's: drafts are target ids
    draft_vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    num_hidden_layers: int = 1
    attention_bias: bool = False
    qk_norm: bool = False  # a Qwen3 layer: per-head q_norm / k_norm
    target_hidden_size: int | None = None  # None: hidden_size
    taps: tuple[int, ...] | None = None  # target layers read (outputs); None: EAGLE's default
    num_taps: int = 3
    norm_before_residual: bool = False  # the first layer's residual is hidden_norm(g)
    norm_before_fc: bool = False  # one RMSNorm over the joined taps (input_norm)
    fc_norm: bool = False  # one RMSNorm per tap (EAGLE 3.1)
    feed_normed: bool = False  # speculators' norm_output: the next step reads norm(o)
    norm_logits: bool = True  # SpecForge's norm_output: lm_head reads norm(o)
    own_embedding: bool = False  # the checkpoint carries embed_tokens
    block_size: int = DEFAULT_BLOCK
    mask_token_id: int = 0  # block positions after the anchor are never read
    depth: int | None = None  # the target's layer count, set by bind (the default taps follow it)

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        if self.taps is not None:
            return self.taps
        if self.depth is None:
            raise RuntimeError("an EAGLE-3 head's default taps follow its target: bind it first")
        return default_taps(self.depth)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], names: Sequence[str] = ()) -> Eagle3Config:
        """Either layout: speculators' (``transformer_layer_config``, aux ids naming layer
        inputs) or SpecForge's (flat Llama keys, ``eagle_config`` ids naming outputs);
        ``names``: the checkpoint's tensors (whether it carries an embedding)."""
        if "transformer_layer_config" in raw:  # speculators
            layer = raw["transformer_layer_config"]
            aux = raw.get("eagle_aux_hidden_state_layer_ids")
            if aux and 0 in aux:
                raise ValueError(
                    "EAGLE-3 config: eagle_aux_hidden_state_layer_ids include 0, the target's "
                    "embedding output, which this server cannot tap (it taps layer outputs): "
                    "use a speculator trained on layers 1 and up"
                )
            taps = tuple(int(i) - 1 for i in aux) if aux else None
            spec = raw.get("speculators_config") or {}
            methods = spec.get("proposal_methods") or [{}]
            named = spec.get("default_proposal_method")
            method = next((m for m in methods if m.get("proposal_type") == named), methods[0])
            tokens = method.get("speculative_tokens")
            block = int(tokens) + 1 if tokens else DEFAULT_BLOCK
            options = {"feed_normed": bool(raw.get("norm_output", False)), "norm_logits": True}
        else:  # SpecForge / the EAGLE repository
            layer = raw
            ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            taps, aux = (tuple(int(i) for i in ids), ids) if ids else (None, None)
            block = int(raw.get("block_size", DEFAULT_BLOCK))  # no key of its own: ours
            options = {"feed_normed": False, "norm_logits": bool(raw.get("norm_output", True))}
        missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size",
                               "vocab_size") if k not in layer]  # fmt: skip
        if missing:
            raise ValueError(f"EAGLE-3 config.json is missing required keys: {missing}")
        if layer.get("hidden_act", "silu") != "silu" or layer.get("mlp_bias"):
            raise ValueError("EAGLE-3 config: only a SiLU MLP without bias is supported")
        if "sliding_attention" in (layer.get("layer_types") or []):
            raise ValueError("EAGLE-3 config: sliding-window layers are not supported")
        rope = layer.get("rope_parameters") or layer.get("rope_scaling") or None
        theta = layer.get("rope_theta", (rope or {}).get("rope_theta", 10000.0))
        heads, hidden = int(layer["num_attention_heads"]), int(layer["hidden_size"])
        config = cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
            head_dim=int(layer.get("head_dim") or hidden // heads),
            intermediate_size=int(layer["intermediate_size"]),
            vocab_size=int(layer["vocab_size"]),
            draft_vocab_size=int(raw.get("draft_vocab_size") or layer["vocab_size"]),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=rope if rope and rope.get("rope_type", rope.get("type")) else None,
            max_position_embeddings=int(layer.get("max_position_embeddings", 4096)),
            num_hidden_layers=int(layer.get("num_hidden_layers", 1)),
            attention_bias=bool(layer.get("attention_bias", False)),
            qk_norm=layer.get("model_type") == "qwen3",
            target_hidden_size=raw.get("target_hidden_size"),
            taps=taps,
            num_taps=len(aux) if aux else 3,
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
            norm_before_fc=bool(raw.get("norm_before_fc", False)),
            fc_norm=bool(raw.get("fc_norm", False)),
            own_embedding="embed_tokens.weight" in names,
            block_size=block,
            **options,
        )
        if config.block_size < 2:
            raise ValueError(f"EAGLE-3 config: {config.block_size - 1} speculative tokens (>= 1)")
        return config
