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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: the settings (and --help) load without mlx-lm
    import mlx.nn as nn

KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize accepts for affine quantization
KV_GROUP_SIZES = (32, 64, 128)
QUANTIZED_KV_START = 5000  # mlx-lm's DEFAULT_QUANTIZED_KV_START (tokens; a test keeps them equal)


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
        from mlx_lm.models.cache import KVCache

        for i, c in enumerate(cache):
            if type(c) is KVCache and self.due(c.offset):
                cache[i] = c.to_quantized(group_size=self.group_size, bits=self.bits)

    def check_model(self, model: nn.Module) -> None:
        """Raise a ValueError when a head size does not split into groups."""
        self.check_head_size(head_dim(model))

    def check_head_size(self, dim: int) -> None:
        """Raise a ValueError naming the flag and the group sizes that fit ``dim``."""
        if dim % self.group_size:
            fits = [str(g) for g in KV_GROUP_SIZES if dim % g == 0]
            fix = (
                f"pass --kv-group-size {' or '.join(fits)}"
                if fits
                else f"no group size ({', '.join(map(str, KV_GROUP_SIZES))}) does: leave out "
                "--kv-bits"
            )
            raise ValueError(
                f"--kv-group-size {self.group_size} does not divide the model's attention "
                f"head size {dim} (--kv-bits quantizes each head in groups): {fix}"
            )

    def describe(self) -> str:
        """The start-up line: what changes the numbers, and from which token."""
        return (
            f"KV cache: attention K/V quantized to {self.bits} bits in groups of "
            f"{self.group_size}, from a request's token {self.start} on (--kv-bits, "
            "--kv-group-size, --quantized-kv-start)"
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


def config_head_dim(config: dict[str, Any]) -> int | None:
    """The attention head size from a ``config.json`` (its ``text_config`` for a
    vision-language checkpoint): ``head_dim``, else hidden size / heads; None if it says neither."""
    text = config.get("text_config") or config
    if isinstance(dim := text.get("head_dim"), int) and dim > 0:
        return dim
    hidden, heads = text.get("hidden_size"), text.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


def head_dim(model: nn.Module) -> int:
    """The attention head size, from the config (``head_dim``, else hidden size / heads)."""
    outer: Any = getattr(model, "language_model", model)
    args = outer.args
    return getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
