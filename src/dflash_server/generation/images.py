"""A prompt's images, for the row that prefills it (docs/design.md, "Multimodal positions").

What the images change in a row: the prefill feeds each image's features at its image tokens
(encoded once, when the first chunk that holds them runs: a chunk may end inside an image, and
a prefix-cache hit that covers an image never encodes it), at the prompt's 3-D positions; every
later position (verify, rollback, a batched pass) is the token count plus the prompt's
``shift``; and the prefix cache keys the prompt with each image token replaced by a number
drawn from the image's digest, so a different image with the same text never hits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from dflash_server.generation.target import TargetModel
from dflash_server.models.mrope import Positions, prompt_positions
from dflash_server.models.vision import ImageInput, VisionTower

_KEY_WORDS = 8  # a digest's 256 bits as eight 31-bit key ids, repeated over the image's tokens


class PromptImages:
    """The images of one prompt: where their tokens are, their features, the positions."""

    def __init__(
        self, vision: VisionTower, images: Sequence[ImageInput], prompt: Sequence[int]
    ) -> None:
        self.vision, self.images = vision, list(images)
        grids = [image.grid for image in self.images]
        grid, self.shift = prompt_positions(prompt, vision.tokens.image, grids, vision.merge)
        self.grid = mx.array(grid)
        self.pads = np.flatnonzero(np.asarray(prompt) == vision.tokens.image)
        counts = [vision.count(image) for image in self.images]
        self.first = np.concatenate([[0], np.cumsum(counts)])  # image k's first image token
        self._features: dict[int, mx.array] = {}
        key = np.asarray(prompt, dtype=np.int64)
        for k, image in enumerate(self.images):
            words = -1 - (np.frombuffer(image.digest, dtype="<u4") & 0x7FFFFFFF).astype(np.int64)
            key[self.pads[self.first[k] : self.first[k + 1]]] = np.resize(words, counts[k])
        self.key: tuple[int, ...] = tuple(key.tolist())  # never a token: ids are < 0

    def inputs(self, tokens: mx.array, begin: int, end: int, target: TargetModel) -> dict[str, Any]:
        """What ``target.forward`` takes for prompt tokens ``begin .. end`` (``tokens`` [1, T])
        besides them: their embeddings (features at image tokens) and positions."""
        embeddings = self.embeddings(tokens, begin, end, target.parts.embed_tokens)
        return {"embeddings": embeddings, "positions": self.positions(begin, end)}

    def positions(self, begin: int, end: int) -> Positions:
        """The 3-D positions of prompt tokens ``begin .. end``."""
        return Positions(grid=self.grid[:, None, begin:end])

    def embeddings(
        self, tokens: mx.array, begin: int, end: int, embed: Callable[[mx.array], mx.array]
    ) -> mx.array | None:
        """The input embeddings of prompt tokens ``begin .. end`` (``tokens`` [1, T]), image
        features at the image tokens; None when the chunk holds none."""
        lo, hi = (int(i) for i in np.searchsorted(self.pads, [begin, end]))
        if lo == hi:
            return None
        pieces = []
        for k in range(int(np.searchsorted(self.first, lo, "right")) - 1, len(self.images)):
            start, stop = max(lo, self.first[k]), min(hi, self.first[k + 1])
            if start >= stop:
                break
            pieces.append(self._encoded(k)[start - self.first[k] : stop - self.first[k]])
        features = mx.concatenate(pieces) if len(pieces) > 1 else pieces[0]
        index = np.zeros(end - begin, dtype=np.int32)
        index[self.pads[lo:hi] - begin] = np.arange(hi - lo)
        at_image = np.zeros(end - begin, dtype=bool)
        at_image[self.pads[lo:hi] - begin] = True
        text = embed(tokens)
        chosen = features.astype(text.dtype)[mx.array(index)][None]
        return mx.where(mx.array(at_image)[None, :, None], chosen, text)

    def _encoded(self, k: int) -> mx.array:
        """Image ``k``'s features, encoded on first use and kept for the rest of the prefill."""
        if k not in self._features:
            self._features[k] = self.vision.encode(self.images[k])
        return self._features[k]
