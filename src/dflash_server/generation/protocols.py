"""What the decoding core asks of the outside world besides a drafter (``drafters/protocol.py``):
a token constraint (grammars, thinking budgets) and the constraint a request carries, and a
prefix store (the engine's prefix cache). The core depends on these shapes only, never on the
classes that implement them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import mlx.core as mx

__all__ = ["ConstraintSpec", "PrefixStore", "TokenConstraint"]

if TYPE_CHECKING:
    from dflash_server.generation.prefix import PromptSnapshot


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
