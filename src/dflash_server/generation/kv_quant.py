"""Quantized attention KV (``--kv-bits``): mlx-lm's ``QuantizedKVCache`` rule, DFlash's forwards.

mlx-lm's ``generate_step`` converts each ``KVCache`` to a ``QuantizedKVCache`` once it holds
``quantized_kv_start`` tokens, checked after every forward (each prefill chunk, each decode step).
A row applies the same rule after each prefill chunk and before each verify pass, i.e. after the
previous pass and its rollback: a forward attends full-precision keys while the cache is below the
start and quantized ones (its own new keys included) from the forward after it reached it
(docs/design.md, "Quantized KV cache"). Gated DeltaNet layers keep their ``ArraysCache``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.nn as nn
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START
from mlx_lm.models.cache import KVCache

KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize accepts for affine quantization
KV_GROUP_SIZES = (32, 64, 128)
QUANTIZED_KV_START = DEFAULT_QUANTIZED_KV_START  # mlx-lm's default (tokens)


@dataclass(frozen=True)
class KVQuant:
    """How attention KV is quantized: ``bits`` per element, scale and bias per ``group_size``
    elements of a head, from the forward after a cache holds ``start`` tokens."""

    bits: int
    group_size: int = 64
    start: int = QUANTIZED_KV_START

    def __post_init__(self) -> None:
        check_kv_bits(self.bits, self.group_size, self.start)

    @classmethod
    def of(cls, bits: int | None, group_size: int = 64, start: int = QUANTIZED_KV_START):
        """None without ``bits`` (full-precision KV)."""
        return None if bits is None else cls(bits, group_size, start)

    def key(self) -> tuple[str, int, int, int]:
        """What a prefix-cache entry's kind adds: a quantized state only restores under the
        same settings (the start decides which positions attended full-precision keys)."""
        return ("kv", self.bits, self.group_size, self.start)

    def due(self, held: int) -> bool:
        return held >= self.start

    def quantize(self, cache: list[Any]) -> None:
        """Convert, in place in the list, each ``KVCache`` holding ``start`` tokens or more."""
        for i, c in enumerate(cache):
            if type(c) is KVCache and self.due(c.offset):
                cache[i] = c.to_quantized(group_size=self.group_size, bits=self.bits)

    def check_model(self, model: nn.Module) -> None:
        """Raise a ValueError when a head size does not split into groups."""
        dim = head_dim(model)
        if dim % self.group_size:
            raise ValueError(
                f"--kv-group-size {self.group_size} does not divide the model's attention "
                f"head size {dim}: pass a group size that does "
                f"({', '.join(str(g) for g in KV_GROUP_SIZES if dim % g == 0) or 'none'})"
            )


def check_kv_bits(bits: int, group_size: int, start: int = 0) -> None:
    """Raise a one-line ValueError for settings mlx cannot quantize with."""
    if bits not in KV_BITS:
        raise ValueError(f"--kv-bits must be one of {', '.join(map(str, KV_BITS))}, got {bits}")
    if group_size not in KV_GROUP_SIZES:
        raise ValueError(
            f"--kv-group-size must be one of {', '.join(map(str, KV_GROUP_SIZES))}, "
            f"got {group_size}"
        )
    if start < 0:
        raise ValueError(f"--quantized-kv-start must be 0 or more, got {start}")


def head_dim(model: nn.Module) -> int:
    """The attention head size, from the config (``head_dim``, else hidden size / heads)."""
    outer: Any = getattr(model, "language_model", model)
    args = outer.args
    return getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
