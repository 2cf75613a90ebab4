"""What was loaded, said once: the ``ModelSummary`` the startup log, /health, /v1/models and the
prompt checks read, and the ``ServedModel`` the API sees of a loaded model (its tokenizer, vision
tower and summary; never the pair inside)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mlx_lm.tokenizer_utils import TokenizerWrapper

from dflash_server.drafters.protocol import Drafter
from dflash_server.drafters.suffix import SharedSuffixIndex
from dflash_server.drafters.window import SINKS
from dflash_server.models.loading import flat_arrays
from dflash_server.models.vision import VisionTower

DEFAULT_CONTEXT = 32768


@dataclass(frozen=True)
class ModelSummary:
    """What was loaded, as the startup log, /health, /v1/models and the prompt checks read it."""

    target: str
    target_type: str
    target_weights_gb: float
    target_quantization: str
    vocab_size: int | None
    context_length: int
    fingerprint: str  # identifies the pair's state on disk (prefix cache)
    active_memory_gb: float = 0.0
    draft: str | None = None
    draft_family: str | None = None
    draft_weights_gb: float | None = None
    draft_quantization: str | None = None
    draft_layers: int | None = None
    block_size: int | None = None  # the drafter's trained block
    target_layer_ids: tuple[int, ...] = ()
    draft_window: int | None = None
    cycle_costs: str | None = None  # the measured cost curve, described
    suffix_drafts: bool = False  # copies from the context may be verified
    suffix_tokens: int = 0  # the widest copy (its verify writes one position more)
    mtp_available: bool = False  # no drafter, but the target checkpoint carries an MTP head
    vision: bool = False  # prompts may hold images (the checkpoint's vision tower is loaded)
    vision_note: str = "text only"  # what the startup log says about images

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if v is not None}
        out["target_layer_ids"] = list(self.target_layer_ids)
        return out


@dataclass(frozen=True)
class ServedModel:
    """What the API may know of a loaded model: its tokenizer (prompts, tool grammars, token
    names), vision tower (images; None: text only), summary, and its suffix index's size."""

    summary: ModelSummary
    tokenizer: TokenizerWrapper
    vision: VisionTower | None
    suffix_index: SharedSuffixIndex


def summarize(
    target_label: str,
    target_path: Path,
    model: Any,
    *,
    draft: tuple[str, Path, Drafter] | None,
    context_length: int | None,
    fingerprint: str,
    suffix_tokens: int,
    mtp_available: bool,
    tower: VisionTower | None,
    vision_asked: bool,
    cycle_costs: str | None,
    active_memory_gb: float,
) -> ModelSummary:
    """The summary of a loaded target (and drafter: its label, folder and the drafter)."""
    config = _read_config(target_path)
    model_ctx = _model_context(config) or DEFAULT_CONTEXT
    drafted: dict[str, Any] = {}
    if draft is not None:
        label, folder, drafter = draft
        drafted = dict(
            draft=label,
            draft_family=drafter.family,
            draft_weights_gb=round(_weights_gb(drafter), 4),
            draft_quantization=_quant(_read_config(folder)),
            draft_layers=int(drafter.config.num_hidden_layers),
            block_size=int(drafter.config.block_size),
            target_layer_ids=tuple(drafter.config.target_layer_ids),
            draft_window=drafter.window,
        )
    return ModelSummary(
        target=target_label,
        target_type=config.get("model_type", "?"),
        target_weights_gb=round(_weights_gb(model), 4),
        target_quantization=_quant(config),
        vocab_size=_vocab_size(config),
        context_length=min(context_length, model_ctx) if context_length else model_ctx,
        fingerprint=fingerprint,
        active_memory_gb=active_memory_gb,
        cycle_costs=cycle_costs,
        suffix_drafts=bool(suffix_tokens),
        suffix_tokens=suffix_tokens,
        mtp_available=mtp_available,
        vision=tower is not None,
        vision_note=_vision_note(tower, config, vision_asked),
        **drafted,
    )


def _read_config(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def _model_context(config: dict[str, Any]) -> int | None:
    for cfg in (config, config.get("text_config") or {}):
        value = cfg.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    return None


def _weights_gb(module: Any) -> float:
    return sum(v.nbytes for _, v in flat_arrays(module.parameters())) / 1e9


def _vocab_size(config: dict[str, Any]) -> int | None:
    for cfg in (config, config.get("text_config") or {}):
        if isinstance(cfg.get("vocab_size"), int):
            return cfg["vocab_size"]
    return None


def _quant(config: dict[str, Any]) -> str:
    q = config.get("quantization") or config.get("quantization_config")
    if not q:
        return "unquantized"
    return f"{q.get('bits', '?')}-bit (group {q.get('group_size', '?')})"


def _vision_note(tower: VisionTower | None, config: dict[str, Any], asked: bool) -> str:
    if tower is not None:
        return f"takes images (vision tower: {_size(_weights_gb(tower.tower))} weights)"
    if config.get("vision_config") and not asked:
        return "text only (--no-vision)"
    return "text only (the checkpoint has no vision tower; mlx-lm conversions drop it)"


def _size(gb: float) -> str:
    return f"{gb:.2f} GB" if gb >= 0.1 else f"{gb * 1000:.1f} MB"


def describe(summary: ModelSummary) -> str:
    """One startup log line per model, so users see exactly what they are serving."""
    s = summary
    lines = [
        f"target {s.target}: {s.target_type}, {_size(s.target_weights_gb)} weights, "
        f"{s.target_quantization}, context {s.context_length}"
    ]
    if s.draft is not None:
        lines.append(
            f"draft {s.draft}: {s.draft_family}, {s.draft_layers} layers, "
            f"{_size(s.draft_weights_gb or 0.0)} weights, {s.draft_quantization}, "
            f"block size {s.block_size}, taps {s.target_layer_ids}"
        )
        window = s.draft_window
        lines.append(
            "draft context: "
            + (f"{window} positions ({SINKS} sinks + newest)" if window else "the whole context")
        )
        if s.cycle_costs:
            lines.append(s.cycle_costs)
    else:
        decoding = "suffix drafts and plain decoding" if s.suffix_drafts else "plain decoding"
        lines.append(f"no drafter: {decoding}")
        if s.mtp_available:  # say so, never switch silently
            lines.append("this checkpoint carries an MTP head: --draft mtp drafts with it")
        if s.cycle_costs:  # suffix copies still run: verify-only cycles
            lines.append(s.cycle_costs)
    lines.append(f"vision: {s.vision_note}")
    lines.append(f"MLX active memory after load: {_size(s.active_memory_gb)}")
    return "\n".join(lines)
