"""What a cycle verifies and who decides it: the ``Source`` of its drafts, the ``Choice`` of one
cycle, and the ``WidthPolicy`` protocol a row asks before each cycle.

Two policies ship: ``FixedBlock`` (the same width every cycle: a number, or plain decoding) and
the "auto" ``BlockController`` (``controller.py``). Any sequence of widths is lossless: each
cycle is exact on its own (docs/design.md, "Adaptive speculation").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, get_args

if TYPE_CHECKING:
    from dflash_server.drafters.suffix import Proposal

# Where a cycle's drafts come from: the drafter's block, tokens copied from the context
# (suffix drafts), or none (a plain decoding step, one position).
Source = Literal["drafter", "suffix", "plain"]
SOURCES: tuple[Source, ...] = get_args(Source)
DRAFTER: Source = "drafter"
SUFFIX: Source = "suffix"
PLAIN: Source = "plain"


@dataclass(frozen=True)
class Choice:
    """What the next cycle verifies: ``size`` positions (1: a plain step), drafted by the
    drafter or copied (``tokens``, ``size - 1`` of them, with their ``confidence``) from a
    suffix proposal."""

    source: Source
    size: int
    tokens: tuple[int, ...] = ()
    confidence: tuple[float, ...] = ()

    @classmethod
    def width(cls, size: int) -> Choice:
        """The drafter's block of ``size`` positions (1: a plain step)."""
        return cls(DRAFTER if size > 1 else PLAIN, size)

    def narrow(self, size: int) -> Choice:
        """The same choice at most ``size`` positions wide (a copy keeps its first tokens)."""
        if size >= self.size:
            return self
        if size > 1 and self.source == SUFFIX:
            return Choice(SUFFIX, size, self.tokens[: size - 1], self.confidence[: size - 1])
        return Choice.width(size)


class WidthPolicy(Protocol):
    """Picks each cycle of one request. ``choose`` is called once per queued cycle and
    ``observe`` once per cycle read back, in the same order (a plain step may be queued before
    the previous one is read)."""

    @property
    def block_size(self) -> int:  # the widest drafter block it may pick (1: plain only)
        ...

    @property
    def adaptive(self) -> bool:  # it decides from acceptance and cost ("auto")
        ...

    def choose(self, room: int, proposal: Proposal | None = None, context: int = 0) -> Choice:
        """The next cycle, at most ``room`` positions (tokens still wanted); ``proposal``: the
        suffix copy on offer, if any; ``context``: the tokens the cycle attends to."""
        ...

    def might_copy(self, room: int, proposal: Proposal | None) -> bool:
        """Whether this suffix proposal would be verified now (a copy running on): a decoder
        that looks ahead past the next token does not, then."""
        ...

    def narrowed(self, size: int) -> None:
        """A batch's verify budget runs the last choice at ``size`` positions instead."""
        ...

    def observe(
        self,
        size: int,
        accepted: int,
        seconds: float | None,
        source: Source = DRAFTER,
        confidence: tuple[float, ...] = (),
    ) -> None:
        """A cycle of ``size`` positions kept ``accepted`` drafts, in ``seconds`` of wall time."""
        ...

    def expected(self, choice: Choice, width: int) -> float:
        """Expected committed tokens of ``choice`` narrowed to ``width`` (the batch's budget)."""
        ...

    def estimate(self) -> dict[str, Any] | None:
        """Its current view, for stats and logs (None: nothing to say)."""
        ...


class FixedBlock:
    """The same width every cycle (``block_size`` given as a number, or plain decoding); it
    never copies: suffix drafts need the costs only "auto" has."""

    adaptive = False

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._cycles = self._tokens = 0  # its observed tau: what the batch expects of it

    def choose(self, room: int, proposal: Proposal | None = None, context: int = 0) -> Choice:
        return Choice.width(max(1, min(self.block_size, room)))

    def might_copy(self, room: int, proposal: Proposal | None) -> bool:
        return False

    def narrowed(self, size: int) -> None:
        pass

    def observe(
        self,
        size: int,
        accepted: int,
        seconds: float | None,
        source: Source = DRAFTER,
        confidence: tuple[float, ...] = (),
    ) -> None:
        self._cycles += 1
        self._tokens += accepted + 1

    def expected(self, choice: Choice, width: int) -> float:
        return self._tokens / self._cycles if self._cycles else 1.0

    def estimate(self) -> dict[str, Any] | None:
        return None
