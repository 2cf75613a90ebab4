"""Find, download and load the served models, turning every failure into one readable line."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


class ModelLoadError(RuntimeError):
    """A model could not be found, downloaded or loaded; the message is one actionable line."""


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
class LoadedModels:
    """What the worker keeps resident: target, tokenizer, optional drafter, and a summary."""

    model: Any
    tokenizer: Any
    draft: Any | None
    context_length: int
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def draft_block_size(self) -> int | None:
        return None if self.draft is None else int(self.draft.config.block_size)


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
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(module.parameters())) / 1e9


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
) -> LoadedModels:
    """Load target (+ drafter, bound to it). Runs on the engine's worker thread: it is MLX work.

    ``target``/``draft`` may be hub ids or folders; the labels (the user's spelling, when the
    CLI already resolved them to cache folders) are what the logs and /health show.
    ``draft_window``: the drafter's context window (None: its config's, else
    ``DEFAULT_WINDOW``; 0: the whole context). ``measure``: time the cycle costs that
    ``block_size: "auto"`` decides by (a second or two), now rather than at the first request.
    """
    import mlx.core as mx

    from dflash_server import load, load_draft

    target_label, draft_label = target_label or target, draft_label or draft
    target_path = resolve_model(target, "target", TARGET_PATTERNS)
    try:
        model, tokenizer = load(str(target_path))
    except Exception as exc:  # mlx-lm raises many types; the user needs the first line
        raise ModelLoadError(f"cannot load target {target_label!r}: {_first_line(exc)}") from exc
    target_cfg = _read_config(target_path)
    summary: dict[str, Any] = {
        "target": target_label,
        "target_weights_gb": round(_weights_gb(model), 4),
        "target_quantization": _quant(target_cfg),
        "target_type": target_cfg.get("model_type", "?"),
        "vocab_size": _vocab_size(target_cfg),
    }
    drafter = None
    if draft is not None:
        draft_path = resolve_model(draft, "draft", DRAFT_PATTERNS)
        try:
            drafter = load_draft(str(draft_path))
            drafter.bind(model)
        except Exception as exc:
            raise ModelLoadError(f"cannot use drafter {draft_label!r}: {_first_line(exc)}") from exc
        draft_cfg = _read_config(draft_path)
        summary.update(
            draft=draft_label,
            draft_weights_gb=round(_weights_gb(drafter), 4),
            draft_quantization=_quant(draft_cfg),
            block_size=int(drafter.config.block_size),
            draft_layers=int(drafter.config.num_hidden_layers),
            draft_family=drafter.family,
            target_layer_ids=list(drafter.config.target_layer_ids),
        )
    from dflash_server.generation.target import TargetModel
    from dflash_server.models.hooks import HookError

    try:  # install the target's hooks now: their self-check fails here, not mid-request
        TargetModel.of(model, tuple(drafter.config.target_layer_ids) if drafter else ())
    except HookError as exc:
        raise ModelLoadError(f"cannot use target {target_label!r}: {exc}") from exc
    if drafter is not None:
        from dflash_server.generation.costs import costs_for
        from dflash_server.models.window import DEFAULT_WINDOW, apply_draft_window, default_window

        if draft_window is None:
            draft_window = default_window(drafter) or DEFAULT_WINDOW
        summary["draft_window"] = apply_draft_window(drafter, draft_window)
        if measure:
            summary["cycle_costs"] = costs_for(model, drafter).describe()
    summary["fingerprint"] = _fingerprint(target_path, draft_path if draft else None)
    model_ctx = _model_context(target_cfg) or DEFAULT_CONTEXT
    ctx = min(context_length, model_ctx) if context_length else model_ctx
    summary["context_length"] = ctx
    summary["active_memory_gb"] = round(mx.get_active_memory() / 1e9, 4)
    return LoadedModels(model, tokenizer, drafter, ctx, summary)


def _fingerprint(target: Path, draft: Path | None) -> str:
    """What identifies the loaded pair's state: both configs and weight files (name, size,
    mtime), so a changed or swapped model never reuses a prefix cache entry on disk."""
    import hashlib

    h = hashlib.sha256()
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


def models_fingerprint(models: LoadedModels) -> str:
    return str(models.summary.get("fingerprint", ""))


def _size(gb: float) -> str:
    return f"{gb:.2f} GB" if gb >= 0.1 else f"{gb * 1000:.1f} MB"


def describe(summary: dict[str, Any]) -> str:
    """One startup log line per model, so users see exactly what they are serving."""
    from dflash_server.models.window import SINKS

    lines = [
        f"target {summary['target']}: {summary['target_type']}, "
        f"{_size(summary['target_weights_gb'])} weights, {summary['target_quantization']}, "
        f"context {summary['context_length']}"
    ]
    if "draft" in summary:
        lines.append(
            f"draft {summary['draft']}: {summary['draft_family']}, "
            f"{summary['draft_layers']} layers, "
            f"{_size(summary['draft_weights_gb'])} weights, {summary['draft_quantization']}, "
            f"block size {summary['block_size']}, taps {summary['target_layer_ids']}"
        )
        window = summary.get("draft_window")
        lines.append(
            "draft context: "
            + (f"{window} positions ({SINKS} sinks + newest)" if window else "the whole context")
        )
        if "cycle_costs" in summary:
            lines.append(summary["cycle_costs"])
    else:
        lines.append("no drafter: plain (non-speculative) decoding")
    lines.append(f"MLX active memory after load: {_size(summary['active_memory_gb'])}")
    return "\n".join(lines)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
