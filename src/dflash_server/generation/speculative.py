"""The DFlash draft/verify loop of one request alone: a ``Row`` on its own cache.

One cycle: the drafter proposes ``B-1`` tokens in one pass from ``[last, mask, ...]``; the target
scores ``[last, d1..d(B-1)]`` in one pass; the longest agreeing prefix plus one target token (the
bonus) is committed (``Row.score`` / ``Row.read``). The cache is rolled back to "prompt +
committed", and the taps of the committed positions become the drafter's new context. All MLX
work runs on mlx-lm's generation stream with one host sync per cycle; the next cycle is queued
before the caller sees this cycle's tokens, and the rollback is deferred until the next draft
is already queued (docs/design.md, "Speed").

A cycle may instead verify tokens copied from the context (a suffix copy: no drafter pass) or
be a plain step (one position); the row's policy picks. ``LoneRows`` runs several rows this
way, one cycle each per step (the engine's "interleave" scheduling).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Generator, Iterator
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import generation_stream

from dflash_server.adaptive.policy import DRAFTER, SUFFIX, Choice
from dflash_server.drafters.protocol import Drafter
from dflash_server.generation.cycle import Commit, Cycle
from dflash_server.generation.prefill import prefill, prefill_steps
from dflash_server.generation.row import Row
from dflash_server.models.mrope import Positions


class SpeculativeDecoder:
    """Runs one ``Row`` alone: prefill, then cycles on the row's own cache."""

    def __init__(self, row: Row) -> None:
        self.row = row
        self.rollback = row.target.make_rollback(row.cache)
        self._pending: tuple[int, int] | None = None  # (keep, fed) of the last verify

    @property
    def stats(self) -> Any:
        return self.row.stats

    def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        eos_ids: set[int] | frozenset[int] = frozenset(),
        yield_chunks: bool = False,
    ) -> Generator[Commit, None, None]:
        """Yield commits of tokens (the first holds the prefill's token) until one has a
        ``finish`` (an EOS id, ``max_tokens``). ``yield_chunks``: also yield ``PREFILL_CHUNK``
        after each prompt chunk but the last, so a scheduler can run others in between."""
        if max_tokens <= 0:
            return
        row = self.row
        row.begin(prompt, max_tokens, eos_ids)
        try:
            first = (yield from prefill_steps(row)) if yield_chunks else prefill(row)
            yield from self._cycles(row.read(first))
        finally:  # also when the consumer stops early: the output so far joins the shared index
            row.finish()

    def _cycles(self, commit: Commit) -> Iterator[Commit]:
        row = self.row
        # Without penalties or constraints (which read the committed tokens on the host), the
        # plain step after a plain step can be queued before that step is read back. A
        # speculative cycle waits for the read: it needs the step's taps, and on CPU queueing
        # it early would run it inside the step's timing, misleading the "auto" cost model.
        lookahead = not row.sampler.processors and row.constraint is None
        queued: Cycle | None = None
        planned: Choice | None = None  # the choice made during a lookahead, not yet queued
        while commit.finish is None:
            ahead = queued is not None  # this step was queued before the last one was read
            cycle = queued or self._queue(planned or row.choose(), row.last)
            yield commit
            queued = planned = None
            # A lookahead decides before the step's token is known: not while a copy may be
            # verified (one starting at that token would be missed).
            if lookahead and cycle.size == 1 and row.room > 1 and not row.copying():
                planned = row.policy.choose(row.room - 1, context=row.position)
                if planned.size == 1:
                    queued, planned = self._queue(planned, cycle.result[1:2]), None
            # The time between two reads is one cycle's work only in a steady state: on CPU,
            # queueing a step runs much of it, so a plain run's first step between reads holds
            # two steps and its last almost none (timing them made plain look 25 % cheaper
            # right after each probe, and "auto" fell back to plain).
            steady = cycle.size > 1 or not lookahead or (ahead and queued is not None)
            commit = self._read(cycle, steady)
        yield commit

    def _read(self, cycle: Cycle, timed: bool = True) -> Commit:
        """The row reads its cycle (``timed``: its wall time is what it cost); the rollback to
        what it kept waits for the next cycle."""
        commit = self.row.read(cycle, timed=timed)
        if cycle.size > 1:
            self._pending = (self.row.kept, cycle.size)
        return commit

    def _queue(self, choice: Choice, anchor: mx.array) -> Cycle:
        """Build (lazily) and start one cycle of ``choice.size`` positions after ``anchor``."""
        row = self.row
        drafts = log_q = None
        with mx.stream(generation_stream):
            history = row.history()
            if choice.source == DRAFTER:
                drafter = cast(Drafter, row.draft)  # drafter cycles only come with a drafter
                drafts, log_q = drafter.propose([row.draft_row(choice.size, anchor, history)])[0]
                if row.stats.timings is None:
                    # Start drafting now; the rollback and verify graphs are built while it
                    # runs (on Metal; on CPU async_eval returns once little work is queued).
                    mx.async_eval(drafts, *([] if log_q is None else [log_q]))
                self._timed("draft", drafts)
                choice = choice.narrow(drafts.shape[0] + 1)  # a drafter may cut its block short
                if choice.size == 1:
                    drafts = log_q = None
            elif choice.source == SUFFIX:  # a copy: known on the host, no drafter pass
                drafts = mx.array(choice.tokens, dtype=mx.int32)
            self._apply_rollback()
            row.quantize_kv()
            tokens = (
                anchor if drafts is None else mx.concatenate([anchor, drafts.astype(anchor.dtype)])
            )
            recording = (
                self.rollback.recording() if drafts is not None else contextlib.nullcontext()
            )
            with recording:
                logits, taps = row.target.forward(
                    tokens[None], row.cache, slice(None), positions=Positions.shifted(row.shift)
                )
            cycle = row.score(choice, logits[0], taps, tokens, log_q, history)
            self._timed("plain" if drafts is None else "verify", *cycle.arrays())
        mx.async_eval(*cycle.arrays())
        return cycle

    def _apply_rollback(self) -> None:
        """Roll the cache back after the last verify (deferred so that the next draft is
        already running while the host builds these ops)."""
        if self._pending is not None:
            keep, fed = self._pending
            self._pending = None
            self.rollback.rollback(keep=keep, fed=fed)
            self._timed("rollback", [c.state for c in self.row.cache])

    def _timed(self, phase: str, *arrays: Any) -> None:
        """In profiling mode, evaluate a phase on its own and charge its wall time."""
        timings = self.row.stats.timings
        if timings is None:
            return
        start = time.perf_counter()
        mx.eval(*arrays)
        timings[phase] = timings.get(phase, 0.0) + time.perf_counter() - start


class LoneRows:
    """Rows that each run alone (``SpeculativeDecoder``), one cycle or prompt chunk each per
    ``step``: the "interleave" scheduling, and the rows a batch cannot hold. The same
    ``add`` / ``remove`` / ``step`` surface as ``BatchDecoder``."""

    def __init__(self) -> None:
        self.runs: dict[Row, Generator[Commit, None, None]] = {}

    @property
    def busy(self) -> bool:
        """Whether a ``step`` has anything to do."""
        return bool(self.runs)

    def add(
        self,
        row: Row,
        prompt: list[int],
        max_tokens: int,
        eos_ids: set[int] | frozenset[int] = frozenset(),
    ) -> None:
        self.runs[row] = SpeculativeDecoder(row).generate(prompt, max_tokens, eos_ids, True)

    def remove(self, row: Row) -> None:
        """Stop a row (finished or cancelled): its caches are freed now, not at GC."""
        run = self.runs.pop(row, None)
        if run is not None:
            run.close()

    def step(self) -> dict[Row, Commit | Exception]:
        """One cycle (or prompt chunk) of every row; a row whose commit ends it, or whose
        cycle failed, has left."""
        out: dict[Row, Commit | Exception] = {}
        for row, run in list(self.runs.items()):
            try:
                out[row] = commit = next(run)
            except StopIteration:  # nothing at all to produce (max_tokens 0)
                out[row] = Commit([], finish="length")
                self.remove(row)
                continue
            except Exception as exc:
                out[row] = exc
                self.remove(row)
                continue
            if commit.finish is not None:
                self.remove(row)
        return out
