"""``DFlashConfig``, and ``config.json`` parsing for every drafter family the loader knows.

Each parser returns the keyword arguments of its config dataclass and raises a ValueError naming
the first missing key. Layouts seen in the wild:

* DFlash (``DFlashDraftModel``): flat model keys plus ``dflash_config`` (taps, mask id, sometimes
  ``block_size``); theta at the top level or in ``rope_parameters``; optional sliding layers.
* DFlash2 (``DFlash2DraftModel``): the same plus conv/selector keys inside ``dflash_config``.
* "assistant" exports (``*AssistantModel``, e.g. Muse-Glimmer-30B-assistant): DFlash weights
  under other names and a flat config (``block_size``, ``mask_token_id``, ``target_layer_ids`` at
  the top level, often no ``vocab_size``); their sliding layers still run bidirectionally.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

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
# Keys a config may omit, with the value that means "absent" (``to_dict`` leaves them out).
OPTIONAL_DEFAULTS: dict[str, Any] = {
    "is_causal": None,
    "sliding_window_size": None,
    "output_multiplier": 1.0,
    "final_logit_softcapping": None,
    "input_embedding_scale": 1.0,
}
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def softcap(value: Any) -> float | None:
    """``final_logit_softcapping``: a positive cap, or None (absent, null or 0 all mean off)."""
    return float(value) if value is not None and float(value) > 0 else None


def target_logit_scale(target: Any) -> tuple[float, float | None] | None:
    """The target's own ``(output_multiplier, final_logit_softcapping)``, if its args carry one."""
    args = getattr(getattr(target, "language_model", target), "args", None)
    multiplier = getattr(args, "output_multiplier", None)
    if multiplier is None:
        return None
    return float(multiplier), softcap(getattr(args, "final_logit_softcapping", None))


def _missing(cfg: dict[str, Any], keys: tuple[str, ...], where: str = "") -> None:
    missing = [k for k in keys if k not in cfg]
    if missing:
        raise ValueError(
            f"drafter config.json is missing required key(s): "
            f"{', '.join(where + k for k in missing)}"
        )


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> tuple[int, ...]:
    """Taps spread over the target's depth, as the reference trainer picks them."""
    if num_taps == 1:
        return (num_target_layers // 2,)
    step = (num_target_layers - 4) / (num_taps - 1)
    return tuple(round(1 + i * step) for i in range(num_taps))


def dflash_kwargs(cfg: dict[str, Any], *, need_vocab: bool = True) -> dict[str, Any]:
    """The keys every family shares (``DFlashConfig``'s fields), from a raw ``config.json``."""
    _missing(cfg, tuple(k for k in _REQUIRED_KEYS if need_vocab or k != "vocab_size"))
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

    def key(name: str, default: Any = None) -> Any:  # dflash_config first, then the top level
        return dflash.get(name, cfg.get(name, default))

    # Top-level ``is_causal`` (HF configs); some converters write ``dflash_config.causal``.
    causal = cfg.get("is_causal", dflash.get("is_causal", dflash.get("causal")))

    return dict(
        hidden_size=cfg["hidden_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        intermediate_size=cfg["intermediate_size"],
        vocab_size=cfg.get("vocab_size"),
        rms_norm_eps=cfg["rms_norm_eps"],
        rope_theta=float(rope_theta),
        max_position_embeddings=cfg["max_position_embeddings"],
        block_size=int(key("block_size", 16)),
        target_layer_ids=tuple(layer_ids),
        num_target_layers=num_target_layers,
        mask_token_id=int(key("mask_token_id")),
        rope_scaling=rope_scaling,
        layer_types=tuple(cfg.get("layer_types") or ()),
        sliding_window=cfg.get("sliding_window"),
        sliding_window_size=key("sliding_window_size"),
        is_causal=None if causal is None else bool(causal),
        output_multiplier=float(key("output_multiplier", 1.0)),
        final_logit_softcapping=softcap(key("final_logit_softcapping")),
        input_embedding_scale=float(key("input_embedding_scale", 1.0)),
    )


def assistant_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    """An "assistant" export: flat keys, vocab optional (checked against the target's at bind),
    always bidirectional in the block whatever its ``layer_types`` say (the reference forces it)."""
    for name in ("mask_token_id", "target_layer_ids"):
        if name not in cfg and name not in (cfg.get("dflash_config") or {}):
            raise ValueError(f"assistant drafter config.json is missing required key: {name}")
    return {**dflash_kwargs(cfg, need_vocab=False), "is_causal": False}


def dflash2_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    """DFlash2's extra keys, all inside ``dflash_config``; ``block_size`` is required there or at
    the top level (published DFlash2 drafters use 8 or 16, so no default is safe)."""
    dflash = cfg.get("dflash_config")
    if not isinstance(dflash, dict):
        raise ValueError("DFlash2 drafter config.json is missing required key: dflash_config")
    _missing(dflash, DFLASH2_KEYS, "dflash_config.")
    if "block_size" not in dflash and "block_size" not in cfg:
        raise ValueError("DFlash2 drafter config.json is missing required key: block_size")
    return {**dflash_kwargs(cfg), **{k: int(dflash[k]) for k in DFLASH2_KEYS}}


def check_pair(config: Any, hidden_size: int, vocab_size: int, num_layers: int) -> None:
    """Raise a ValueError naming the mismatch when a drafter does not fit a target."""
    problems = []
    if config.hidden_size != hidden_size:
        problems.append(f"hidden_size {config.hidden_size} != target's {hidden_size}")
    if not 0 <= config.mask_token_id < vocab_size:
        problems.append(
            f"mask_token_id {config.mask_token_id} outside the target's {vocab_size} rows"
        )
    if config.vocab_size is not None and config.vocab_size != vocab_size:
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


@dataclass
class DFlashConfig:
    """Drafter hyper-parameters; field names follow the reference ``dflash.model_mlx``."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int | None  # None (some assistant exports): the target's, checked at bind
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
    sliding_window_size: int | None = None  # a context window for every layer (reference key)
    # None: the family's rule (DFlash: bidirectional block; DFlash2: causal on sliding layers).
    is_causal: bool | None = None
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0

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
        if self.sliding_window is not None and self.sliding_window < 2:
            raise ValueError(
                f"drafter config: sliding_window must be >= 2, not {self.sliding_window}"
            )

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> DFlashConfig:
        """Parse a drafter ``config.json`` (flat keys plus nested ``dflash_config``)."""
        return cls(**dflash_kwargs(cfg))

    def to_dict(self) -> dict[str, Any]:
        """The HF-style ``config.json`` this config was (or could have been) read from."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        dflash = {"target_layer_ids": list(out.pop("target_layer_ids"))}
        dflash["mask_token_id"] = out.pop("mask_token_id")
        out["layer_types"] = list(out["layer_types"])
        for name, default in OPTIONAL_DEFAULTS.items():  # published v1 configs omit these
            if out.get(name) == default:
                out.pop(name)
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            **out,
            "dflash_config": dflash,
        }
