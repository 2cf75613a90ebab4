"""Compiled forms of the drafter's small ops, fewer primitives per cycle.

On the CPU backend (and wherever MLX has no fused kernel) ``mx.fast.rms_norm`` and
``mx.fast.rope`` expand into their reference ops, a dozen primitives each; every primitive costs
a scheduling step (~10 us on CPU), which on small drafters is a real share of the cycle.
``mx.compile`` fuses those expansions; where a fused kernel exists it is kept as is, so this is
never slower. Same math, same parameters (``Norm`` is an ``nn.RMSNorm``: checkpoints load
unchanged).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

_NORMS: dict[float, Any] = {}
_ROPES: dict[tuple, Any] = {}


def _norm_fn(eps: float) -> Any:
    fn = _NORMS.get(eps)
    if fn is None:

        def norm(x: mx.array, w: mx.array) -> mx.array:
            return mx.fast.rms_norm(x, w, eps)

        fn = _NORMS[eps] = mx.compile(norm, shapeless=True)
    return fn


class Norm(nn.RMSNorm):
    """``nn.RMSNorm`` through one compiled function."""

    def __call__(self, x: mx.array) -> mx.array:
        return _norm_fn(self.eps)(x, self.weight)


def rope_at(rope: Any, x: mx.array, offset: int | mx.array) -> mx.array:
    """``rope(x, offset=offset)``; a plain ``nn.RoPE`` runs compiled with the offset as an
    input (one trace per input shape, not per position). Scaled variants run as they are."""
    if type(rope) is not nn.RoPE:
        return rope(x, offset=offset)
    key = (rope.dims, rope.traditional, rope.base, rope.scale)
    fn = _ROPES.get(key)
    if fn is None:
        dims, traditional, base, scale = key

        def apply(x: mx.array, offset: mx.array) -> mx.array:
            return mx.fast.rope(
                x, dims, traditional=traditional, base=base, scale=scale, offset=offset
            )

        fn = _ROPES[key] = mx.compile(apply)
    return fn(x, mx.array(offset, dtype=mx.int32))
