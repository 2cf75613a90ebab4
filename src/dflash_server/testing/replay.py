"""``ReplayDrafter``: a test double that drafts the target's own future tokens with planted
mistakes, so tests and benchmarks force any acceptance length on a real drafter's costs."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from dflash_server.drafters.dflash import DFlashDraftModel
from dflash_server.drafters.protocol import ContextLayer, Drafted, DraftRow


class ReplayDrafter:
    """Test double: drafts the target's own future tokens, with planted mistakes.

    ``reference`` is prompt + the target's greedy output. In a row's cycle c the first
    ``accept_pattern[c % len]`` drafts are right and the next one is wrong, so every acceptance
    length (and full blocks) can be forced. ``inner``, a real drafter, runs alongside on the same
    context: it gives the config (block size, taps, mask id), its context and memory, and a
    realistic draft cost (its pass for every row at once). Everything else is the contract's
    (``drafters/protocol.py``), delegated to ``inner``.
    """

    def __init__(
        self, reference: Sequence[int], accept_pattern: Sequence[int], inner: DFlashDraftModel
    ):
        self.reference, self.pattern, self.inner = list(reference), list(accept_pattern), inner
        self.config = inner.config
        self.family = inner.family
        # Cycles so far per row, keyed by the row's first context cache.
        self.cycles: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()

    @property
    def window(self) -> int | None:
        return self.inner.window

    def bind(self, target: Any) -> ReplayDrafter:
        self.inner.bind(target)
        return self

    def make_cache(self) -> list[Any]:
        return self.inner.make_cache()

    def set_window(self, window: int | None) -> int | None:
        return self.inner.set_window(window)

    def append_context(self, target_hidden: Any, cache: list[Any], tokens: Any = None) -> None:
        self.inner.append_context(target_hidden, cache, tokens)

    def context_window(self) -> tuple[int, int] | None:
        return self.inner.context_window()

    def skip_context(self, n: int, cache: list[Any]) -> None:
        self.inner.skip_context(n, cache)

    def context_layers(self, activation_bytes: int) -> tuple[ContextLayer, ...]:
        return self.inner.context_layers(activation_bytes)

    def parameters(self) -> Any:
        return self.inner.parameters()

    def propose(self, rows: Sequence[DraftRow]) -> list[Drafted]:
        """The real drafter's pass for all rows at once, then each row's planted logits."""
        reals = self.inner.block_logits(rows)
        return [
            r.sampler.propose(self.planted(r.block, r.cache, real)[0], r.history)
            for r, real in zip(rows, reals)
        ]

    def planted(self, block_ids: Any, cache: list[Any], real: Any):
        """Planted logits for block positions 1.. of a row whose real ones (context already
        appended) are ``real``."""
        anchor = cache[0].offset  # absolute position of block position 0
        cycle = self.cycles.get(cache[0], 0)
        self.cycles[cache[0]] = cycle + 1
        right = self.pattern[cycle % len(self.pattern)]
        vocab = real.shape[-1]
        planted = []
        for j in range(1, block_ids.shape[1]):
            token = self.reference[anchor + j] if anchor + j < len(self.reference) else 0
            planted.append(token if j <= right else (token + 1) % vocab)
        rows = mx.array(planted)
        logits = mx.where(mx.arange(vocab) == rows[:, None], 30.0, -30.0)[None]
        return logits + 0 * real  # keep the real draft in the graph so its cost is paid
