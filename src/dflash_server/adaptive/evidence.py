"""What the "auto" controller (``controller.py``) learns from, one kind of evidence per source.

The drafter's: ``AcceptanceModel``, each request's recent acceptance per block position, and
``SharedPrior``, where a pair's next request starts from. Suffix copies': ``SuffixTrust``, how
far their confidences held. No cycle of one source moves another source's evidence
(docs/design.md, "Adaptive speculation").
"""

from __future__ import annotations

from collections.abc import Sequence


class SuffixTrust:
    """How far to believe suffix confidences: the drafts recent suffix cycles got accepted over
    the number their confidences predicted (decayed sums plus ``prior`` drafts on each side, so
    one copy that breaks early does not end copying; within ``bounds``)."""

    def __init__(
        self,
        decay: float = 0.8,
        cap: float = 0.98,
        bounds: tuple[float, float] = (0.05, 1.5),
        prior: float = 4.0,
    ):
        self.decay, self.cap, self.bounds, self.prior = decay, cap, bounds, prior
        self.observed = self.predicted = 0.0

    @property
    def factor(self) -> float:
        ratio = (self.observed + self.prior) / (self.predicted + self.prior)
        return min(max(ratio, self.bounds[0]), self.bounds[1])

    def rates(
        self, confidence: tuple[float, ...] | list[float], factor: float | None = None
    ) -> list[float]:
        f = self.factor if factor is None else factor
        return [min(self.cap, f * c) for c in confidence]

    def forget(self, factor: float = 0.97) -> None:
        """A proposal passed over: let old evidence fade, so a low trust is retried later."""
        self.observed *= factor
        self.predicted *= factor

    def observe(self, confidence: tuple[float, ...], accepted: int) -> None:
        predicted = AcceptanceModel.expected(self.rates(confidence, 1.0), len(confidence) + 1) - 1
        self.observed = self.decay * self.observed + accepted
        self.predicted = self.decay * self.predicted + predicted


class SharedPrior:
    """Where a new request's acceptance estimate starts, and when it probes (the plain steps
    counted since the pair's last probe): the latest per-cycle rate (kept within
    ``bounds``, so one hopeless or perfect request never decides the next one's first cycles
    alone) and the per-position evidence any request on this pair saw, at most one cycle's
    worth per position. The positions matter: a pair that drafts 3 tokens right and then goes
    wrong reads as a flat 0.75 per draft, which undervalues a 4-wide block; and a pair whose
    full 8-wide blocks are all accepted must remember the one wider cycle that failed at the
    ninth position, or every request pays that wider cycle again."""

    def __init__(self, rate: float = 0.75, bounds: tuple[float, float] = (0.2, 0.9)):
        self.bounds = bounds
        self.rate = rate
        self.positions: list[tuple[float, float]] = []  # (accepted, tried) per draft position
        # Plain steps the pair's requests decided since one of them last probed speculation:
        # counted across requests, so short ones probe too (``BlockController.next_size``).
        self.plain_steps = 0

    def start(self, positions: int) -> AcceptanceModel:
        """A new request's acceptance model, starting from this prior."""
        return AcceptanceModel(positions, self.rate, prior_positions=self.positions)

    def update(self, acceptance: AcceptanceModel) -> None:
        low, high = self.bounds
        self.rate = min(max(acceptance.rate, low), high)
        # Counts, not rates (a shrunk rate taken as evidence would be shrunk twice), each
        # scaled down to at most one cycle's worth.
        self.positions = [
            (a / max(t, 1.0), t / max(t, 1.0))
            for a, t in zip(acceptance.accepted, acceptance.tried)
        ]


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
        prior_positions: Sequence[tuple[float, float]] = (),
    ):
        prior = list(prior_positions[:positions])  # (accepted, tried) each
        missing = [(0.0, 0.0)] * (positions - len(prior))
        self.accepted = [a for a, _ in prior + missing]
        self.tried = [t for _, t in prior + missing]  # index j-1: draft j
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
