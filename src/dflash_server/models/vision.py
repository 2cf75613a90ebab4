"""A Qwen3.5 checkpoint's vision tower and merger, and the images a request feeds them.

Every Qwen3.5 checkpoint is a vision-language model: the tower ships beside the language model
(``model.visual.*`` in the original layout, ``vision_tower.*`` in mlx-vlm's conversions).
mlx-lm loads the language model alone; the tower is loaded here with mlx-vlm's own classes and
image processor, never forked. An image becomes patches and a grid (``prepare``, at the API
boundary), then features, one per image token (``encode``, on the engine's thread); the
chat template's one ``<|image_pad|>`` per image becomes as many image tokens as the image has
features (``expand_pads``). docs/design.md, "Multimodal positions".
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np


@dataclass(frozen=True)
class ImageInput:
    """One image as the processor made it: ``pixels`` ([t·h·w, C·tps·ps·ps] float32 patches),
    its ``grid`` (t, h, w) in patches, and a ``digest`` of both (the prefix cache's key)."""

    pixels: np.ndarray
    grid: tuple[int, int, int]
    digest: bytes

    @classmethod
    def of(cls, pixels: np.ndarray, grid: Sequence[int]) -> ImageInput:
        pixels = np.ascontiguousarray(pixels, dtype=np.float32)
        t, h, w = (int(x) for x in grid)
        digest = hashlib.sha256(struct.pack("<3q", t, h, w) + pixels.tobytes()).digest()
        return cls(pixels, (t, h, w), digest)


@dataclass(frozen=True)
class VisionTokens:
    """The checkpoint's vision token ids (read from its config, never hard-coded)."""

    image: int
    video: int
    start: int
    end: int


class VisionTower:
    """The loaded tower + merger (mlx-vlm's ``VisionModel``) and mlx-vlm's image processor."""

    def __init__(self, tower: nn.Module, processor: Any, config: dict[str, Any]) -> None:
        self.tower, self.processor = tower, processor
        self.merge = int(config["vision_config"].get("spatial_merge_size", 2))
        self.tokens = VisionTokens(
            config["image_token_id"],
            config["video_token_id"],
            config["vision_start_token_id"],
            config["vision_end_token_id"],
        )
        self.min_pixels = int(processor.min_pixels)
        self.max_pixels = int(processor.max_pixels)

    def prepare(self, image: Any, max_pixels: int | None = None) -> ImageInput:
        """An RGB PIL image as patches, resized within the processor's min and max pixels and
        ``max_pixels``; a ValueError names what is wrong with it."""
        cap = self.max_pixels if max_pixels is None else min(self.max_pixels, max_pixels)
        cap = max(self.min_pixels, cap)
        out = self.processor(images=[image], min_pixels=self.min_pixels, max_pixels=cap)
        return ImageInput.of(out["pixel_values"], out["image_grid_thw"][0])

    def count(self, image: ImageInput) -> int:
        """The image tokens (features) this image takes in the prompt."""
        return math.prod(image.grid) // self.merge**2

    def encode(self, image: ImageInput) -> mx.array:
        """The image's features ([tokens, hidden]), in the tower's dtype."""
        dtype = self.tower.patch_embed.proj.weight.dtype
        features, _ = self.tower(mx.array(image.pixels).astype(dtype), mx.array([image.grid]))
        return features


FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


class ImageTooLarge(ValueError):
    """An image with more pixels than are decoded: ``pixels`` of them (None when unknown),
    ``limit``, and ``size`` (width, height) when known (Pillow's own check names only the
    count)."""

    def __init__(self, pixels: int | None, limit: int, size: tuple[int, int] | None = None) -> None:
        self.pixels, self.limit, self.size = pixels, limit, size
        shape = f"{size[0]}x{size[1]}, " if size else ""
        found = f"{shape}{pixels:,} pixels, more" if pixels else "larger"
        super().__init__(f"the image is {found} than the {limit:,} this server decodes")


def open_image(source: Any, max_pixels: int | None = None) -> Any:
    """An RGB PIL image from a PIL image, a file path or encoded bytes (PNG, JPEG, WebP, GIF:
    its first frame), turned upright by its EXIF orientation as mlx-vlm's loader does. A
    ValueError names what is wrong: not an image, another format, more than ``max_pixels``
    before resizing (``ImageTooLarge``), or data that does not decode."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    image = source
    if not isinstance(source, Image.Image):
        try:
            image = Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)
        except Image.DecompressionBombError as exc:
            raise _bomb(exc, max_pixels) from None
        except UnidentifiedImageError as exc:  # its message is the stream's Python repr
            raise ValueError(
                "the data is not an image this server reads (PNG, JPEG, WebP or GIF)"
            ) from exc
        except OSError as exc:
            raise ValueError(f"the data is not an image this server reads: {exc}") from exc
        if image.format not in FORMATS:
            raise ValueError(
                f"{image.format} images are not supported (PNG, JPEG, WebP and GIF are)"
            )
    if max_pixels is not None and image.width * image.height > max_pixels:
        raise ImageTooLarge(image.width * image.height, max_pixels, image.size)
    try:
        return ImageOps.exif_transpose(image).convert("RGB")
    except (OSError, ValueError, SyntaxError) as exc:  # truncated or corrupt data
        raise ValueError(f"the image data does not decode: {exc}") from exc


def _bomb(exc: Exception, max_pixels: int | None) -> ImageTooLarge:
    """Pillow's decompression-bomb refusal (over twice ``Image.MAX_IMAGE_PIXELS``, before our
    own check can run) as the limit that applies: the smaller of ours and Pillow's."""
    from PIL import Image

    found = re.search(r"\((\d+) pixels\)", str(exc))
    pillows = 2 * Image.MAX_IMAGE_PIXELS if Image.MAX_IMAGE_PIXELS else None
    limits = [n for n in (max_pixels, pillows) if n is not None]
    return ImageTooLarge(int(found.group(1)) if found else None, min(limits, default=0))


def expand_pads(tokens: Sequence[int], pad: int, counts: Sequence[int]) -> list[int]:
    """Each ``pad`` the chat template wrote (one per image, in order) as that image's run of
    ``counts[i]`` pads; a ValueError when the prompt holds another number of them."""
    places = [i for i, t in enumerate(tokens) if t == pad]
    if len(places) != len(counts):
        raise ValueError(
            f"the prompt has {len(places)} image placeholders for {len(counts)} images"
        )
    out: list[int] = []
    start = 0
    for place, count in zip(places, counts):
        out += [*tokens[start:place], *([pad] * count)]
        start = place + 1
    return out + list(tokens[start:])


def load_vision(path: str | Path) -> VisionTower | None:
    """The checkpoint's vision tower and image processor, or None for a text-only checkpoint
    (no ``vision_config``, or no tower weights: e.g. an mlx-lm conversion)."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    if not config.get("vision_config") or "image_token_id" not in config:
        return None
    if not any(n.startswith(("vision_tower.", "model.visual.")) for n in _tensor_names(path)):
        return None
    from mlx_vlm.utils import load_model, load_processor

    # Lazy: of the whole model only the tower's weights are ever read (mlx-lm holds the rest).
    tower = load_model(path, lazy=True).vision_tower
    mx.eval(tower.parameters())
    processor = load_processor(path, add_detokenizer=False).image_processor
    return VisionTower(tower, processor, config)


def _tensor_names(path: Path) -> list[str]:
    """The tensor names of a checkpoint folder, from its index or its files' headers."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        return list(json.loads(index.read_text()).get("weight_map", {}))
    names: list[str] = []
    for file in sorted(path.glob("*.safetensors")):
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            names += [k for k in json.loads(f.read(size)) if k != "__metadata__"]
    return names
