"""Find, download and load the served models, turning every failure into one readable line."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx

from dflash_server.engine.calibration import CalibrationCache
from dflash_server.engine.distributed import AgreedCalibration
from dflash_server.generation.batch import BatchDecoder
from dflash_server.generation.costs import CostModel
from dflash_server.generation.kv_quant import KVQuant
from dflash_server.generation.pair import ModelPair
from dflash_server.generation.suffix import SharedSuffixIndex
from dflash_server.models.hooks import HookError
from dflash_server.models.loading import flat_arrays, has_mtp, load, load_draft, load_mtp
from dflash_server.models.vision import VisionTower, load_vision
from dflash_server.models.window import DEFAULT_WINDOW, SINKS, default_window

log = logging.getLogger("dflash_server")

# The files mlx-lm itself fetches for a target; drafters need only weights and config.
TARGET_PATTERNS = [
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]
DRAFT_PATTERNS = ["*.json", "*.safetensors"]
DEFAULT_CONTEXT = 32768
MTP = "mtp"  # --draft mtp: the target checkpoint's own MTP head


class ModelLoadError(RuntimeError):
    """A model could not be found, downloaded or loaded; the message is one actionable line."""


def resolve_draft(drafter: str | None) -> str | None:
    """The drafter's local folder (downloaded now); ``"mtp"`` and no drafter as they are."""
    if drafter is None or drafter == MTP:
        return drafter
    return str(resolve_model(drafter, "draft", DRAFT_PATTERNS))


def resolve_model(repo_or_path: str, role: str, patterns: list[str]) -> Path:
    """Return a local folder for ``repo_or_path``, downloading from the hub (with progress)."""
    path = Path(repo_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"{role} {repo_or_path!r} is a file; pass the model's folder")
        return path
    if repo_or_path.startswith((".", "/", "~")) or repo_or_path.count("/") != 1:
        raise ModelLoadError(
            f"{role} {repo_or_path!r}: no such folder, and not a hub id of the form 'owner/name'"
        )
    from huggingface_hub import errors as hf_errors
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_or_path, allow_patterns=patterns))
    except hf_errors.GatedRepoError as exc:
        raise ModelLoadError(
            f"{role} {repo_or_path!r} is gated: accept its terms on huggingface.co, then "
            "`hf auth login`"
        ) from exc
    except hf_errors.RepositoryNotFoundError as exc:
        raise ModelLoadError(
            f"{role} {repo_or_path!r} was not found on the Hugging Face Hub: check the id "
            "(private repos need `hf auth login`) or pass a local folder"
        ) from exc
    except hf_errors.LocalEntryNotFoundError as exc:
        raise ModelLoadError(
            f"cannot download {role} {repo_or_path!r}: the hub is unreachable and the model is "
            "not in the local cache; connect once, or pass a local folder"
        ) from exc
    except (hf_errors.HfHubHTTPError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"cannot download {role} {repo_or_path!r}: {first}") from exc


@dataclass
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
    target_layer_ids: list[int] = field(default_factory=list)
    draft_window: int | None = None
    cycle_costs: str | None = None  # the measured cost curve, described
    suffix_drafts: bool = False  # copies from the context may be verified
    suffix_tokens: int = 0  # the widest copy (its verify writes one position more)
    mtp_available: bool = False  # no drafter, but the target checkpoint carries an MTP head
    vision: bool = False  # prompts may hold images (the checkpoint's vision tower is loaded)
    vision_note: str = "text only"  # what the startup log says about images

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class LoadedModels:
    """What the worker keeps resident: the model pair, what was loaded, and where its measured
    costs are kept (by default nowhere: measured at every load)."""

    pair: ModelPair
    summary: ModelSummary
    calibration: CalibrationCache = field(default_factory=lambda: CalibrationCache(None, ""))


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


def load_models(
    target: str,
    draft: str | None,
    context_length: int | None = None,
    *,
    target_label: str | None = None,
    draft_label: str | None = None,
    draft_window: int | None = None,
    measure: bool = True,
    suffix_tokens: int = 0,
    suffix_cache_bytes: int | None = None,
    calibration_cache: str | Path | None = None,
    vision: bool = True,
    group: Any = None,
) -> LoadedModels:
    """Load target (+ drafter, bound to it). Runs on the engine's worker thread: it is MLX work.

    ``target``/``draft`` may be hub ids or folders; the labels (the user's spelling, when the
    CLI already resolved them to cache folders) are what the logs and /health show.
    ``draft_window``: the drafter's context window (None: its config's, else
    ``DEFAULT_WINDOW``; 0: the whole context). ``measure``: time the cycle costs that
    ``block_size: "auto"`` decides by (a second or two), now rather than at the first request;
    ``suffix_tokens``: suffix copies of up to so many tokens will run (their verify widths are
    measured too, with no drafter as well); ``suffix_cache_bytes``: their shared index's budget;
    ``calibration_cache``: the folder where measured costs are kept for the next load (None:
    measure every time); ``vision``: load the checkpoint's vision tower, if it has one.
    ``group``: the MLX distributed group to tensor-shard the target over (the drafter and the
    vision tower are replicated); every rank calls this together.
    """
    target_label, draft_label = target_label or target, draft_label or draft
    target_path = resolve_model(target, "target", TARGET_PATTERNS)
    try:
        model, tokenizer = load(str(target_path), group)
    except Exception as exc:  # mlx-lm raises many types; the user needs the first line
        how = f" sharded over {group.size()} ranks" if group is not None else ""
        raise ModelLoadError(
            f"cannot load target {target_label!r}{how}: {_first_line(exc)}"
        ) from exc
    target_cfg = _read_config(target_path)
    tower = None
    if vision:
        try:
            tower = load_vision(target_path)
        except Exception as exc:
            raise ModelLoadError(
                f"cannot load the vision tower of {target_label!r}: {_first_line(exc)} "
                "(--no-vision serves text only)"
            ) from exc
    drafter: Any = None
    draft_cfg: dict[str, Any] = {}
    draft_path = None
    if draft is not None:
        draft_path = target_path if draft == MTP else resolve_model(draft, "draft", DRAFT_PATTERNS)
        draft_cfg = _read_config(draft_path)
        try:
            if draft == MTP or str(draft_cfg.get("model_type", "")).endswith("_mtp"):
                drafter = load_mtp(draft_path, model)
            else:
                drafter = load_draft(str(draft_path))
                drafter.bind(model)
        except Exception as exc:
            raise ModelLoadError(f"cannot use drafter {draft_label!r}: {_first_line(exc)}") from exc
    try:  # install the target's hooks now: their self-check fails here, not mid-request
        pair = ModelPair.build(model, tokenizer, drafter, vision=tower)
    except HookError as exc:
        raise ModelLoadError(f"cannot use target {target_label!r}: {exc}") from exc
    model_ctx = _model_context(target_cfg) or DEFAULT_CONTEXT
    summary = ModelSummary(
        target=target_label,
        target_type=target_cfg.get("model_type", "?"),
        target_weights_gb=round(_weights_gb(model), 4),
        target_quantization=_quant(target_cfg),
        vocab_size=_vocab_size(target_cfg),
        context_length=min(context_length, model_ctx) if context_length else model_ctx,
        fingerprint=_fingerprint(target_path, draft_path, group),
        suffix_drafts=bool(suffix_tokens),
        suffix_tokens=suffix_tokens,
        mtp_available=drafter is None and has_mtp(target_path),
        vision=tower is not None,
        vision_note=_vision_note(tower, target_cfg, vision),
    )
    if drafter is not None:
        if draft_window is None:
            draft_window = default_window(drafter) or DEFAULT_WINDOW
        summary.draft = draft_label
        summary.draft_family = drafter.family
        summary.draft_weights_gb = round(_weights_gb(drafter), 4)
        summary.draft_quantization = _quant(draft_cfg)
        summary.draft_layers = int(drafter.config.num_hidden_layers)
        summary.block_size = int(drafter.config.block_size)
        summary.target_layer_ids = list(drafter.config.target_layer_ids)
        summary.draft_window = drafter.set_window(draft_window)
    calibration = CalibrationCache(calibration_cache, summary.fingerprint)
    if group is not None:  # the ranks measure together: fixed counts, all cached or none
        calibration = AgreedCalibration(group, calibration_cache, summary.fingerprint)
        pair.lockstep = True
    if measure and (drafter is not None or suffix_tokens):  # without either, nothing to choose
        widest = suffix_tokens + 1 if suffix_tokens else 0
        measured = calibration.fetch("cycle", CostModel, partial(pair.costs, widest), widest=widest)
        pair.measured = measured  # a cached one skips measuring
        summary.cycle_costs = measured.describe()
    if suffix_cache_bytes is not None:
        pair.suffix_index = SharedSuffixIndex(suffix_cache_bytes)
    summary.active_memory_gb = round(mx.get_active_memory() / 1e9, 4)
    return LoadedModels(pair, summary, calibration)


def _fingerprint(target: Path, draft: Path | None, group: Any = None) -> str:
    """What identifies the loaded pair's state: both configs and weight files (name, size,
    mtime), so a changed or swapped model never reuses a prefix cache entry on disk; sharded,
    the rank and the number of ranks too (a rank's state is its shard's)."""
    import hashlib

    h = hashlib.sha256()
    if group is not None:
        h.update(f"rank {group.rank()} of {group.size()}".encode())
    for folder in (target, draft):
        if folder is None:
            h.update(b"no drafter")
            continue
        for f in sorted(folder.glob("*.json")) + sorted(folder.glob("*.safetensors")):
            stat = f.stat()
            h.update(f"{f.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
            if f.suffix == ".json":
                h.update(f.read_bytes())
    return h.hexdigest()[:32]


def _vision_note(tower: VisionTower | None, config: dict[str, Any], asked: bool) -> str:
    if tower is not None:
        return f"takes images (vision tower: {_size(_weights_gb(tower.tower))} weights)"
    if config.get("vision_config") and not asked:
        return "text only (--no-vision)"
    return "text only (the checkpoint has no vision tower)"


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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def make_batch(
    models: LoadedModels, max_verify: int | None, kv: KVQuant | None = None
) -> BatchDecoder:
    """The batch of the loaded pair; with the cycle costs measured at load, its pass costs too
    (from the calibration cache when this pair was measured on this machine before)."""
    from dflash_server.generation.batch_budget import PassCosts, measure_pass_costs

    pair = models.pair
    costs = None
    if pair.draft is not None and pair.measured is not None:
        measure = partial(
            measure_pass_costs, pair.target, pair.draft, growth=pair.measured, fixed=pair.lockstep
        )
        costs = models.calibration.fetch("batch", PassCosts, measure)
        log.info("%s", costs.describe())
    return BatchDecoder(pair.target, max_verify, costs, kv)
