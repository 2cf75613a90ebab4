"""A drafter family in one file, as docs/development.md ("A drafter family") describes: its
model (the whole ``Drafter`` contract of ``dflash_server.drafters.protocol``), how it loads, and
its ``Family``. ``register(FAMILY)`` is all the server needs to serve it.

The toy drafts every position of a block from one projection of the newest committed
position's taps through the target's head: useless as a drafter, exact as any drafter is.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from dflash_server.drafters.protocol import ContextLayer, Drafted, DraftRow, Family
from dflash_server.models.loading import load_checkpoint
from dflash_server.models.target_parts import find_target_parts

ARCHITECTURE = "ToyDraftModel"


@dataclass(frozen=True)
class ToyConfig:
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    hidden_size: int
    num_hidden_layers: int = 1


class ToyContext:
    """The projected taps of every committed position (never rolled back)."""

    max_size = None

    def __init__(self) -> None:
        self.states: mx.array | None = None  # [1, 1, T, H]

    @property
    def offset(self) -> int:
        return 0 if self.states is None else self.states.shape[2]

    @property
    def state(self) -> list[mx.array]:
        return [] if self.states is None else [self.states]

    def append(self, states: mx.array) -> None:
        new = states[:, None]
        self.states = new if self.states is None else mx.concatenate([self.states, new], axis=2)

    def snapshot(self) -> tuple[mx.array, mx.array, int] | None:
        return None if self.states is None else (self.states, self.states, self.offset)

    def restore(self, snapshot: tuple[mx.array, mx.array, int] | None) -> None:
        self.states = None if snapshot is None else snapshot[0][:, :, : snapshot[2]]


class ToyDrafter(nn.Module):
    family = "Toy"
    window = None

    def __init__(self, config: ToyConfig):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.proj = nn.Linear(len(config.target_layer_ids) * hidden, hidden, bias=False)
        self._head: Any = None

    def bind(self, target: nn.Module) -> ToyDrafter:
        parts = find_target_parts(target)
        if parts.hidden_size != self.config.hidden_size:
            raise ValueError(
                f"toy drafter for width {self.config.hidden_size}, not {parts.hidden_size}"
            )
        self._head = parts.lm_head
        return self

    def make_cache(self) -> list[Any]:
        return [ToyContext()]

    def append_context(self, taps: mx.array, cache: list[Any], tokens: mx.array) -> None:
        cache[0].append(self.proj(taps))

    def propose(self, rows: Sequence[DraftRow]) -> list[Drafted]:
        """Every row in one head pass: its newest position's logits, for each of its drafts."""
        newest = mx.concatenate([row.cache[0].states[:, 0, -1:] for row in rows])  # [R, 1, H]
        logits = self._head(newest)[:, 0]  # [R, V]
        return [
            row.sampler.propose(mx.repeat(logits[i : i + 1], row.width - 1, axis=0), row.history)
            for i, row in enumerate(rows)
        ]

    def context_window(self) -> tuple[int, int] | None:
        return None

    def skip_context(self, n: int, cache: list[Any]) -> None:
        raise ValueError("the toy drafter reads every position")

    def set_window(self, window: int | None) -> int | None:
        return None

    def context_layers(self, activation_bytes: int) -> tuple[ContextLayer, ...]:
        return (ContextLayer(self.config.hidden_size * activation_bytes, None),)


def _load(path: Path, raw: dict[str, Any], target: nn.Module | None) -> ToyDrafter:
    config = ToyConfig(
        raw["block_size"], raw["mask_token_id"], tuple(raw["target_layer_ids"]), raw["hidden_size"]
    )
    model = ToyDrafter(config)
    load_checkpoint(model, path, raw, source=f"{path} (toy layout)")
    return model if target is None else model.bind(target)


FAMILY = Family(
    "Toy", lambda raw: (raw.get("architectures") or [None])[0] == ARCHITECTURE, _load, ARCHITECTURE
)


def write_toy(path: Path, hidden: int, taps: tuple[int, ...], mask_token_id: int) -> Path:
    """A toy drafter folder (config.json and random weights) for a target ``hidden`` wide."""
    path.mkdir(parents=True)
    config = {
        "architectures": [ARCHITECTURE],
        "block_size": 4,
        "mask_token_id": mask_token_id,
        "target_layer_ids": list(taps),
        "hidden_size": hidden,
    }
    (path / "config.json").write_text(json.dumps(config))
    weight = mx.random.normal((hidden, len(taps) * hidden), key=mx.random.key(0)) * 0.05
    mx.save_safetensors(str(path / "model.safetensors"), {"proj.weight": weight})
    return path
