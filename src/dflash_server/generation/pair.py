"""The loaded target/drafter pair: the one owner of everything DFlash keeps per pair.

The engine builds one at load; the Python API (``stream_generate``) finds its pair through
``ModelPair.of``, made once per (model, drafter) and kept on the model, since mlx modules are
dicts (unhashable, so no WeakKeyDictionary): that is the only registry.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import mlx.nn as nn
from mlx_lm.generate import generation_stream, wired_limit
from mlx_lm.tokenizer_utils import TokenizerWrapper

from dflash_server.generation.calibrate import measure_costs
from dflash_server.generation.controller import SharedPrior
from dflash_server.generation.costs import CostModel
from dflash_server.generation.protocols import Drafter
from dflash_server.generation.suffix import SharedSuffixIndex
from dflash_server.generation.target import TargetModel
from dflash_server.models.vision import VisionTower

SUFFIX_INDEX_BYTES = 64 * 1024**2  # the shared suffix index's default budget


class WiredLimit:
    """mlx-lm's ``wired_limit`` for one model (Metal: keep weights resident; no-op on CPU), held
    by the engine for its lifetime, or by each Python API generation; the first holder sets it
    and the last restores it, so interleaved holders never restore it out of order."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.holders = model, 0
        self._context: contextlib.AbstractContextManager | None = None
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if self.holders == 0:
                # mlx-lm passes its thread-local stream where its annotation says Stream.
                streams = [generation_stream]
                self._context = wired_limit(self.model, streams)  # type: ignore[arg-type]
                self._context.__enter__()
            self.holders += 1
        try:
            yield
        finally:
            with self._lock:
                self.holders -= 1
                if self.holders == 0 and self._context is not None:
                    self._context.__exit__(None, None, None)


@dataclass
class ModelPair:
    """A target, its tokenizer, its drafter (bound to it; None: plain decoding only) and its
    vision tower (None: text only), with the per-pair state: the tapped target, the cycle
    costs "auto" decides by, the acceptance prior new requests start from, the suffix index of
    recent outputs, and the wired-memory holder."""

    model: nn.Module
    tokenizer: TokenizerWrapper
    draft: Drafter | None
    target: TargetModel
    wired: WiredLimit
    vision: VisionTower | None = None  # the checkpoint's vision tower (None: text only)
    prior: SharedPrior = field(default_factory=SharedPrior)
    measured: CostModel | None = None  # set by ``costs()``, or at load by the engine
    # Ranks of a sharded target measure together: fixed repetition counts (``measure_costs``).
    lockstep: bool = False
    suffix_index: SharedSuffixIndex = field(
        default_factory=lambda: SharedSuffixIndex(SUFFIX_INDEX_BYTES)
    )

    @classmethod
    def build(
        cls,
        model: nn.Module,
        tokenizer: TokenizerWrapper,
        draft: Drafter | None,
        wired: WiredLimit | None = None,
        vision: VisionTower | None = None,
    ) -> ModelPair:
        """Bind the drafter and install the target's hooks (their self-check raises here);
        with a vision tower, the hooks that let image prompts give their own positions."""
        if draft is not None:
            draft.bind(model)
        taps = tuple(draft.config.target_layer_ids) if draft is not None else ()
        target = TargetModel(model, taps)
        if vision is not None:
            target.place_positions()
        return cls(model, tokenizer, draft, target, wired or WiredLimit(model), vision)

    @classmethod
    def of(
        cls,
        model: nn.Module,
        tokenizer: TokenizerWrapper,
        draft: Drafter | None,
        vision: VisionTower | None = None,
    ) -> ModelPair:
        """The Python API's pair for (model, draft): built on first use, kept on the model
        (one wired-memory holder per model, whichever drafter runs with it); ``vision``, when
        given, becomes its vision tower."""
        pairs: dict[int, ModelPair] = model.__dict__.setdefault("_dflash_pairs", {})
        pair = pairs.get(id(draft))
        if pair is None or pair.draft is not draft:
            wired = next(iter(pairs.values())).wired if pairs else None
            pair = pairs[id(draft)] = cls.build(model, tokenizer, draft, wired)
        else:
            if draft is not None:
                draft.bind(model)  # cheap; the caller may have rebound it elsewhere
            pair.tokenizer = tokenizer
        if vision is not None and pair.vision is not vision:
            pair.target.place_positions()
            pair.vision = vision
        return pair

    def costs(self, widest: int = 0) -> CostModel:
        """The pair's cycle costs, measured on first use (the engine measures at load, so
        requests never wait for it), again when a verify up to ``widest`` positions (suffix
        copies) was not measured yet. Without a drafter: plain steps and verify-only cycles."""
        if self.measured is None or max(self.measured.verify) < widest:
            self.measured = measure_costs(
                self.model, self.draft, widest=widest, fixed=self.lockstep
            )
        return self.measured
