"""Thinking budget: close the model's reasoning once it has used its share of tokens.

A ``TokenConstraint`` like the grammar: while the think block the prompt opened is still open and
``budget`` reasoning tokens are spent, the only allowed token is the think-end token, so the
model has to close its reasoning and the answer (or the forced call, or the JSON) follows. It
answers ``allowed`` for every row along a drafted path, so speculation stays exact: the target's
distribution is the masked one at every verified position, drafted or not.

``Budgeted`` wraps the request's other constraint (a grammar, which only starts after the
think-end token) and combines both masks, so one request carries one ``ConstraintSpec``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from dflash_server.chat.logprobs import hf_tokenizer
from dflash_server.generation.protocols import ConstraintSpec, TokenConstraint


class ThinkingBudget:
    """``TokenConstraint``: at most ``budget`` tokens before ``think_end``, then only it.

    ``width`` is the number of logits columns (the model's embedding rows): rows that force
    nothing allow every one of them.
    """

    def __init__(self, budget: int, think_end: int, width: int) -> None:
        if budget < 0:
            raise ValueError(f"thinking budget must be >= 0, got {budget}")
        self.budget, self.think_end = budget, think_end
        self.width = max(width, think_end + 1)
        self.used = 0  # reasoning tokens committed so far
        self.open = True  # the think block is still open

    def allowed(self, drafts: Sequence[int]) -> mx.array | None:
        drafts = list(drafts)
        n = len(drafts) + 1
        if not self.open:
            return None
        # Row i follows committed + drafts[:i]: still reasoning until a draft closes the block.
        closes = drafts.index(self.think_end) if self.think_end in drafts else n
        forced = [self.used + i >= self.budget for i in range(min(n, closes + 1))]
        forced += [False] * (n - len(forced))
        if not any(forced):
            return None
        only_end = mx.arange(self.width) == self.think_end
        return mx.where(mx.array(forced)[:, None], only_end[None], True)

    def commit(self, tokens: Sequence[int]) -> None:
        if not self.open:
            return
        tokens = list(tokens)
        if self.think_end in tokens:
            self.used += tokens.index(self.think_end)
            self.open = False
        else:
            self.used += len(tokens)


class Both:
    """Two constraints at once: a token must be allowed by each (masks ANDed)."""

    def __init__(self, first: TokenConstraint, second: TokenConstraint) -> None:
        self.first, self.second = first, second

    def allowed(self, drafts: Sequence[int]) -> mx.array | None:
        a, b = self.first.allowed(drafts), self.second.allowed(drafts)
        if a is None or b is None:
            return b if a is None else a
        # A narrower mask forbids the columns past it (see apply_mask): keep the common width.
        width = min(a.shape[-1], b.shape[-1])
        return a[:, :width] & b[:, :width]

    def commit(self, tokens: Sequence[int]) -> None:
        self.first.commit(tokens)
        self.second.commit(tokens)


@dataclass(frozen=True)
class Budgeted:
    """A request's thinking budget, with its other constraint (if any); built on the worker."""

    budget: int
    think_end: int
    width: int | None = None  # logits columns (None: the tokenizer's size)
    inner: ConstraintSpec | None = None

    def build(self, tokenizer: Any) -> TokenConstraint:
        width = self.width or len(hf_tokenizer(tokenizer))
        budget = ThinkingBudget(self.budget, self.think_end, width)
        if self.inner is None:
            return budget
        return Both(budget, self.inner.build(tokenizer))
