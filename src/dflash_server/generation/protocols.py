"""Everything the decoding core asks of the outside world, in one place.

A drafter (DFlash, DFlash2, test doubles) and its context cache, a token constraint (grammars,
thinking budgets) and the constraint a request carries, and a prefix store (the engine's prefix
cache). The core depends on these shapes only, never on the classes that implement them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import mlx.core as mx
import mlx.nn as nn

from dflash_server.models.context import DraftContext
from dflash_server.models.draft_rows import DraftRow

__all__ = [
    "ConstraintSpec",
    "DraftConfig",
    "DraftContext",
    "DraftRow",
    "Drafter",
    "PrefixStore",
    "RowDrafter",
    "TokenConstraint",
    "WindowedDrafter",
]

if TYPE_CHECKING:
    from dflash_server.generation.prefix import PromptSnapshot
    from dflash_server.models.drafter import DraftSampler


class DraftConfig(Protocol):
    """The drafter config fields the decoder reads."""

    @property
    def block_size(self) -> int:  # the block the drafter was trained on: the widest verify
        ...

    @property
    def mask_token_id(self) -> int:  # fills block positions 1..B-1 of the drafter's input
        ...

    @property
    def target_layer_ids(self) -> tuple[int, ...]:  # the target layers it reads (its taps)
        ...


class Drafter(Protocol):
    """What the decoder needs from a drafter (docs/design.md, "The DFlash loop")."""

    @property
    def config(self) -> DraftConfig: ...

    def bind(self, target: nn.Module) -> Drafter:
        """Borrow the target's embedding and lm_head; raise ValueError when the pair misfits."""
        ...

    def make_cache(self) -> list[Any]:
        """A fresh context cache, one ``DraftContext`` per drafter layer."""
        ...

    def append_context(
        self, target_hidden: mx.array, cache: list[Any], tokens: mx.array | None = None
    ) -> None:
        """Add committed positions' taps ([1, T, L*H]) to the context; ``tokens`` ([T]): the
        token fed at each of them (a drafter that pairs a position with the token after it,
        as the model's own MTP head does, needs them; DFlash does not)."""
        ...

    def propose(
        self,
        block_ids: mx.array,
        target_hidden: mx.array | None,
        cache: list[Any],
        sampler: DraftSampler,
        history: mx.array | None,
    ) -> tuple[mx.array, mx.array | None]:
        """Drafts for block positions 1..B-1 and the log-probs ``log q`` they were drawn from
        (None when greedy), in one drafter pass over ``[last, mask, ...]``."""
        ...

    def set_window(self, window: int | None) -> int | None:
        """Bound the full-attention layers' context (None: all of it); return the window used."""
        ...


@runtime_checkable
class RowDrafter(Protocol):
    """Optional for a ``Drafter``: several rows' proposals at once (a batched pass drafts
    every row of one drafter in one call; without it, row by row)."""

    def propose_rows(self, rows: Sequence[DraftRow]) -> list[tuple[mx.array, mx.array | None]]:
        """``propose`` for each row (``rows[i].drafter`` is this drafter), in order."""
        ...


@runtime_checkable
class WindowedDrafter(Protocol):
    """Optional for a ``Drafter`` that reads only part of its context: the first ``sinks`` and
    the newest ``newest`` positions. A long prompt's other positions need no context at all."""

    def context_window(self) -> tuple[int, int] | None:
        """(newest, sinks) positions it reads; None when some layer reads every position."""
        ...

    def skip_context(self, n: int, cache: list[Any]) -> None:
        """Advance the context past ``n`` positions it will never read."""
        ...


class TokenConstraint(Protocol):
    """A grammar-style constraint (e.g. a JSON schema matcher): which tokens may come next.

    Speculation asks for the allowed sets along the drafted path, then commits what was accepted,
    so the constraint only ever advances over committed tokens (no rollback needed).
    """

    def allowed(self, drafts: Sequence[int]) -> mx.array | None:
        """Bool mask [len(drafts) + 1, V']: row i = tokens allowed after committed + drafts[:i];
        None when no row restricts anything (nothing to apply, e.g. before a grammar starts).

        Rows past a disallowed draft are never used and may be anything. V' <= vocab size.
        """
        ...

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance past tokens that are now part of the output."""
        ...


class ConstraintSpec(Protocol):
    """What a request carries to restrict its tokens; built into a stateful matcher per run."""

    def build(self, tokenizer: Any) -> TokenConstraint: ...


class PrefixStore(Protocol):
    """Where the decoder finds and leaves prompt snapshots (the engine's prefix cache).

    ``kind`` tells snapshots apart that hold different state for the same tokens (e.g. with or
    without the drafter's context, other taps).
    """

    def lookup(self, kind: tuple, prompt: Sequence[int]) -> tuple[PromptSnapshot, int] | None:
        """The snapshot to restore and how many tokens of ``prompt`` it restores."""
        ...

    def store(self, kind: tuple, snapshot: PromptSnapshot) -> None:
        """Keep a prompt's snapshot for later requests."""
        ...
