"""The per-request width policy behind ``block_size: "auto"`` (the ``WidthPolicy`` of ``policy.py``).

The controller picks the width ``B`` of each cycle to maximise expected committed tokens per
second::

    E[B] = 1 + sum_{i=1}^{B-1} prod_{j<=i} a_j        a_j = P(draft j accepted | drafts < j were)
    B*   = argmax_B  E[B] / t(B)                        t(1): plain step, no drafter pass

``a_j`` comes from the recent cycles (exponentially decayed counts per block position, lightly
shrunk towards a per-cycle rate, which also stands in for positions not tried lately), ``t`` from
the ``CostModel`` measured at load and refined from this request's cycle timings. Switching
between plain decoding and speculation needs a margin (hysteresis). When plain decoding wins,
the controller probes speculation again after a gap of plain steps that doubles after each probe
that does not pay (up to ``max_probe_gap``), the plain steps counted over the pair's requests
(``SharedPrior`` in ``evidence.py``, where the acceptance evidence lives too): however short the
requests, a drafter switched off is tried again. A fully accepted probe is followed at once by a wider one,
so it recovers when the text turns predictable. Any sequence of widths is lossless:
each cycle is exact on its own, and the width is chosen from past cycles only (never from the
drafts it is about to verify).

Suffix drafts (``drafters/suffix.py``) are a third choice: a proposal copied from the context,
verified without a drafter pass, possibly wider than the drafter's block. ``choose`` takes it
when its expected tokens per second, from the proposal's confidences (scaled by how well they
predicted recent suffix cycles) over the verify-only cost, beat the drafter's (or plain) choice.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from dflash_server.adaptive.costs import CostModel
from dflash_server.adaptive.evidence import AcceptanceModel, SharedPrior, SuffixTrust
from dflash_server.adaptive.policy import DRAFTER, SUFFIX, Choice, Source

if TYPE_CHECKING:
    from dflash_server.drafters.suffix import Proposal


_OFF = 1.5  # a cycle this many times cheaper than estimated says the costs are off
_UNTIMED = 1.1  # a narrower width no real cycle has timed looks this much better
_RECHECK = 8  # while decoding plainly, plain steps between two looks at speculation


class BlockController:
    """``block_size: "auto"``: the width per cycle from acceptance and cost (module docstring).

    ``next_size`` is called once per queued cycle, ``observe`` once per cycle read back, in the
    same order (a plain step may be queued before the previous one is read).
    """

    adaptive = True

    def __init__(
        self,
        max_block: int,
        costs: CostModel,
        *,
        probe_gap: int = 16,
        max_probe_gap: int = 256,
        probe_block: int = 2,
        probe_decay: float = 0.25,
        probe_budget: float = 0.02,
        prior: SharedPrior | None = None,
        margin: float = 0.05,
        min_trust: float = 0.3,
    ):
        self.max_block = max(1, max_block)
        self.block_size = self.max_block  # the widest it may pick (reported as block_size)
        self.costs = costs
        # The pair's (shared by its requests), or one of its own.
        self.prior, self.margin = prior or SharedPrior(), margin
        self.acceptance = self.prior.start(max(1, self.max_block - 1))
        self.min_gap, self.max_gap = probe_gap, max_probe_gap
        self.probe_block, self.probe_decay = probe_block, probe_decay
        self.probe_budget = probe_budget
        self.gap = self._first_gap()  # the pair's plain steps before the next probe
        self.plain_run = 0  # plain steps decided since the last speculative cycle
        self.probing = False  # the speculative cycle in flight is a probe
        self.speculating = False  # the last cycle decided was speculation that pays (no probe)
        self.widen_probe = 0  # width of a follow-up probe (after a fully accepted one)
        self.probes = 0
        self.trust = SuffixTrust()
        self.min_trust = min_trust
        self._rivals: dict[int, float] = {}  # room -> the drafter's best value (``_rival``)
        self.context = 0  # tokens the next cycle attends to (its costs grow with them)

    def _first_gap(self) -> int:
        """Plain steps before a first probe: at least ``min_gap``, and enough that a failed
        probe costs at most ``probe_budget`` of the plain decoding around it. Costs no real
        drafted cycle has checked yet (a calibration, maybe from a busy moment) earn one early
        probe: its risk is a single cycle."""
        if self.max_block == 1:  # no drafter: nothing to probe (suffix drafts only)
            return self.max_gap
        if not self.costs.checked:
            return self.min_gap
        extra = self.costs.cycle(self.probe_block) / self.costs.cycle(1) - 1
        return min(self.max_gap, max(self.min_gap, math.ceil(extra / self.probe_budget)))

    def _value(self, rates: list[float], size: int) -> float:
        return AcceptanceModel.expected(rates, size) / self.costs.cycle(size, context=self.context)

    def _values(self, limit: int) -> list[float]:
        """``_value`` of every width 1..``limit`` (index ``width - 1``), in one sweep."""
        rates, values = self.acceptance.rates(), []
        total, survive = 1.0, 1.0  # E[width], accumulated as ``AcceptanceModel.expected`` does
        for size, cost in enumerate(self.costs.curve(limit, self.context), 1):
            if 1 < size <= len(rates) + 1:
                survive *= rates[size - 2]
                total += survive
            values.append(total / cost)
        return values

    def _best(self, limit: int) -> tuple[int, int]:
        """(the width of most expected tokens per second, 1 where plain decoding wins; the best
        speculative width all the same, for a probe). Switching between plain decoding and
        speculation needs a ``margin`` (hysteresis: an estimate's error must not flip it)."""
        sizes = range(2, max(2, min(self.max_block, limit)) + 1)
        values = self._values(sizes[-1])
        value = {s: values[s - 1] for s in sizes}
        best = max(sizes, key=value.__getitem__)
        # A narrower width no real cycle has timed is tried on a small edge: a busy moment at
        # load can price it like its wider neighbours (docs/design.md, "Adaptive speculation").
        untimed = [s for s in sizes if s < best and s not in self.costs.timed]
        if untimed and self.costs.refine:  # (a real cycle could not correct a fixed curve)
            narrow = max(untimed, key=value.__getitem__)
            if _UNTIMED * value[narrow] > value[best]:
                best = narrow
        spec, plain = value[best], values[0]
        if self.plain_run:  # decoding plainly: speculation must clearly pay to start again
            return (best if spec > (1 + self.margin) * plain else 1), best
        return (1 if plain > (1 + self.margin) * spec else best), best

    def _suffix_best(self, proposal: Proposal, limit: int) -> tuple[int, float]:
        """(drafts, expected tokens per second) of the best prefix of a suffix proposal."""
        rates = self.trust.rates(proposal.confidence[:limit])
        costs = self.costs.curve(len(rates) + 1, self.context, drafted=False)
        best, value, total, survive = 0, 0.0, 1.0, 1.0
        for n, a in enumerate(rates, 1):
            survive *= a
            total += survive
            v = total / costs[n]
            if v > value:
                best, value = n, v
        return best, value

    def _rival(self, room: int) -> float:
        """Expected tokens per second of the drafter's best width (or plain), which a copy must
        beat; cached until the next observation (it is asked every step)."""
        key = min(room, self.max_block)
        if key not in self._rivals:
            width = self._best(room)[0] if self.max_block > 1 else 1
            self._rivals[key] = self._value(self.acceptance.rates(), width)
        return self._rivals[key]

    def might_copy(self, room: int, proposal: Proposal | None) -> bool:
        """Whether this proposal is a copy worth verifying now (the decoder then skips its
        plain lookahead, which decides before the last token is known); a passed-over chance
        lets old evidence fade, so a low trust is retried later. A mere match is not enough:
        with a large index of recent outputs nearly every pair of tokens matches somewhere,
        and giving up the lookahead for each slowed plain decoding by 15 %."""
        if self.trust.factor < self.min_trust:
            self.trust.forget()
            return False
        return self.copies(room, proposal) > 0

    def copies(self, room: int, proposal: Proposal | None) -> int:
        """How many of a suffix proposal's tokens to verify next (0: none), without deciding:
        its best prefix, when that beats (by ``margin``) the drafter's best width or plain."""
        if proposal is None or room <= 1:
            return 0
        n, value = self._suffix_best(proposal, room - 1)
        return n if n and value > (1 + self.margin) * self._rival(room) else 0

    def choose(self, room: int, proposal: Proposal | None = None, context: int = 0) -> Choice:
        """The next cycle: the suffix proposal's tokens when ``copies`` says so, else
        ``next_size``'s width; costs taken at ``context`` tokens."""
        if context != self.context:
            self.context = context
            self._rivals.clear()
        n = self.copies(room, proposal)
        if n:
            assert proposal is not None
            return Choice(SUFFIX, n + 1, tuple(proposal.tokens[:n]), tuple(proposal.confidence[:n]))
        if proposal is not None:
            self.trust.forget()
        return Choice.width(self.next_size(room))

    def next_size(self, room: int) -> int:
        """The width of the next cycle; at most ``room`` positions (tokens still wanted)."""
        if room <= 1 or self.max_block == 1:
            return 1
        if self.widen_probe:  # the last probe's block was fully accepted: look wider at once
            size, self.widen_probe = min(self.widen_probe, room), 0
            self.probing, self.plain_run, self.speculating = True, 0, False
            self.prior.plain_steps = 0
            self.probes += 1
            return size
        # While decoding plainly no acceptance evidence arrives: reuse the last choice, and
        # re-check only every few steps (the cost corrections still move; a row a batch holds
        # to plain wants to speculate at each look, so it must not look every step).
        # Probes are due once the pair's requests decided ``gap`` plain steps since the last
        # one: a drafter switched off is tried again however short the requests are (each
        # request looks at its first step).
        prior = self.prior
        if self.plain_run and self.plain_run % _RECHECK:
            self.plain_run += 1
            prior.plain_steps += 1
            return 1
        due = prior.plain_steps >= self.gap
        size, speculative = self._best(room)
        if size == 1 and due:  # probe: is speculation paying again?
            size = max(speculative, min(self.probe_block, room, self.max_block))
            self.probing = True
            self.probes += 1
            prior.plain_steps = 0
        if size == 1:
            if self.speculating:  # it just stopped paying here: a whole gap before a probe
                prior.plain_steps = 0
            self.plain_run += 1
            prior.plain_steps += 1
        else:
            self.plain_run = 0
        self.speculating = size > 1 and not self.probing
        return size

    def narrowed(self, size: int) -> None:
        """A batch's budget runs the last choice at ``size`` positions: at 1, the controller
        decodes plainly as if it had decided so, looking at speculation again every ``_RECHECK``th step
        (each look weighs every width, on every row of every pass)."""
        if size <= 1:
            if self.probing:  # the batch judged this probe not worth a pass: back off as if
                self.gap = min(2 * self.gap, self.max_gap)  # it had run and not paid
            self.speculating = self.probing = False
            self.plain_run = max(self.plain_run, 1)

    def observe(
        self,
        size: int,
        accepted: int,
        seconds: float | None,
        source: Source = DRAFTER,
        confidence: tuple[float, ...] = (),
    ) -> None:
        """A cycle of ``size`` positions committed ``accepted`` drafts (+1) in ``seconds``
        (a suffix copy: with the ``confidence`` its tokens were chosen with)."""
        self._rivals.clear()
        # Far cheaper than the costs said (they were taken at a busy moment): probe again soon.
        cheaper = False
        if seconds is not None:
            drafted = source != SUFFIX
            if size > 1:  # (only a probe asks)
                cheaper = seconds * _OFF < self.costs.cycle(size, drafted, self.context)
            self.costs.observe(size, seconds, drafted=drafted, context=self.context)
        if source == SUFFIX:
            self.trust.observe(confidence, accepted)
            return
        if size <= 1:
            return  # a plain step says nothing about acceptance
        # A probe's result outweighs the evidence that made speculation stop.
        decay = self.probe_decay if self.probing else None
        self.acceptance.observe(size - 1, accepted, decay)
        self.prior.update(self.acceptance)
        if self.probing:
            self.probing = False
            paid = self._best(self.max_block)[0] > 1
            if not paid and accepted == size - 1 and size < self.max_block:
                self.widen_probe = min(2 * size, self.max_block)  # a small block cannot tell
            elif paid or cheaper:
                self.gap = self._first_gap() if paid else self.min_gap
            else:
                self.gap = min(2 * self.gap, self.max_gap)

    def expected(self, choice: Choice, width: int) -> float:
        """Expected committed tokens of ``choice`` at ``width``: the acceptance estimate (a
        copy: its tokens' confidences, scaled by the trust in them)."""
        if choice.source == SUFFIX and width > 1:
            return AcceptanceModel.expected(self.trust.rates(choice.confidence), width)
        return AcceptanceModel.expected(self.acceptance.rates(), width)

    def estimate(self) -> dict[str, Any]:
        """The controller's current view, for stats and logs."""
        rates = self.acceptance.rates()
        best = self._best(self.max_block)[0] if self.max_block > 1 else 1
        return {
            "block_size": best,
            "expected_tau": round(AcceptanceModel.expected(rates, best), 3),
            "expected_speedup": round(
                self._value(rates, best) * self.costs.cycle(1, context=self.context), 3
            ),
            "acceptance": [round(a, 3) for a in rates],
            "plain_ms": round(1e3 * self.costs.cycle(1, context=self.context), 3),
            "cycle_ms": round(1e3 * self.costs.cycle(best, context=self.context), 3),
            "probes": self.probes,
            "suffix_trust": round(self.trust.factor, 3),
        }
