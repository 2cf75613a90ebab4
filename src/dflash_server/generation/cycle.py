"""What one draft/verify cycle hands back: the queued device results, and the committed tokens.

``Cycle`` is a cycle in flight (its arrays evaluate asynchronously; reading ``result`` is the one
host sync); ``Commit`` the tokens it committed, as the drivers hand them out. Made and read by a
``Row`` (``row.py``), whichever driver runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx

from dflash_server.adaptive.policy import DRAFTER, Source

# Plain steps whose taps wait to join the drafter's context in one append: each append is a
# drafter call per row, and at 16 they cost a batch its rows hold to plain 3-6 % of its passes.
FLUSH = 256


@dataclass
class Commit:
    """Tokens committed together, with their log-probabilities when asked for.

    ``finish`` is set on the last commit: "stop" (an EOS id, which is not in ``tokens``) or
    "length" (``max_tokens`` reached).
    """

    tokens: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token, best first
    finish: str | None = None
    drafted: int = 0  # how many of the leading tokens are accepted drafts (the rest: target's)
    source: Source = DRAFTER  # where those drafts came from: the drafter or a suffix copy

    def read_logprobs(self, arrays: tuple[Any, ...]) -> None:
        """Fill the log-probabilities of the committed tokens from a cycle's device arrays
        (chosen, top ids, top values; each None when not asked for)."""
        chosen, ids, top = (None if a is None else cast(list, a.tolist()) for a in arrays)
        n = len(self.tokens)
        self.logprobs = (chosen or [])[:n]
        if ids is not None and top is not None:
            self.top_logprobs = [
                sorted(zip(i, v), key=lambda iv: -iv[1]) for i, v in zip(ids[:n], top[:n])
            ]

    def truncate(self, n: int, finish: str | None = None) -> Commit:
        top = None if self.top_logprobs is None else self.top_logprobs[:n]
        lps = self.logprobs and self.logprobs[:n]
        return Commit(self.tokens[:n], lps, top, finish, min(self.drafted, n), self.source)


PREFILL_CHUNK = Commit([])  # yielded between prompt chunks: no tokens, the prefill goes on


@dataclass
class Cycle:
    """A queued cycle: device results plus what the host needs to read them."""

    result: mx.array  # [accepted, bonus, d1..d(B-1)]
    taps: mx.array | None  # [1, B, L*H] tapped target features of the verify input
    size: int  # B, positions fed to the target
    logprobs: tuple[mx.array, mx.array | None, mx.array | None] | None = None  # per verify row
    source: Source = DRAFTER
    confidence: tuple[float, ...] = ()  # a suffix copy's, for the controller's trust
    prefill: bool = False  # the prompt's first token: no cycle of the policy's
    inputs: mx.array | None = None  # the tokens fed to the verify: anchor, then the drafts
    # The drafter context the step appended (a plain step's ``FLUSH``, a prompt's), evaluated
    # with the cycle: left lazy, a row held to plain keeps every tap alive until it drafts
    # again, which then pays for all of them.
    upkeep: list[Any] = field(default_factory=list)

    def arrays(self) -> list[mx.array]:
        extra = [] if self.logprobs is None else [a for a in self.logprobs if a is not None]
        return [self.result, *([] if self.taps is None else [self.taps]), *extra, *self.upkeep]


def terminate(commit: Commit, room: int, eos_ids: set[int] | frozenset[int]) -> Commit:
    """Cut a commit at its first EOS ("stop", EOS dropped) or at ``room`` tokens ("length")."""
    for i, token in enumerate(commit.tokens[:room]):
        if token in eos_ids:
            return commit.truncate(i, "stop")
    if len(commit.tokens) >= room:
        return commit.truncate(room, "length")
    return commit
