"""The drafter contract: everything the decoder, the engine and the KV budget know of a drafter.

A drafter proposes tokens after each row's last committed one, for several rows in one call (one
row is a batch of one), conditioned on the target's tapped hidden states at the committed
positions (its *context*). Each row keeps its own context cache, one ``DraftContext`` per layer,
which holds committed positions only, so it never rolls back; a drafter that adds entries while
drafting (the MTP head) drops them before it returns. Families (DFlash, DFlash2, MTP, ...) are
modules of this package and are found through ``registry.py``; nothing outside this package looks
inside a drafter (docs/design.md, "Drafter families").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn

# One row's proposal: the drafted tokens ([n]) and the log-probabilities ``log q`` ([n, V]) they
# were drawn from (None when greedy: rejection sampling needs q only under sampling).
Drafted = tuple[mx.array, mx.array | None]


class DraftConfig(Protocol):
    """The drafter config fields the decoder reads."""

    @property
    def block_size(self) -> int:  # the block it was trained on: the widest verify
        ...

    @property
    def mask_token_id(self) -> int:  # fills block positions 1..B-1 of the drafter's input
        ...

    @property
    def target_layer_ids(self) -> tuple[int, ...]:  # the target layers it reads (its taps)
        ...

    @property
    def num_hidden_layers(self) -> int:  # its own layers (the startup log says how many)
        ...


class DraftContext(Protocol):
    """One drafter layer's context cache: committed positions only, so it never rolls back.
    Prefix snapshots save and restore it (``generation/prefix.py``)."""

    @property
    def offset(self) -> int:  # positions seen: the absolute position of the next one
        ...

    @property
    def max_size(self) -> int | None:  # a window: its state is valid only where it was taken
        ...

    @property
    def state(self) -> list[mx.array]: ...

    def snapshot(self) -> tuple[mx.array, mx.array, int] | None:
        """The live keys and values, and the offset they end at (None: empty)."""
        ...

    def restore(self, snapshot: tuple[mx.array, mx.array, int] | None) -> None: ...


class DraftSampler(Protocol):
    """What a drafter asks of the decoder's sampler (``generation.sampling.TokenSampler``)."""

    processors: list[Any]  # logits processors (penalties); empty when there are none

    @property
    def deterministic(self) -> bool:  # greedy or a black-box sampler: drafts carry no q
        ...

    def next_key(self) -> mx.array: ...
    def process(self, logits: mx.array, history: mx.array) -> mx.array: ...
    def logprobs(self, logits: mx.array) -> mx.array: ...
    def propose(self, draft_logits: mx.array, history: mx.array | None) -> Drafted: ...


@dataclass
class DraftRow:
    """What one row drafts from: its block ``[anchor, mask, ...]`` ([1, width]; ``width - 1``
    drafts), its context cache (new committed positions already appended), its sampler and the
    penalties' window (None without penalties)."""

    block: mx.array
    cache: list[Any]
    sampler: DraftSampler
    history: mx.array | None = None

    @property
    def width(self) -> int:
        return int(self.block.shape[1])


@dataclass(frozen=True)
class ContextLayer:
    """What one drafter layer's context cache holds per request: bytes per position, and the
    positions it keeps (the KV budget's estimate, ``generation/kv_memory.py``)."""

    bytes_per_token: int
    bound: int | None  # newest positions kept (None: all of them)
    sinks: int = 0  # first positions kept beside the newest (a sink window's)


class Drafter(Protocol):
    """What the decoder and the engine need from a drafter (docs/design.md, "The DFlash loop")."""

    family: str  # the checkpoint layout it came from ("DFlash", "DFlash2", "MTP", ...)

    @property
    def config(self) -> DraftConfig: ...

    @property
    def window(self) -> int | None:  # its full-attention layers' context bound (None: all)
        ...

    def bind(self, target: nn.Module) -> Drafter:
        """Borrow what it uses of the target (embedding, head); raise ValueError naming the
        mismatch when the pair does not fit. Returns itself."""
        ...

    def make_cache(self) -> list[Any]:
        """A fresh context cache for one row, one ``DraftContext`` per layer."""
        ...

    def append_context(self, taps: mx.array, cache: list[Any], tokens: mx.array) -> None:
        """Add committed positions' taps ([1, T, L*H]) to one row's context; ``tokens`` ([T]):
        the token fed at each of them (the MTP head pairs a position with the token after it)."""
        ...

    def propose(self, rows: Sequence[DraftRow]) -> list[Drafted]:
        """Each row's drafts for its block positions 1..width-1 and the ``log q`` they were
        drawn from, in row order; rows may differ in width and context."""
        ...

    def context_window(self) -> tuple[int, int] | None:
        """(newest, sinks): the context positions it reads; None when it reads all of them."""
        ...

    def skip_context(self, n: int, cache: list[Any]) -> None:
        """Advance one row's context past ``n`` positions it will never read (only called
        when ``context_window`` is not None)."""
        ...

    def set_window(self, window: int | None) -> int | None:
        """Bound the context its full-attention layers read to ``window`` positions (sinks and
        the newest; None or 0: all); new caches follow it. Returns the window in force."""
        ...

    def context_layers(self, activation_bytes: int) -> tuple[ContextLayer, ...]:
        """What each layer's context cache keeps per request, for activations of this size."""
        ...

    def parameters(self) -> Any:
        """Its weights, as mlx's module tree (the startup log reports their size)."""
        ...


@dataclass(frozen=True)
class Family:
    """A checkpoint layout the loader knows (``registry.py``): whether a ``config.json`` is
    its own (``claims``) and how to load such a folder (``load``: the folder, its parsed
    ``config.json`` and the target, or None; a family whose weights are shaped by the target,
    as the MTP head's are, needs it). ``load`` returns the drafter bound when given a target."""

    name: str
    claims: Callable[[dict[str, Any]], bool]
    load: Callable[[Path, dict[str, Any], nn.Module | None], Drafter]
    # Shown in the "this server loads" list when a config is claimed by no family.
    describes: str = ""
