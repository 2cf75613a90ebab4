"""Exact rollback of target caches after a partially accepted block (FACTS §5, options b/c).

Attention caches are trimmed. Gated DeltaNet layers keep a recurrent state that cannot be trimmed,
so during verify we record each layer's conv input and its recurrence:

* where mlx-lm runs the recurrence as sequential ops (CPU, CUDA), we step it one token at a time
  through mlx-lm's own ``gated_delta_update`` (the same ops, the same order) and keep every
  step's state: rollback is a lookup;
* where it runs a fused Metal kernel, we keep the recurrence inputs (normalised q, k, v, gates
  a, b) and rollback replays the kernel over the kept prefix from the pre-verify state.

The conv window is re-sliced from the recorded conv input. No second target forward.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn

_ACTIVE: CacheRollback | None = None  # the recorder of the verify pass in flight (one MLX thread)
_CONV_CLASSES: dict[type, type] = {}


def _sequential_ops() -> bool:
    """True where mlx-lm's recurrence runs token by token as ops (no fused Metal kernel)."""
    return mx.default_device() != mx.gpu or not mx.metal.is_available()


def _step_by_step(original: Any, args: tuple, kwargs: dict) -> tuple[mx.array, list[mx.array]]:
    """``original`` over the tokens one at a time; returns (outputs, state after each token)."""
    q, k, v, a, b, A_log, dt_bias, state = args[:8]
    mask = args[8] if len(args) > 8 else kwargs.pop("mask", None)
    outputs, states = [], []
    for t in range(q.shape[1]):
        step = slice(t, t + 1)
        y, state = original(
            q[:, step], k[:, step], v[:, step], a[:, step], b[:, step], A_log, dt_bias, state,
            None if mask is None else mask[:, step], **kwargs,
        )  # fmt: skip
        outputs.append(y)
        states.append(state)
    return mx.concatenate(outputs, axis=1), states


def _recording_update(original: Any) -> Any:
    """Wrap mlx-lm's ``gated_delta_update``; a pass-through unless a verify is being recorded."""

    def gated_delta_update(*args: Any, **kwargs: Any) -> Any:
        if _ACTIVE is None:
            return original(*args, **kwargs)
        if _sequential_ops():
            y, states = _step_by_step(original, args, dict(kwargs))
            _ACTIVE._updates.append((args, kwargs, states))
            return y, states[-1]
        _ACTIVE._updates.append((args, kwargs, None))
        return original(*args, **kwargs)

    gated_delta_update._dflash_original = original  # type: ignore[attr-defined]
    return gated_delta_update


def _recording_conv(cls: type) -> type:
    if cls not in _CONV_CLASSES:

        def __call__(self: Any, x: mx.array) -> mx.array:
            if _ACTIVE is not None:
                _ACTIVE._conv_inputs.append(x)
            return cls.__call__(self, x)

        _CONV_CLASSES[cls] = type(f"Recording{cls.__name__}", (cls,), {"__call__": __call__})
    return _CONV_CLASSES[cls]


def _install_recorders(gdn: nn.Module) -> None:
    module = sys.modules[type(gdn).__module__]
    update = module.gated_delta_update
    if not hasattr(update, "_dflash_original"):
        module.gated_delta_update = _recording_update(update)
    conv = gdn.conv1d
    if type(conv) not in _CONV_CLASSES.values():
        conv.__class__ = _recording_conv(type(conv))


class CacheRollback:
    """Records a verify pass and rolls the target cache back to its first ``keep`` positions."""

    def __init__(self, layers: list[nn.Module], cache: list[Any]):
        self.cache = cache
        self.linear: list[tuple[Any, nn.Module]] = []  # (ArraysCache, GatedDeltaNet)
        for layer, c in zip(layers, cache):
            if c.is_trimmable():
                continue
            gdn = getattr(layer, "linear_attn", None)
            if gdn is None or not hasattr(gdn, "conv1d"):
                raise ValueError(
                    f"cannot roll back the {type(c).__name__} of layer {type(layer).__name__}: "
                    "DFlash supports trimmable KV caches and Gated DeltaNet (Qwen3.5/Qwen3-Next)"
                )
            _install_recorders(gdn)
            self.linear.append((c, gdn))
        self._updates: list[tuple[tuple, dict, list[mx.array] | None]] = []
        self._conv_inputs: list[mx.array] = []

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record the recurrence inputs of the forward pass run inside this block."""
        global _ACTIVE
        self._updates, self._conv_inputs = [], []
        if not self.linear:
            yield
            return
        _ACTIVE = self
        try:
            yield
        finally:
            _ACTIVE = None

    def rollback(self, keep: int, fed: int) -> None:
        """The last forward fed ``fed`` positions; keep only the first ``keep`` of them."""
        trim = fed - keep
        if trim <= 0:
            return
        for c in self.cache:
            if c.is_trimmable():
                c.trim(trim)
        if len(self._updates) != len(self.linear) or len(self._conv_inputs) != len(self.linear):
            raise RuntimeError("rollback needs the recording of the last verify pass")
        for (c, gdn), (args, kwargs, states), conv_input in zip(
            self.linear, self._updates, self._conv_inputs
        ):
            q, k, v, a, b, A_log, dt_bias, state = args[:8]
            kwargs = {key: val for key, val in kwargs.items() if key != "mask"}
            if states is not None and keep > 0:
                state = states[keep - 1]
            elif keep > 0:
                replay = sys.modules[type(gdn).__module__].gated_delta_update._dflash_original
                _, state = replay(
                    q[:, :keep], k[:, :keep], v[:, :keep], a[:, :keep], b[:, :keep],
                    A_log, dt_bias, state, None, **kwargs,
                )  # fmt: skip
            c[1] = state
            # conv_input = [old window (K-1 rows) | fed rows]; the window after `keep` rows:
            window = conv_input.shape[1] - fed
            c[0] = mx.contiguous(conv_input[:, keep : keep + window])
