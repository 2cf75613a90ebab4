"""The target model as DFlash drives it: tapped hidden states, logits for chosen rows only.

Taps are recorded by giving each tapped layer instance a subclass whose ``__call__`` also stores
its output; mlx-lm's code and the parameter tree stay untouched.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from dflash_server.generation.rollback import CacheRollback
from dflash_server.models.target_parts import TargetParts, find_target_parts

_TAPPED_CLASSES: dict[type, type] = {}


class _TapSink:
    """Per-model slot where each tapped layer drops its latest output, keyed by layer index."""

    def __init__(self) -> None:
        self.outputs: dict[int, mx.array] = {}


def _tapped_class(cls: type) -> type:
    if cls not in _TAPPED_CLASSES:

        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = cls.__call__(self, *args, **kwargs)
            sink, index = self._dflash_tap
            sink.outputs[index] = out[0] if isinstance(out, tuple) else out
            return out

        _TAPPED_CLASSES[cls] = type(f"Tapped{cls.__name__}", (cls,), {"__call__": __call__})
    return _TAPPED_CLASSES[cls]


class TargetModel:
    """Wraps an mlx-lm model for prefill/verify with taps and exact cache rollback.

    Several wrappers (e.g. for drafters with different taps) may share one model.
    """

    def __init__(self, model: nn.Module, tap_ids: tuple[int, ...]):
        self.model = model
        self.parts: TargetParts = find_target_parts(model)
        self.tap_ids = tuple(tap_ids)
        backbone = self.parts.backbone
        if "_dflash_sink" not in backbone.__dict__:
            # object.__setattr__: keep our bookkeeping out of the module's parameter tree.
            object.__setattr__(backbone, "_dflash_sink", _TapSink())
        self._sink: _TapSink = backbone.__dict__["_dflash_sink"]
        for layer_id in self.tap_ids:
            layer = self.parts.layers[layer_id]
            if type(layer) not in _TAPPED_CLASSES.values():
                object.__setattr__(layer, "_dflash_tap", (self._sink, layer_id))
                layer.__class__ = _tapped_class(type(layer))

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
        return CacheRollback(self.parts.layers, cache)

    def forward(
        self, tokens: mx.array, cache: list[Any], logit_rows: slice | None = None
    ) -> tuple[mx.array | None, mx.array | None]:
        """Run ``tokens`` ([1, T]) through the target; return (logits of ``logit_rows``, taps).

        Taps are the tapped layers' outputs concatenated on the feature axis: [1, T, L*H]
        (None without taps, i.e. plain decoding).
        """
        hidden = self.parts.backbone(tokens, cache)
        outputs = self._sink.outputs
        taps = mx.concatenate([outputs[i] for i in self.tap_ids], axis=-1) if self.tap_ids else None
        outputs.clear()
        logits = None if logit_rows is None else self.parts.lm_head(hidden[:, logit_rows])
        return logits, taps
