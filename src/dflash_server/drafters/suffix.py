"""Model-free drafts copied from what the context already holds (docs/design.md, "Suffix drafts").

Coding agents restate code, paths and JSON that are already in their prompt or earlier outputs.
A ``SuffixProposer`` (one per request, host-side state only) matches the last committed tokens
against the request's own tokens (prompt and output so far) and against a bounded shared index of
recent requests' outputs (``SharedSuffixIndex``, one per served model, LRU within a byte budget),
and proposes the most frequent continuation of the longest match, with a per-token confidence
from the match length and how often the continuation followed it. The target's verify keeps the
output exact whatever is proposed; the controller decides whether a proposal is worth verifying.

The index maps every ``KEY``-gram to the positions that follow it (appended incrementally, O(1)
per token); a lookup extends the newest ``CANDIDATES`` occurrences backwards to measure each
match, so its cost is bounded whatever the context length.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

KEY = 2  # tokens a match needs at least: the index key
MAX_MATCH = 32  # a match is measured backwards up to this many tokens
CANDIDATES = 16  # newest occurrences of the key examined per lookup (per index)
_INT_BYTES = sys.getsizeof(1 << 20)  # an int above CPython's small-int cache: an object each
# The shared key map's share per key of an entry: a list slot, and for a new key its list and
# dict slot (measured with tracemalloc: the index then reports 0.9-1.3x its real memory).
HOLDER_BYTES = 96


@dataclass(frozen=True)
class Proposal:
    """Tokens to verify after the last committed one; ``confidence[j]`` estimates the chance that
    token j is right given that the tokens before it were."""

    tokens: list[int]
    confidence: list[float]
    match: int  # tokens of context that matched


# An occurrence: (the tokens it lives in, where its continuation starts).
_Occurrence = tuple[Sequence[int], int]


def _ints(values: list[int]) -> int:
    """Bytes of the int objects in ``values`` that are not CPython's shared small ints."""
    return _INT_BYTES * sum(1 for v in values if not -5 <= v <= 256)


def _match_length(seq: Sequence[int], start: int, tail: Sequence[int], limit: int) -> int:
    """How many tokens before ``start`` in ``seq`` equal the end of ``tail`` (at most limit)."""
    m = KEY
    while m < limit and m < start and seq[start - 1 - m] == tail[-1 - m]:
        m += 1
    return m


class TokenIndex:
    """A token sequence with the positions following each of its ``KEY``-grams."""

    def __init__(self, tokens: Iterable[int] = ()):
        self.tokens: list[int] = []
        self.follows: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        seq, follows = self.tokens, self.follows
        for token in tokens:
            seq.append(token)
            if len(seq) >= KEY:
                follows.setdefault((seq[-2], seq[-1]), []).append(len(seq))

    def nbytes(self) -> int:
        """Its memory, summed over its Python objects: the lists, the key tuples and the ints
        (a few hundred bytes a token, several times what the ids alone would take)."""
        size = sys.getsizeof(self.tokens) + _ints(self.tokens) + sys.getsizeof(self.follows)
        for key, starts in self.follows.items():  # a key's ints are the token list's own
            size += sys.getsizeof(key) + sys.getsizeof(starts) + _ints(starts)
        return size

    def occurrences(self, tail: Sequence[int]) -> list[tuple[int, _Occurrence]]:
        """(match length, occurrence) for the newest earlier occurrences of ``tail``'s end."""
        starts = self.follows.get(tuple(tail[-KEY:]), ())
        seq, limit = self.tokens, min(MAX_MATCH, len(tail))
        return [
            (_match_length(seq, s, tail, limit), (seq, s))
            for s in starts[-CANDIDATES:]
            if s < len(seq)  # the tail itself: nothing follows it yet
        ]


class SharedSuffixIndex:
    """Recent requests' outputs for one served model, least recently used dropped first once
    ``budget_bytes`` is exceeded; a key map finds the entries holding a key without visiting
    the others. Thread-safe (requests may run on several threads)."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.entries: OrderedDict[int, TokenIndex] = OrderedDict()
        self.holders: dict[tuple[int, ...], list[int]] = {}  # key -> entries holding it
        self.sizes: dict[int, int] = {}  # entry -> its bytes (its index and key-map share)
        self.bytes = 0
        self._next = 0
        self._lock = threading.Lock()

    def add(self, tokens: Sequence[int]) -> None:
        if len(tokens) <= KEY:
            return
        entry = TokenIndex(tokens)  # measured, not estimated: the budget is real memory
        size = entry.nbytes() + len(entry.follows) * HOLDER_BYTES
        if size > self.budget:
            return
        with self._lock:
            name = self._next
            self._next += 1
            self.entries[name] = entry
            self.sizes[name] = size
            for key in entry.follows:
                self.holders.setdefault(key, []).append(name)
            self.bytes += size
            while self.bytes > self.budget:
                dropped, gone = self.entries.popitem(last=False)
                self.bytes -= self.sizes.pop(dropped)
                for key in gone.follows:
                    names = self.holders[key]
                    names.remove(dropped)
                    if not names:
                        del self.holders[key]

    def matches(self, key: tuple[int, ...]) -> bool:
        with self._lock:
            return key in self.holders

    def occurrences(self, tail: Sequence[int]) -> list[tuple[int, _Occurrence]]:
        with self._lock:
            found: list[tuple[int, _Occurrence]] = []
            names = self.holders.get(tuple(tail[-KEY:]), [])
            for name in reversed(names[-CANDIDATES:]):  # newest first
                found += self.entries[name].occurrences(tail)
                self.entries.move_to_end(name)  # recently useful: kept longest
                if len(found) >= CANDIDATES:
                    break
            return found


class SuffixProposer:
    """One request's suffix drafts: its own tokens plus the shared index (host-side state only,
    so a batched decoder can ask one per request).

    ``extend`` after each commit; ``propose`` before choosing a cycle; ``finish`` at the end
    (adds the output to the shared index).
    """

    def __init__(
        self,
        prompt: Sequence[int],
        shared: SharedSuffixIndex | None = None,
        max_tokens: int = 32,
    ):
        self.own = TokenIndex(prompt)
        self.prompt_len = len(prompt)
        self.shared, self.max_tokens = shared, max_tokens

    def extend(self, tokens: Sequence[int]) -> None:
        self.own.extend(tokens)

    def matches(self) -> bool:
        """Whether the committed tokens' end occurred before (cheap: one dict lookup each)."""
        tail = tuple(self.own.tokens[-KEY:])
        own = self.own.follows.get(tail, ())
        if len(own) > 1 or (own and own[-1] < len(self.own.tokens)):
            return True
        return self.shared is not None and self.shared.matches(tail)

    def propose(self, limit: int | None = None) -> Proposal | None:
        """The most frequent continuation of the longest match of the committed tokens' end
        (at most ``limit`` tokens, else ``max_tokens``); None when nothing matches."""
        limit = self.max_tokens if limit is None else min(limit, self.max_tokens)
        tail = self.own.tokens[-MAX_MATCH:]
        if limit < 1 or len(tail) < KEY:
            return None
        found = self.own.occurrences(tail)
        if self.shared is not None:
            found += self.shared.occurrences(tail)
        if not found:
            return None
        match = max(m for m, _ in found)
        return _continuation([o for m, o in found if m == match], match, limit)

    def finish(self) -> None:
        if self.shared is not None:
            self.shared.add(self.own.tokens[self.prompt_len :])


def _continuation(alive: list[_Occurrence], match: int, limit: int) -> Proposal | None:
    """Follow the occurrences token by token, keeping the most frequent next token (and the
    occurrences that agree with it). Confidence: the share of occurrences that agree, times
    ``m / (m + 1)`` for the match so far ``m`` (a longer match is likelier to go on)."""
    tokens: list[int] = []
    confidence: list[float] = []
    for j in range(limit):
        if len(alive) == 1:  # one occurrence left: the rest is a slice (the common case)
            seq, s = alive[0]
            rest = list(seq[s + j : s + limit])
            tokens += rest
            confidence += [(match + i) / (match + i + 1) for i in range(j, j + len(rest))]
            break
        counts = Counter(seq[s + j] for seq, s in alive if s + j < len(seq))
        if not counts:
            break
        token, votes = counts.most_common(1)[0]
        m = match + j
        confidence.append(votes / len(alive) * m / (m + 1))
        tokens.append(token)
        alive = [(seq, s) for seq, s in alive if s + j < len(seq) and seq[s + j] == token]
    if not tokens:
        return None
    return Proposal(tokens, confidence, match)
