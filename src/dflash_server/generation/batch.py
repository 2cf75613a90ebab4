"""Continuous batching under speculation: all running requests advance in one target pass.

Each request keeps its own ``SpeculativeDecoder`` (sampler, penalties, constraint, block policy,
drafter context, stats); only the target cache is shared, as rows of a ``BatchCache``. A pass:

1. every row picks its cycle (its policy: a drafter block, a suffix copy, or width 1 = a plain
   decoding row) and, when drafting, runs its drafter on its own context (rows may even have
   different drafters; copies need no drafter pass);
2. one target forward verifies all rows, each right-padded to the widest;
3. per row: the processed logits, acceptance, bonus and logprobs, exactly as alone;
4. per row rollback: attention columns past the row's kept prefix become unattendable, each
   Gated DeltaNet row takes the state after its own kept prefix, and the drafter context gets
   only the row's committed positions' taps.

Prompts of one chunk or less that the prefix cache does not hold wait for the next ``step``,
which prefills them together in one forward (``batch_prefill.py``); a longer prompt, or a prefix
hit, prefills alone, chunk by chunk (``prefill_steps``, yielding between chunks, so the owner
advances the batch in between). Then the request's caches move into the batch as a new row. It
leaves the batch when it finishes or its generator is closed (cancelled). Outputs are those of
the request run alone: greedy token for token (on fp32, where kernels do not change with row
count; docs/design.md, "Batching under speculation"), sampled rows with the same law.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

import mlx.core as mx
from mlx_lm.generate import generation_stream

from dflash_server.generation.batch_budget import PassCosts, choose_widths
from dflash_server.generation.batch_cache import BatchCache, batchable, rollback_rows
from dflash_server.generation.batch_draft import DraftRow, propose_rows
from dflash_server.generation.batch_prefill import prefill_together
from dflash_server.generation.controller import DRAFTER, PLAIN, SUFFIX, Choice
from dflash_server.generation.cycle import FLUSH, PREFILL_CHUNK, Commit, Cycle, terminate
from dflash_server.generation.sampling import point_mass
from dflash_server.generation.speculative import SpeculativeDecoder
from dflash_server.generation.target import TargetModel

K = TypeVar("K")


class _Row:
    """A request in the batch: its decoder, next anchor token and the commit of the last pass."""

    def __init__(self, decoder: SpeculativeDecoder, last: Any) -> None:
        self.decoder, self.last = decoder, last
        self.room = 0  # tokens it may still produce
        self.first: Cycle | None = None  # a batched prefill's first token
        self.inbox: Commit | None = None
        self.error: Exception | None = None

    def take_first(self) -> Cycle:
        if self.error is not None or self.first is None:
            raise RuntimeError(f"batched prefill failed: {self.error}") from self.error
        return self.first

    def take(self) -> Commit:
        if self.error is not None:
            raise RuntimeError(f"batched pass failed: {self.error}") from self.error
        if self.inbox is None:
            raise RuntimeError("a batch row was stepped before a pass produced its tokens")
        commit, self.inbox = self.inbox, None
        return commit


class BatchDecoder:
    """The running rows of one target model and their shared cache; ``step`` runs one pass.

    ``costs`` (measured pass costs, ``batch_budget.py``) caps the adaptive rows' widths where
    the batch commits the most tokens per second; ``max_verify`` caps the positions one pass
    verifies (rows x width): the widest rows are narrowed to fit (None: no cap).
    """

    def __init__(self, target: TargetModel, max_verify: int | None = None) -> None:
        self.target = target
        self.max_verify = max_verify
        self.rows: list[_Row] = []
        self.cache: BatchCache | None = None
        self.passes = 0
        self.last_pass: tuple[int, int] = (0, 0)  # (rows, verified positions) of the last pass
        self.histogram: dict[int, int] = {}  # rows in a pass -> passes
        self.costs: PassCosts | None = None  # measured pass costs: the verify budget
        self.waiting: list[tuple[_Row, list[int]]] = []  # short prompts for the next prefill
        self.prefilled_together = 0  # prompts prefilled in a shared forward

    def supports(self, decoder: SpeculativeDecoder) -> bool:
        """Whether this request can run as a row (same model and taps, plain KV / GDN caches)."""
        same_taps = decoder.draft is None or decoder.target.tap_ids == self.target.tap_ids
        return decoder.target.model is self.target.model and same_taps and batchable(decoder.cache)

    # -- rows ---------------------------------------------------------------------------------

    def join(
        self,
        decoder: SpeculativeDecoder,
        prompt: list[int],
        max_tokens: int,
        eos_ids: set[int] | frozenset[int] = frozenset(),
    ) -> Iterator[Commit]:
        """``decoder.generate`` with the cycles run by this batch: yields ``PREFILL_CHUNK``
        between prompt chunks, the prefill's token, then one commit per pass (the owner calls
        ``step`` before each ``next``). A request the batch cannot hold runs alone."""
        if not self.supports(decoder):
            yield from decoder.generate(prompt, max_tokens, eos_ids, yield_chunks=True)
            return
        if max_tokens <= 0:
            return
        row, produced = _Row(decoder, None), 0
        try:
            if self._prefills_together(decoder, prompt):
                self.waiting.append((row, prompt))
                while row.first is None and row.error is None:
                    yield PREFILL_CHUNK  # a ``step`` prefills it with others, when it fits
                first = row.take_first()
            else:
                first = yield from decoder.prefill_steps(prompt)
            commit, row.last = decoder._read(first, first=True)
            while True:
                commit = terminate(commit, max_tokens - produced, eos_ids)
                produced += len(commit.tokens)
                decoder._committed(commit.tokens)
                if commit.finish is not None:
                    self._leave(row)  # before the caller hears the end: no pass includes it
                    yield commit
                    return
                row.room = max_tokens - produced
                if row not in self.rows:
                    self._enter(row)
                yield commit
                commit = row.take()
        finally:
            self._leave(row)
            self.waiting = [w for w in self.waiting if w[0] is not row]  # cancelled waiting
            if decoder.suffix is not None:  # the output so far joins the shared index
                decoder.suffix.finish()

    def _prefills_together(self, decoder: SpeculativeDecoder, prompt: list[int]) -> bool:
        """Whether the prompt waits for a batched prefill: one chunk long and cold (a prefix
        hit restores its own way, and a longer prompt goes chunk by chunk)."""
        return len(prompt) <= decoder.prefill_step_size and decoder.prefix_hit(prompt) is None

    def _prefill_waiting(self) -> None:
        """Prefill the waiting prompts that fit one chunk together (in arrival order)."""
        group: list[tuple[_Row, list[int]]] = []
        widest = 0
        for row, prompt in self.waiting:
            widest = max(widest, len(prompt))
            if group and widest * (len(group) + 1) > row.decoder.prefill_step_size:
                break
            group.append((row, prompt))
        del self.waiting[: len(group)]
        try:
            if len(group) == 1:
                ((row, prompt),) = group
                row.first = row.decoder.prefill(prompt)
            else:
                decoders = [r.decoder for r, _ in group]
                cycles = prefill_together(self.target, decoders, [p for _, p in group])
                for (row, _), cycle in zip(group, cycles):
                    row.first = cycle
                self.prefilled_together += len(group)
        except Exception as exc:  # each of these requests' next step reports it; rows go on
            for row, _ in group:
                row.error = exc

    def _enter(self, row: _Row) -> None:
        cache = row.decoder.cache
        with mx.stream(generation_stream):
            if self.cache is None:
                self.cache = BatchCache([type(c) for c in cache])
            self.cache.add_row(cache)
        row.decoder.cache = []  # the batch holds it now
        self.rows.append(row)

    def _leave(self, row: _Row) -> None:
        if row in self.rows:
            index = self.rows.index(row)
            self.rows.pop(index)
            assert self.cache is not None
            with mx.stream(generation_stream):
                self.cache.remove_row(index)

    # -- one pass -----------------------------------------------------------------------------

    def _choices(self, rows: list[_Row]) -> list[Choice]:
        """Each row's next cycle (its policy: drafter block, suffix copy or plain), narrowed by
        the verify budget and the ``max_verify`` cap."""
        choices = [r.decoder._choose(r.room) for r in rows]
        widths = [c.size for c in choices]
        if self.costs is not None and len(rows) > 1:  # the verify budget (batch_budget.py)
            widths = choose_widths([r.decoder for r in rows], choices, self.costs)
        if self.max_verify is not None:
            while max(widths) > 1 and len(rows) * max(widths) > self.max_verify:
                top = max(widths)
                widths = [w - 1 if w == top else w for w in widths]
        return [c.narrow(w) for c, w in zip(choices, widths)]

    def step(self) -> None:
        """Prefill the waiting prompts, then one pass over every row; each row's commit waits
        in its inbox for its ``next``."""
        if self.waiting:
            self._prefill_waiting()
        rows = list(self.rows)
        if not rows:
            return
        try:
            self._pass(rows)
        except Exception as exc:  # every row's next step reports it; the batch is not reused
            for row in rows:
                row.error = exc
            raise

    def _pass(self, rows: list[_Row]) -> None:
        assert self.cache is not None
        choices = self._choices(rows)
        widths = [c.size for c in choices]
        width = max(widths)
        with mx.stream(generation_stream):
            inputs, proposals = [], self._propose(rows, choices)
            for row, w, proposal in zip(rows, widths, proposals):
                tokens = row.last if w == 1 else mx.concatenate([row.last, proposal[0]])
                if w < width:  # right padding: computed, never kept
                    tokens = mx.concatenate([tokens, mx.zeros((width - w,), mx.int32)])
                inputs.append(tokens)
            self.cache.layout.reserve(width)
            recording = self.target.hooks.recording() if width > 1 else contextlib.nullcontext()
            with recording as record:
                logits, taps = self.target.forward(mx.stack(inputs), self.cache.layers, slice(None))
            cycles = [
                self._score(row, c, logits[i : i + 1, : c.size],
                            None if taps is None else taps[i : i + 1, : c.size], *proposals[i])
                for i, (row, c) in enumerate(zip(rows, choices))
            ]  # fmt: skip
            mx.async_eval(*[a for c in cycles for a in c.arrays()])
        keep = []
        for row, cycle in zip(rows, cycles):
            row.inbox, row.last = row.decoder._read(cycle)
            row.decoder._pending = None  # rolled back below, for all rows at once
            keep.append(len(row.inbox.tokens))
            stats = row.decoder.stats
            stats.batch_histogram[len(rows)] = stats.batch_histogram.get(len(rows), 0) + 1
        with mx.stream(generation_stream):
            self.cache.layout.commit(keep, width)
            if width > 1:
                rollback_rows(self.target.hooks, self.cache, record, keep, width)
            lay = self.cache.layout
            if lay.idx > 2 * lay.step and lay.hole_share() > 0.5:
                self.cache.compact()
        self.passes += 1
        self.last_pass = (len(rows), len(rows) * width)
        self.histogram[len(rows)] = self.histogram.get(len(rows), 0) + 1

    @staticmethod
    def _propose(rows: list[_Row], choices: list[Choice]) -> list[tuple[Any, Any, Any]]:
        """(drafts, log q, penalty history) per row, the drafting rows in one drafter pass
        where they can (``batch_draft.py``); a copy's drafts come from the host, a plain row
        has none."""
        out: list[tuple[Any, Any, Any]] = []
        drafting: list[DraftRow] = []
        for row, choice in zip(rows, choices):
            d = row.decoder
            history = d._history_tail() if d.sampler.processors else None
            drafts = mx.array(choice.tokens, dtype=mx.int32) if choice.source == SUFFIX else None
            out.append((drafts, None, history))
            if choice.source == DRAFTER:
                assert d.draft is not None and d.draft_cache is not None  # width > 1: drafting
                mask = mx.full((choice.size - 1,), d.draft.config.mask_token_id, dtype=mx.int32)
                block = mx.concatenate([row.last, mask])[None]
                context = d._take_context()
                drafting.append(
                    DraftRow(d.draft, block, context, d.draft_cache, d.sampler, history)
                )
        proposals = iter(propose_rows(drafting))
        for i, choice in enumerate(choices):
            if choice.source == DRAFTER:
                drafts, log_q = next(proposals)
                out[i] = (drafts.astype(mx.int32), log_q, out[i][2])
        return out

    @staticmethod
    def _score(
        row: _Row, choice: Choice, logits: mx.array, taps: mx.array | None,
        drafts: Any, log_q: Any, history: Any,
    ) -> Cycle:  # fmt: skip
        """One row's cycle from its verify logits ([1, width, V]), as ``_queue_cycle``."""
        d, width = row.decoder, choice.size
        if width == 1:
            if d.draft is not None and taps is not None:
                d._context.append(taps)  # a plain row's taps still feed its drafter
                context = d._take_context() if len(d._context) >= FLUSH else None
                if context is not None and d.draft_cache is not None:
                    d.draft.append_context(context, d.draft_cache)
            processed = d._finish_rows(logits[0], history, None)
            bonus = d.sampler.sample(processed)
            result = mx.concatenate([mx.zeros((1,), mx.int32), bonus.astype(mx.int32)])
            return Cycle(result, None, 1, d._logprobs(processed, bonus), PLAIN)
        copied = choice.source == SUFFIX
        path = drafts
        if d.constraint is not None:  # a constraint walks the verified path on the host
            path = list(choice.tokens) if copied else drafts.tolist()
        processed = d._finish_rows(logits[0], history, path)
        if copied and not d.sampler.deterministic:  # a copy is a point mass: q = 1 on it
            log_q = point_mass(drafts, processed.shape[-1])
        accepted, bonus = d.sampler.accept(processed, drafts, log_q)
        result = mx.concatenate([mx.stack([accepted, bonus]).astype(mx.int32), drafts])
        logprobs = None
        if d.logprobs is not None:
            emitted = mx.concatenate([drafts, bonus[None].astype(mx.int32)])
            emitted = mx.where(mx.arange(width) == accepted, bonus, emitted)
            logprobs = d._logprobs(processed, emitted)
        return Cycle(result, taps, width, logprobs, choice.source, choice.confidence)


def drive(
    batch: BatchDecoder, streams: Mapping[K, Iterator[Any]], start: Mapping[K, int] | None = None
) -> Iterator[tuple[K, Any]]:
    """Run streams (``batch.join`` generators, or what wraps them) as the engine does: each
    round one step of every started stream, then one batch step (the waiting prompts'
    prefill and a pass); ``start[key]`` delays a stream to that round. Yields (key, item) in
    order."""
    start = start or {}
    waiting, active = dict(streams), dict[K, Iterator[Any]]()
    rounds = 0
    while waiting or active:
        for key in [k for k in waiting if start.get(k, 0) <= rounds]:
            active[key] = waiting.pop(key)
        for key, stream in list(active.items()):
            try:
                item = next(stream)
            except StopIteration:
                del active[key]
                continue
            yield key, item
        batch.step()
        rounds += 1
