"""Find, download and load the served models, turning every failure into one readable line."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx

from dflash_server.adaptive.costs import CostModel
from dflash_server.drafters import registry
from dflash_server.drafters.mtp import has_mtp
from dflash_server.drafters.protocol import Drafter
from dflash_server.drafters.registry import DEFAULT_WINDOW, load_drafter
from dflash_server.drafters.suffix import SharedSuffixIndex
from dflash_server.engine.calibration import CalibrationCache
from dflash_server.engine.distributed import AgreedCalibration
from dflash_server.engine.phases import announce_kernels, phase
from dflash_server.engine.summary import ModelSummary, ServedModel, summarize
from dflash_server.generation.batch import BatchDecoder
from dflash_server.generation.kv_quant import KVQuant
from dflash_server.generation.pair import ModelPair
from dflash_server.generation.pauses import off_worker, pause, progress
from dflash_server.models.hooks import HookError
from dflash_server.models.loading import KeptTokenizer, flat_arrays, load, resolve_model_path
from dflash_server.models.vision import load_vision

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
    if repo_or_path.startswith((".", "/", "~")) or repo_or_path.count("/") < 1:
        raise ModelLoadError(
            f"{role} {repo_or_path!r}: no such folder, and not a hub id of the form 'owner/name' "
            "(or 'owner/name/folder' for a folder inside a repo)"
        )
    from huggingface_hub import errors as hf_errors

    try:
        return resolve_model_path(repo_or_path, patterns)
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
    except FileNotFoundError as exc:  # a hub repo without the folder named after its id
        raise ModelLoadError(f"{role} {repo_or_path!r}: {exc}") from exc
    except (hf_errors.HfHubHTTPError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"cannot download {role} {repo_or_path!r}: {first}") from exc


@dataclass
class LoadedModels:
    """What the worker keeps resident: the model pair, what was loaded, and where its measured
    costs are kept (by default nowhere: measured at every load)."""

    pair: ModelPair
    summary: ModelSummary
    calibration: CalibrationCache = field(default_factory=lambda: CalibrationCache(None, ""))

    @property
    def weight_bytes(self) -> int:
        """The bytes of every loaded weight: target, drafter (a drafter borrowing the target's
        head holds none of it), vision tower."""
        pair = self.pair
        modules = [pair.model, pair.draft, pair.vision.tower if pair.vision else None]
        arrays = {
            id(a): a for m in modules if m is not None for _, a in flat_arrays(m.parameters())
        }
        return sum(a.nbytes for a in arrays.values())

    @property
    def served(self) -> ServedModel:
        """What the API may see of it."""
        pair = self.pair
        return ServedModel(self.summary, pair.tokenizer, pair.vision, pair.suffix_index)


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
    kept: KeptTokenizer | None = None,
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
    vision tower are replicated); every rank calls this together. ``kept``: where the
    tokenizer is kept for the next load of this model (several models).
    """
    target_label, draft_label = target_label or target, draft_label or draft
    target_path = resolve_model(target, "target", TARGET_PATTERNS)
    announce_kernels()
    try:
        with phase("target weights loaded"):
            if group is None:  # read in pieces, so other models' passes run between them
                progress("reading the target's config and tokenizer")
                again = kept.get(target_path) if kept is not None else None
                model, tokenizer = off_worker(
                    lambda: load(str(target_path), lazy=True, tokenizer=again)
                )
                if kept is not None:
                    kept.keep(target_path, tokenizer)
                evaluate_in_pieces(model)
            else:
                model, tokenizer = load(str(target_path), group)
    except Exception as exc:  # mlx-lm raises many types; the user needs the first line
        how = f" sharded over {group.size()} ranks" if group is not None else ""
        raise ModelLoadError(
            f"cannot load target {target_label!r}{how}: {_first_line(exc)}"
        ) from exc
    tower = None
    if vision:
        progress("loading the vision tower")
        pause()
        try:
            with phase("vision tower loaded"):
                tower = load_vision(target_path)
        except Exception as exc:
            raise ModelLoadError(
                f"cannot load the vision tower of {target_label!r}: {_first_line(exc)} "
                "(--no-vision serves text only)"
            ) from exc
    drafter: Drafter | None = None
    draft_path = None
    if draft is not None:
        draft_path = target_path if draft == MTP else resolve_model(draft, "draft", DRAFT_PATTERNS)
        progress("loading the drafter")
        pause()
        try:
            with phase("drafter loaded"):
                drafter = load_drafter(
                    draft_path,
                    model,
                    window=draft_window,
                    fallback_window=DEFAULT_WINDOW,
                    family=registry.MTP if draft == MTP else None,
                )
        except Exception as exc:
            raise ModelLoadError(f"cannot use drafter {draft_label!r}: {_first_line(exc)}") from exc
    fingerprint = _fingerprint(target_path, draft_path, group)
    calibration = CalibrationCache(calibration_cache, fingerprint)
    if group is not None:  # the ranks measure together: fixed counts, all cached or none
        calibration = AgreedCalibration(group, calibration_cache, fingerprint)
    progress("checking the target's hooks")
    pause()
    try:  # install the target's hooks now: their self-check fails here, not mid-request
        with phase("target hooks installed and checked"):
            pair = ModelPair.build(
                model,
                tokenizer,
                drafter,
                vision=tower,
                lockstep=group is not None,
                store=lambda measure, widest: calibration.fetch(
                    "cycle", CostModel, measure, widest=widest
                ),
                suffix_index=None
                if suffix_cache_bytes is None
                else SharedSuffixIndex(suffix_cache_bytes),
            )
    except HookError as exc:
        raise ModelLoadError(f"cannot use target {target_label!r}: {exc}") from exc
    pause()
    costs = None
    if measure and (drafter is not None or suffix_tokens):  # without either, nothing to choose
        progress("measuring cycle costs")
        costs = pair.costs.get(suffix_tokens + 1 if suffix_tokens else 0)  # maybe read back
    summary = summarize(
        target_label,
        target_path,
        model,
        draft=None if drafter is None else (str(draft_label), draft_path or target_path, drafter),
        context_length=context_length,
        fingerprint=fingerprint,
        suffix_tokens=suffix_tokens,
        mtp_available=drafter is None and has_mtp(target_path),
        tower=tower,
        vision_asked=vision,
        cycle_costs=None if costs is None else costs.describe(),
        active_memory_gb=round(mx.get_active_memory() / 1e9, 4),
    )
    return LoadedModels(pair, summary, calibration)


# The bytes of weights read per piece: about one pass's time, so a load never holds the
# worker long (docs/design.md, "Several models").
WEIGHT_PIECE_BYTES = 64 * 2**20


def evaluate_in_pieces(
    model: Any, piece_bytes: int = WEIGHT_PIECE_BYTES, what: str = "the target's weights"
) -> None:
    """Read a lazily loaded model's weights a piece at a time, pausing between pieces."""
    arrays = [a for _, a in flat_arrays(model.parameters())]
    total = sum(a.nbytes for a in arrays) or 1
    done, piece, size = 0, [], 0
    progress(f"reading {what}")
    for array in arrays:
        piece.append(array)
        size += array.nbytes
        if size >= piece_bytes or array is arrays[-1]:
            mx.eval(piece)
            done += size
            progress(f"reading {what} ({100 * done // total}%)")
            pause()
            piece, size = [], 0


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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def make_batch(
    models: LoadedModels, max_verify: int | None, kv: KVQuant | None = None
) -> BatchDecoder:
    """The batch of the loaded pair; with the cycle costs measured at load, its pass costs too
    (from the calibration cache when this pair was measured on this machine before)."""
    # Looked up at the call: the CLI's tests slow this measurement down to catch mid-load.
    from dflash_server.adaptive.pass_costs import PassCosts
    from dflash_server.generation.calibrate_passes import measure_pass_costs

    pair = models.pair
    costs, growth = None, pair.costs.measured
    if pair.draft is not None and growth is not None:
        measure = partial(
            measure_pass_costs, pair.target, pair.draft, growth=growth, fixed=pair.costs.fixed
        )
        progress("measuring batched passes")
        costs = models.calibration.fetch("batch", PassCosts, measure)
        log.info("%s", costs.describe())
    return BatchDecoder(pair.target, max_verify, costs, kv)
