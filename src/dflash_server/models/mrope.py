"""Qwen3.5's multimodal rotary positions (docs/design.md, "Multimodal positions").

A text token's position is the same on the three axes (time, height, width); an image's tokens
take their place in the image's grid, all starting where the text before them ended; the text
after an image continues from the image's largest position + 1. From the prompt's end on, every
position is the token's index plus one shift per sequence (``rope_delta``, <= 0), so decoding
needs only that number. Within the rotary dims, frequency ``i`` reads its position from one
axis, interleaved (``mrope_section`` frequencies per axis): with equal axes this is plain RoPE.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np


@dataclass(frozen=True)
class Positions:
    """Where one forward's tokens sit for the target's rotary embedding, when that is not the
    cache offset: ``grid`` ([3, B, T], explicit 3-D positions: a prompt chunk with images), or
    ``shift`` added to each row's offset (an int, or one per row: [B])."""

    grid: mx.array | None = None
    shift: int | mx.array = 0

    @classmethod
    def shifted(cls, shift: int) -> Positions | None:
        """The cache offset plus ``shift``; None for no shift (mlx-lm's own positions)."""
        return cls(shift=shift) if shift else None


def prompt_positions(
    tokens: Sequence[int], image_token: int, grids: Sequence[Sequence[int]], merge: int
) -> tuple[np.ndarray, int]:
    """The prompt's positions ([3, L]) and the shift of every position after it.

    Each image is a run of ``t·(h/merge)·(w/merge)`` image tokens (``grids`` in patches, in
    prompt order); a ValueError says when the prompt does not hold them so."""
    ids = np.asarray(tokens)
    pads = ids == image_token
    out = np.zeros((3, len(ids)), dtype=np.int32)
    at = image = start = 0  # the next token, the next image, the next free position
    while at < len(ids):
        if not pads[at]:
            end = at + 1 + int(np.argmax(pads[at + 1 :])) if pads[at + 1 :].any() else len(ids)
            out[:, at:end] = start + np.arange(end - at)
            start, at = start + end - at, end
            continue
        if image == len(grids):
            raise ValueError(f"the prompt has more image tokens than the {len(grids)} images")
        t, h, w = grids[image][0], grids[image][1] // merge, grids[image][2] // merge
        end = at + t * h * w
        if end > len(ids) or not pads[at:end].all():
            raise ValueError(f"image {image} needs {t * h * w} image tokens in a row")
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij"))
        out[:, at:end] = start + grid.reshape(3, -1)
        start, at, image = start + max(t, h, w), end, image + 1
    if image != len(grids):
        raise ValueError(f"the prompt has image tokens for {image} of {len(grids)} images")
    return out, start - len(ids)


def axis_of_frequency(section: Sequence[int], frequencies: int) -> np.ndarray:
    """Which axis each rotary frequency reads (interleaved: 0, 1, 2, 0, 1, 2, ... while each
    axis has frequencies left in its ``section``, then time)."""
    axes = np.zeros(frequencies, dtype=np.int32)
    for axis in (1, 2):
        axes[axis : min(3 * section[axis], frequencies) : 3] = axis
    return axes


def rotate(rope: nn.RoPE, x: mx.array, grid: mx.array, section: Sequence[int]) -> mx.array:
    """``x`` ([B, heads, T, D]) rotated as ``rope`` would, but at 3-D positions ``grid``
    ([3, B, T]); ``rope`` must be a non-traditional ``nn.RoPE`` (its dims, base and scale)."""
    dims = rope.dims
    half = dims // 2
    inv_freq = 1.0 / (rope.base ** (mx.arange(0, dims, 2).astype(mx.float32) / dims))
    axes = mx.array(axis_of_frequency(section, half))
    positions = grid[axes].astype(mx.float32).transpose(1, 2, 0) * rope.scale  # [B, T, half]
    angles = positions * inv_freq
    cos = mx.cos(angles)[:, None].astype(x.dtype)
    sin = mx.sin(angles)[:, None].astype(x.dtype)
    first, second = x[..., :half], x[..., half:dims]
    rotated = [first * cos - second * sin, second * cos + first * sin]
    return mx.concatenate([*rotated, x[..., dims:]], axis=-1)
