"""The drafting rows of a batched pass: each drafter's rows in one call where it can.

Rows keep their own context caches; a drafter that implements ``RowDrafter.propose_rows`` (the
DFlash drafter: one forward for all its rows, ``models/draft_rows.py``) drafts its rows
together, any other drafter row by row, exactly as alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from dflash_server.generation.protocols import DraftRow, RowDrafter


def propose_rows(rows: Sequence[DraftRow]) -> list[tuple[mx.array, mx.array | None]]:
    """(drafts, log q) per row, in order."""
    out: list[tuple[mx.array, mx.array | None] | None] = [None] * len(rows)
    groups: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(id(row.drafter), []).append(i)
    for members in groups.values():
        drafter = rows[members[0]].drafter
        mine = [rows[i] for i in members]
        if len(mine) > 1 and isinstance(drafter, RowDrafter):
            proposals = drafter.propose_rows(mine)
        else:
            proposals = [row.propose() for row in mine]
        for i, proposal in zip(members, proposals):
            out[i] = proposal
    return [p for p in out if p is not None]
