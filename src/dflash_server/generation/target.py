"""The target model as DFlash drives it: tapped hidden states, logits for chosen rows only."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from dflash_server.generation.rollback import CacheRollback
from dflash_server.models.hooks import TargetHooks


class TargetModel:
    """Wraps an mlx-lm model for prefill/verify with taps and exact cache rollback.

    Several wrappers (e.g. for drafters with different taps) may share one model and its hooks.
    """

    def __init__(self, model: nn.Module, tap_ids: tuple[int, ...]):
        self.model = model
        self.hooks = TargetHooks.of(model)
        self.parts = self.hooks.parts
        self.tap_ids = tuple(tap_ids)
        self.hooks.tap(self.tap_ids)

    @classmethod
    def of(cls, model: nn.Module, tap_ids: tuple[int, ...]) -> TargetModel:
        """The wrapper for (model, taps), made once and kept on the model itself."""
        wrappers = model.__dict__.setdefault("_dflash_targets", {})
        if tap_ids not in wrappers:
            wrappers[tap_ids] = cls(model, tap_ids)
        return wrappers[tap_ids]

    def make_cache(self) -> list[Any]:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)

    def make_rollback(self, cache: list[Any]) -> CacheRollback:
        return CacheRollback(self.hooks, cache)

    def forward(
        self, tokens: mx.array, cache: list[Any], logit_rows: slice | None = None
    ) -> tuple[mx.array | None, mx.array | None]:
        """Run ``tokens`` ([1, T]) through the target; return (logits of ``logit_rows``, taps).

        Taps are the tapped layers' outputs concatenated on the feature axis: [1, T, L*H]
        (None without taps, i.e. plain decoding).
        """
        hidden = self.parts.backbone(tokens, cache)
        taps = self.hooks.take_taps(self.tap_ids)
        logits = None if logit_rows is None else self.parts.lm_head(hidden[:, logit_rows])
        return logits, taps
