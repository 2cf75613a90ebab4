"""Block-size policies: a fixed width, or the per-request controller behind ``block_size: "auto"``.

The controller picks the width ``B`` of each cycle to maximise expected committed tokens per
second::

    E[B] = 1 + sum_{i=1}^{B-1} prod_{j<=i} a_j        a_j = P(draft j accepted | drafts < j were)
    B*   = argmax_B  E[B] / t(B)                        t(1): plain step, no drafter pass

``a_j`` comes from the recent cycles (exponentially decayed counts per block position, lightly
shrunk towards a per-cycle rate, which also stands in for positions not tried lately), ``t`` from
the ``CostModel`` measured at load and refined from this request's cycle timings. Switching
between plain decoding and speculation needs a margin (hysteresis). When plain decoding wins,
the controller probes speculation again after a gap of plain steps that doubles after each probe
that does not pay (up to ``max_probe_gap``); a fully accepted probe is followed at once by a
wider one, so it recovers when the text turns predictable. Any sequence of widths is lossless:
each cycle is exact on its own, and the width is chosen from past cycles only (never from the
drafts it is about to verify).
"""

from __future__ import annotations

import math
from typing import Any

from dflash_server.generation.costs import CostModel


class FixedBlock:
    """The same width every cycle (``block_size`` given as a number, or plain decoding)."""

    adaptive = False

    def __init__(self, block_size: int):
        self.block_size = block_size

    def next_size(self, room: int) -> int:
        return max(1, min(self.block_size, room))

    def observe(self, size: int, accepted: int, seconds: float | None) -> None:
        pass

    def estimate(self) -> dict[str, Any] | None:
        return None


class SharedPrior:
    """Where a new request's acceptance estimate starts: the latest per-cycle rate any request
    on this pair saw (kept within ``bounds``, so one hopeless or perfect request never decides
    the next one's first cycles alone)."""

    def __init__(self, rate: float = 0.75, bounds: tuple[float, float] = (0.2, 0.9)):
        self.bounds = bounds
        self.rate = rate

    def update(self, rate: float) -> None:
        self.rate = min(max(rate, self.bounds[0]), self.bounds[1])


class AcceptanceModel:
    """Recent acceptance: a per-cycle rate, and decayed per-position counts shrunk towards it.

    The rate is an average over cycles (each weighs the same), of each cycle's own estimate
    ``accepted / (accepted + rejected?)``: a run of full blocks then counts as many cycles, not
    as hundreds of accepted drafts, so a turn to unpredictable text shows within a few cycles.
    Positions past a full block (never tried) keep their evidence, fading slowly: a width that
    stops at the acceptance length must not forget why it stopped there.
    """

    def __init__(
        self,
        positions: int,
        prior_rate: float = 0.75,
        shrink: float = 0.5,
        decay: float = 0.8,
        stale_decay: float = 0.97,
    ):
        self.tried = [0.0] * positions  # index j-1: draft j
        self.accepted = [0.0] * positions
        self.rate = prior_rate
        self.shrink, self.decay, self.stale_decay = shrink, decay, stale_decay

    def observe(self, drafted: int, accepted: int, decay: float | None = None) -> None:
        """One cycle drafted ``drafted`` tokens and the first ``accepted`` survived; older
        evidence is scaled by ``decay`` first (default: the model's; a probe passes less)."""
        decay = self.decay if decay is None else decay
        # Geometric estimate of one cycle; a full block is censored (its next draft was never
        # tried), so it counts as half a rejection rather than proof of certain acceptance.
        full = accepted == drafted
        own = (accepted + full) / (accepted + 1 + full) if drafted else self.rate
        self.rate = decay * self.rate + (1 - decay) * own
        reached = min(accepted + 1, drafted, len(self.tried))
        for j in range(len(self.tried)):
            # Beyond a full block the evidence is only censored, so it keeps (slowly fading);
            # beyond a rejection it fades as fast as what was tried (the text may have turned).
            factor = self.stale_decay if j >= reached and full else decay
            self.tried[j] *= factor
            self.accepted[j] *= factor
            if j < reached:
                self.tried[j] += 1.0
                self.accepted[j] += 1.0 if j < accepted else 0.0

    def rates(self) -> list[float]:
        """a_j per draft position, each shrunk towards the recent per-cycle rate."""
        rate, k = self.rate, self.shrink
        return [(a + k * rate) / (t + k) for a, t in zip(self.accepted, self.tried)]

    @staticmethod
    def expected(rates: list[float], size: int) -> float:
        """E[committed tokens] of a cycle of ``size`` positions (``size - 1`` drafts)."""
        total, survive = 1.0, 1.0
        for a in rates[: size - 1]:
            survive *= a
            total += survive
        return total


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
    ):
        self.max_block = max(1, max_block)
        self.block_size = self.max_block  # the widest it may pick (reported as block_size)
        self.costs = costs
        self.prior, self.margin = prior, margin
        start = {} if prior is None else {"prior_rate": prior.rate}
        self.acceptance = AcceptanceModel(max(1, self.max_block - 1), **start)
        self.min_gap, self.max_gap = probe_gap, max_probe_gap
        self.probe_block, self.probe_decay = probe_block, probe_decay
        self.probe_budget = probe_budget
        self.gap = self._first_gap()  # plain steps before the next probe
        self.plain_run = 0  # plain steps decided since the last speculative cycle
        self.probing = False  # the speculative cycle in flight is a probe
        self.widen_probe = 0  # width of a follow-up probe (after a fully accepted one)
        self.probes = 0

    def _first_gap(self) -> int:
        """Plain steps before a first probe: at least ``min_gap``, and enough that a failed
        probe costs at most ``probe_budget`` of the plain decoding around it."""
        extra = self.costs.cycle(self.probe_block) / self.costs.cycle(1) - 1
        return min(self.max_gap, max(self.min_gap, math.ceil(extra / self.probe_budget)))

    def _value(self, rates: list[float], size: int) -> float:
        return AcceptanceModel.expected(rates, size) / self.costs.cycle(size)

    def _best(self, limit: int, minimum: int = 1) -> int:
        """The width of most expected tokens per second. Switching between plain decoding and
        speculation needs a ``margin`` (hysteresis: an estimate's error must not flip it)."""
        rates = self.acceptance.rates()
        sizes = range(max(2, minimum), max(2, min(self.max_block, limit)) + 1)
        best = max(sizes, key=lambda s: self._value(rates, s))
        if minimum > 1:
            return best
        spec, plain = self._value(rates, best), self._value(rates, 1)
        if self.plain_run:  # decoding plainly: speculation must clearly pay to start again
            return best if spec > (1 + self.margin) * plain else 1
        return 1 if plain > (1 + self.margin) * spec else best

    def next_size(self, room: int) -> int:
        """The width of the next cycle; at most ``room`` positions (tokens still wanted)."""
        if room <= 1 or self.max_block == 1:
            return 1
        if self.widen_probe:  # the last probe's block was fully accepted: look wider at once
            size, self.widen_probe = min(self.widen_probe, room), 0
            self.probing, self.plain_run = True, 0
            self.probes += 1
            return size
        # While decoding plainly no acceptance evidence arrives: reuse the last choice, and
        # re-check only every few steps (the cost corrections still move).
        if self.plain_run and self.plain_run % 8 and self.plain_run < self.gap:
            self.plain_run += 1
            return 1
        size = self._best(room)
        if size == 1 and self.plain_run >= self.gap:  # probe: is speculation paying again?
            size = max(self._best(room, 2), min(self.probe_block, room, self.max_block))
            self.probing = True
            self.probes += 1
        if size == 1:
            self.plain_run += 1
        else:
            self.plain_run = 0
        return size

    def observe(self, size: int, accepted: int, seconds: float | None) -> None:
        """A cycle of ``size`` positions committed ``accepted`` drafts (+1) in ``seconds``."""
        if seconds is not None:
            self.costs.observe(size, seconds)
        if size <= 1:
            return  # a plain step says nothing about acceptance
        # A probe's result outweighs the evidence that made speculation stop.
        decay = self.probe_decay if self.probing else None
        self.acceptance.observe(size - 1, accepted, decay)
        if self.prior is not None:
            self.prior.update(self.acceptance.rate)
        if self.probing:
            self.probing = False
            paid = self._best(self.max_block) > 1
            if not paid and accepted == size - 1 and size < self.max_block:
                self.widen_probe = min(2 * size, self.max_block)  # a small block cannot tell
            else:
                self.gap = self._first_gap() if paid else min(2 * self.gap, self.max_gap)

    def estimate(self) -> dict[str, Any]:
        """The controller's current view, for stats and logs."""
        rates = self.acceptance.rates()
        best = self._best(self.max_block)
        return {
            "block_size": best,
            "expected_tau": round(AcceptanceModel.expected(rates, best), 3),
            "expected_speedup": round(self._value(rates, best) * self.costs.cycle(1), 3),
            "acceptance": [round(a, 3) for a in rates],
            "plain_ms": round(1e3 * self.costs.cycle(1), 3),
            "cycle_ms": round(1e3 * self.costs.cycle(best), 3),
            "probes": self.probes,
        }
