"""The loaded target/drafter pair: the one owner of everything DFlash keeps per pair.

The engine builds one at load, whole; the Python API (``stream_generate``) finds its pair
through ``ModelPair.of``, made once per (model, drafter) and kept on the model, since mlx
modules are dicts (unhashable, so no WeakKeyDictionary): that is the only registry.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial

import mlx.nn as nn
from mlx_lm.generate import generation_stream, wired_limit
from mlx_lm.tokenizer_utils import TokenizerWrapper

from dflash_server.adaptive.controller import SharedPrior
from dflash_server.adaptive.costs import CostModel
from dflash_server.drafters.protocol import Drafter
from dflash_server.drafters.suffix import SharedSuffixIndex
from dflash_server.generation.calibrate import measure_costs
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


# Where measured costs are kept (the engine's calibration cache): given how to measure them
# and the widest verify wanted, it returns the costs, read back or measured.
CostStore = Callable[[Callable[[], CostModel], int], CostModel]


class PairCosts:
    """The pair's cycle costs, which "auto" decides by: given at build, else measured on first
    use (through ``store``, which may read them back instead); measured again when a verify
    wider than measured is asked for (suffix copies). Shared by the views of a pair."""

    def __init__(
        self,
        model: nn.Module,
        draft: Drafter | None,
        *,
        measured: CostModel | None = None,
        fixed: bool = False,
        store: CostStore | None = None,
    ) -> None:
        self.model, self.draft, self.fixed, self.store = model, draft, fixed, store
        self.measured = measured

    def get(self, widest: int = 0) -> CostModel:
        if self.measured is None or max(self.measured.verify) < widest:
            measure = partial(
                measure_costs, self.model, self.draft, widest=widest, fixed=self.fixed
            )
            self.measured = measure() if self.store is None else self.store(measure, widest)
        return self.measured


@dataclass(frozen=True)
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
    costs: PairCosts
    vision: VisionTower | None = None
    prior: SharedPrior = field(default_factory=SharedPrior)
    suffix_index: SharedSuffixIndex = field(
        default_factory=lambda: SharedSuffixIndex(SUFFIX_INDEX_BYTES)
    )

    @classmethod
    def build(
        cls,
        model: nn.Module,
        tokenizer: TokenizerWrapper,
        draft: Drafter | None,
        *,
        vision: VisionTower | None = None,
        measured: CostModel | None = None,
        lockstep: bool = False,
        store: CostStore | None = None,
        suffix_index: SharedSuffixIndex | None = None,
        wired: WiredLimit | None = None,
    ) -> ModelPair:
        """Install the target's hooks for a bound drafter's taps (their self-check raises
        here); with a vision tower, the hooks that let image prompts give their own positions.
        ``measured``: the costs, if known; ``lockstep``: ranks of a sharded target measure
        together (fixed repetition counts, ``measure_costs``); ``store``: where measured costs
        are kept."""
        taps = tuple(draft.config.target_layer_ids) if draft is not None else ()
        target = TargetModel(model, taps)
        if vision is not None:
            target.place_positions()
        return cls(
            model,
            tokenizer,
            draft,
            target,
            wired or WiredLimit(model),
            PairCosts(model, draft, measured=measured, fixed=lockstep, store=store),
            vision,
            suffix_index=suffix_index or SharedSuffixIndex(SUFFIX_INDEX_BYTES),
        )

    @classmethod
    def of(
        cls,
        model: nn.Module,
        tokenizer: TokenizerWrapper,
        draft: Drafter | None,
        vision: VisionTower | None = None,
        measured: CostModel | None = None,
    ) -> ModelPair:
        """The Python API's pair for (model, draft): built on first use and kept on the model
        (one wired-memory holder per model, whichever drafter runs with it), seen with this
        call's ``tokenizer`` and ``vision`` (a view sharing its state). The drafter is bound
        at each call: the caller may have used it with another model since."""
        pairs: dict[int, ModelPair] = model.__dict__.setdefault("_dflash_pairs", {})
        if draft is not None:
            draft.bind(model)
        pair = pairs.get(id(draft))
        if pair is None or pair.draft is not draft:
            wired = next(iter(pairs.values())).wired if pairs else None
            pair = pairs[id(draft)] = cls.build(
                model, tokenizer, draft, vision=vision, measured=measured, wired=wired
            )
        if vision is not None and pair.vision is not vision:
            pair.target.place_positions()
        if pair.tokenizer is tokenizer and (vision is None or pair.vision is vision):
            return pair
        return replace(pair, tokenizer=tokenizer, vision=vision or pair.vision)
