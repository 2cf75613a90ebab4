"""When a batch that its verify budget holds to plain decoding drafts anyway, to measure it.

The budget (``adaptive/pass_costs.py``) narrows rows whose drafts would not pay in a pass of
several rows; its curves may come from a busy moment, so now and then it lets such a pass
through (a probe). Probes come at once while no real speculative pass has checked the
calibration, then after a gap of narrowed passes that doubles; once the calibration is settled,
the gap is also long enough that a probe's extra cost is at most ``_SHARE`` of the plain passes
in it. A probe that pays, or runs far cheaper than estimated, brings the next one soon. While
the batch holds the same rows and no probe is due, they need not even look
(docs/design.md, "Batching under speculation").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dflash_server.adaptive.pass_costs import PassCosts, choose_widths
from dflash_server.adaptive.policy import Choice
from dflash_server.generation.row import Row

_GAP, _MAX_GAP = 4, 1024  # narrowed passes before the budget lets one through
_HOLD = 8  # a gap from which narrowed rows decode plainly a while (they re-check less)
# A probe's extra cost over a plain pass, at most this share of the gap's (a drafted pass of
# 4 rows may cost 3 plain ones: a probe every few passes lost 5 %; at 2 % a held batch of 8
# rows still ran about 1 % slower than at 1 %).
_SHARE = 0.01
_OFF = math.log(1.5)  # a pass this much cheaper than estimated says the costs are off


class Probes:
    """The probe schedule of one batch."""

    def __init__(self) -> None:
        self.capped, self.gap = 0, _GAP  # passes the budget narrowed since a probe; the next
        self.holding = False  # it narrowed rows to plain, which follow it (controller.py)
        self.held: set[Row] = set()  # the rows of the pass that last narrowed
        self.probing = False  # this pass is a probe

    @property
    def followed(self) -> bool:
        """Whether narrowed rows follow the batch: the narrowing has persisted a while."""
        return self.gap >= _HOLD

    def quiet(self, rows: Sequence[Row]) -> bool:
        """Whether a pass can run plain without asking its rows: the budget has held these
        very rows to plain a while and its next probe is not due, and no row keeps its own
        width or has a copy on offer (their looks, each a sweep of every width and then the
        budget's, cost a held batch 2-3 % of its passes). Counts the pass as narrowed."""
        if len(rows) < 2 or not (self.holding and self.followed) or self.capped + 1 >= self.gap:
            return False  # (a lone row is never budgeted)
        free = not any(row.pinned or not row.policy.adaptive for row in rows)
        if free and self.held.issuperset(rows) and not any(r.copying() for r in rows):
            self.capped += 1
            return True
        return False

    def unnarrowed(self, drafted: bool) -> None:
        """The budget ran the rows' own widths: probing starts over once drafts ran; while
        held, the gap runs on."""
        if drafted:
            self.capped, self.gap, self.holding = 0, _GAP, False
        elif self.holding:
            self.capped += 1

    def narrowed(
        self, rows: Sequence[Row], choices: Sequence[Choice], costs: PassCosts
    ) -> list[int] | None:
        """The budget narrowed ``rows``: the widths of a probe when one is due (at the curves'
        own cap, their judgement of what drafting delivered aside, or at the rows' own widths
        where the curves say plain), else None."""
        self.holding, self.held = True, set(rows)
        if costs.checked:
            self.capped += 1
            if self.capped < self.gap:
                return None
        curves = choose_widths(rows, choices, costs, judged=False)
        widths = curves if max(curves) > 1 else [c.size for c in choices]
        if costs.checked:
            gap = 2 * self.gap
            if costs.settled:  # before, a busy calibration must not make the next probe wait
                predicted = costs.cost(len(rows), max(widths), _at(rows))
                gap = max(gap, self._covering(predicted, costs, rows))
            self.capped, self.gap = 0, min(gap, _MAX_GAP)
        self.probing = True
        return widths

    def observed(
        self, costs: PassCosts, rows: Sequence[Row], width: int, seconds: float, error: float
    ) -> None:
        """After a pass that ``costs`` observed (``error``: log of its time over the estimate):
        a probe that paid, or far cheaper than estimated, brings the next one soon; one that
        did not makes the next wait out what it really cost."""
        if self.capped == 0 and (error < -_OFF or (width > 1 and costs.paid)):
            self.gap = _GAP
        elif self.probing and costs.settled:
            self.gap = min(max(self.gap, self._covering(seconds, costs, rows)), _MAX_GAP)
        self.probing = False

    @staticmethod
    def _covering(seconds: float, costs: PassCosts, rows: Sequence[Row]) -> int:
        """Plain passes of ``rows`` whose ``_SHARE`` is a pass of ``seconds``'s extra cost."""
        extra = seconds / costs.cost(len(rows), 1, _at(rows)) - 1
        return math.ceil(extra / _SHARE)


def _at(rows: Sequence[Row]) -> list[int]:
    return [row.position for row in rows]
