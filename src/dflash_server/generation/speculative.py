"""The DFlash draft/verify loop, token ids in, committed token ids out.

One cycle: the drafter proposes ``B-1`` tokens in one pass from ``[last, mask, ...]``; the target
scores ``[last, d1..d(B-1)]`` in one pass; the longest agreeing prefix plus one target token (the
bonus) is committed. Caches are rolled back to "prompt + committed", and the taps of the committed
positions become the drafter's new context. All MLX work runs on mlx-lm's generation stream with one
host sync per cycle; the next cycle is queued before the caller sees this cycle's tokens.

With a ``SuffixProposer``, a cycle may instead verify tokens copied from the context (no drafter
pass, up to the proposer's length); the policy picks drafter, suffix or a plain step per cycle.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import generation_stream

from dflash_server.generation.controller import (
    DRAFTER,
    PLAIN,
    SUFFIX,
    BlockController,
    Choice,
    FixedBlock,
)
from dflash_server.generation.cycle import FLUSH, PREFILL_CHUNK, Commit, Cycle, terminate
from dflash_server.generation.prefix import Checkpoint, PromptSnapshot, supported
from dflash_server.generation.protocols import Drafter, PrefixStore, TokenConstraint
from dflash_server.generation.sampling import (
    TokenSampler,
    apply_mask,
    point_mass,
    token_logprobs,
)
from dflash_server.generation.stats import SpeculativeStats
from dflash_server.generation.suffix import SuffixProposer
from dflash_server.generation.target import TargetModel

__all__ = ["PREFILL_CHUNK", "Commit", "SpeculativeDecoder", "SpeculativeStats"]
_UNSEEN = object()  # the prefix cache was not asked yet


class SpeculativeDecoder:
    """Runs one request's prefill and cycles; ``draft=None`` means plain decoding (B = 1).

    ``policy`` picks each cycle's width: ``FixedBlock(B)``, or the "auto" ``BlockController``.
    ``logprobs`` (None, or the number of alternatives per token) adds log-probabilities to each
    commit; ``constraint`` restricts the target's distribution at every position (grammars).
    ``suffix`` proposes copies from the context (it needs the "auto" controller, which may then
    run without a drafter); the decoder feeds it the committed tokens.
    """

    def __init__(
        self,
        target: TargetModel,
        draft: Drafter | None,
        sampler: TokenSampler,
        policy: FixedBlock | BlockController,
        *,
        prefill_step_size: int = 2048,
        profile: bool = False,
        logprobs: int | None = None,
        constraint: TokenConstraint | None = None,
        prefix: PrefixStore | None = None,
        checkpoints: tuple[int, ...] = (),
        suffix: SuffixProposer | None = None,
    ):
        self.target, self.draft, self.sampler = target, draft, sampler
        self.suffix = suffix if isinstance(policy, BlockController) else None
        self.policy = policy if draft is not None or self.suffix is not None else FixedBlock(1)
        self.prefill_step_size = prefill_step_size
        self.logprobs, self.constraint = logprobs, constraint
        self.cache = target.make_cache()
        self.rollback = target.make_rollback(self.cache)
        self.draft_cache: list[Any] | None = draft.make_cache() if draft is not None else None
        # Prefix caching needs caches a snapshot can hold (KV and Gated DeltaNet).
        self.prefix = prefix if prefix is not None and supported(self.cache) else None
        self.checkpoints = frozenset(checkpoints)
        self._prefix_kind = (target.tap_ids,) if draft is not None else ()
        self.stats = SpeculativeStats(
            self.policy.block_size,
            adaptive=self.policy.adaptive,
            timings={} if profile else None,
            estimator=self.policy.estimate,
        )
        self._history: list[int] = []  # token ids the penalties look back over
        self._context: list[mx.array] = []  # committed taps not yet given to the drafter
        self._pending: tuple[int, int] | None = None  # (keep, fed) of the last verify
        self._last_read: float | None = None  # when the previous cycle was read back
        self._hit: object = _UNSEEN  # the prefix cache's answer for this request's prompt

    # -- phases -------------------------------------------------------------------------------

    def _timed(self, phase: str, *arrays: Any) -> None:
        """In profiling mode, evaluate a phase on its own and charge its wall time."""
        timings = self.stats.timings
        if timings is None:
            return
        start = time.perf_counter()
        mx.eval(*arrays)
        timings[phase] = timings.get(phase, 0.0) + time.perf_counter() - start

    def _history_tail(self) -> mx.array:
        return mx.array(self._history[-self.sampler.params.penalty_context_size :])

    def _finish_rows(
        self, logits: mx.array, history: mx.array | None, drafts: list[int] | mx.array | None
    ) -> mx.array:
        """The target's processed logits per row: penalties, then the constraint's mask
        (with a constraint, ``drafts`` is the host list of the drafted path)."""
        if drafts is None:
            logits = self.sampler.process(logits, history)
        elif history is not None and self.sampler.processors:
            logits = self.sampler.process_rows(logits, history, mx.array(drafts))
        if self.constraint is not None:
            mask = self.constraint.allowed(cast("list[int]", drafts or []))
            if mask is not None:
                logits = apply_mask(logits, mask)
        return logits

    def _logprobs(self, logits: mx.array, emitted: mx.array) -> Any:
        return None if self.logprobs is None else token_logprobs(logits, emitted, self.logprobs)

    def prefill(self, prompt: list[int]) -> Cycle:
        """Feed the whole prompt (see ``prefill_steps``); return the first token's cycle."""
        steps = self.prefill_steps(prompt)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def prefill_steps(self, prompt: list[int]) -> Generator[Commit, None, Cycle]:
        """Feed the prompt in chunks (after what the prefix cache restores), yielding
        ``PREFILL_CHUNK`` after each chunk but the last so a scheduler can run other work in
        between; return the first token as a (lazy) one-row cycle. With a prefix cache,
        chunks also end at the checkpoints, where the recurrent state is kept for later
        requests."""
        self._history = list(prompt)
        start, checkpoints = self._restore(prompt)
        tokens = mx.array(prompt)[None]
        for begin, end in self._chunks(start, len(prompt)):
            last = end == len(prompt)
            rows = slice(-1, None) if last else None
            with mx.stream(generation_stream):
                logits, taps = self.target.forward(tokens[:, begin:end], self.cache, rows)
                if self.draft is not None:
                    self.draft.append_context(_tapped(taps), _ctx(self.draft_cache))
                if self.prefix is not None and end in self._chunk_checkpoints(len(prompt)):
                    checkpoints[end] = Checkpoint.take(self.cache, self.draft_cache)
                if not last:  # bound peak memory: materialise this chunk before the next
                    mx.eval([c.state for c in self.cache], *self._draft_state())
                    mx.clear_cache()
            if not last:
                yield PREFILL_CHUNK
        return self._first_token(prompt, _rows(logits)[0], checkpoints)

    def _first_token(
        self, prompt: list[int], logits: mx.array, checkpoints: dict[int, Checkpoint]
    ) -> Cycle:
        """After the prompt's prefill: keep its snapshot (with a prefix cache) and start the
        first token's (lazy) one-row cycle from the last position's logits ([1, V])."""
        with mx.stream(generation_stream):
            if self.prefix is not None:
                snapshot = PromptSnapshot.take(prompt, self.cache, self.draft_cache, checkpoints)
                mx.async_eval(snapshot.arrays())
                self.prefix.store(self._prefix_kind, snapshot)
            logits = self._finish_rows(logits, self._history_tail(), None)
            first = self.sampler.sample(logits)
            result = mx.concatenate([mx.zeros((1,), mx.int32), first.astype(mx.int32)])
        return Cycle(result, None, 1, self._logprobs(logits, first))

    def prefix_hit(self, prompt: list[int]) -> tuple[PromptSnapshot, int] | None:
        """The prefix cache's longest restorable prefix of ``prompt`` (looked up once: a
        request's decoder serves that one prompt), or None."""
        if self._hit is _UNSEEN:
            found = None if self.prefix is None else self.prefix.lookup(self._prefix_kind, prompt)
            self._hit = found
        return cast("tuple[PromptSnapshot, int] | None", self._hit)

    def _restore(self, prompt: list[int]) -> tuple[int, dict[int, Any]]:
        """Load the longest cached prefix (never the whole prompt: its last token gives the
        logits); return its length and the checkpoints the new snapshot inherits."""
        hit = self.prefix_hit(prompt)
        if hit is None:
            return 0, {}
        snapshot, start = hit
        snapshot.restore(start, self.cache, self.draft_cache)
        self.stats.cached_tokens = start
        return start, {p: s for p, s in snapshot.checkpoints.items() if p <= start}

    def _chunks(self, start: int, end: int) -> list[tuple[int, int]]:
        """Prefill chunks from ``start``: at most ``prefill_step_size`` long, cut at absolute
        multiples of it and (with a prefix cache) at the checkpoints, so a warm run computes
        exactly the chunks a cold run did after the restored prefix."""
        step = max(1, self.prefill_step_size)
        cuts = set(range(step, end, step)) | {end}
        if self.prefix is not None:
            cuts |= self._chunk_checkpoints(end)
        ends = sorted(c for c in cuts if c > start)
        return list(zip([start, *ends[:-1]], ends))

    def _chunk_checkpoints(self, prompt_len: int) -> set[int]:
        """Where to keep recurrent state: the requested checkpoints, and just before the last
        token (a repeated prompt then prefills one token)."""
        return {p for p in self.checkpoints if 0 < p < prompt_len} | {prompt_len - 1}

    def _draft_state(self) -> list[Any]:
        return [c.state for c in self.draft_cache] if self.draft_cache is not None else []

    def _apply_rollback(self) -> None:
        """Roll the target caches back after the last verify (deferred so that the next draft
        is already running while the host builds these ops: docs/design.md, "Speed")."""
        if self._pending is not None:
            keep, fed = self._pending
            self._pending = None
            self.rollback.rollback(keep=keep, fed=fed)
            self._timed("rollback", [c.state for c in self.cache])

    def _take_context(self) -> mx.array | None:
        pieces, self._context = self._context, []
        if not pieces:
            return None
        return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=1)

    def _plain_step(self, last: mx.array, history: mx.array | None) -> Cycle:
        self._apply_rollback()
        logits, taps = self.target.forward(last[None], self.cache, slice(None))
        if self.draft is not None and taps is not None:
            # The drafter needs every committed position; batch plain steps' taps.
            self._context.append(taps)
            if len(self._context) >= FLUSH:
                self.draft.append_context(_tapped(self._take_context()), _ctx(self.draft_cache))
        logits = self._finish_rows(_rows(logits)[0], history, None)
        bonus = self.sampler.sample(logits)
        result = mx.concatenate([mx.zeros((1,), mx.int32), bonus.astype(mx.int32)])
        self._timed("plain", result)
        return Cycle(result, None, 1, self._logprobs(logits, bonus), PLAIN)

    def _queue_cycle(self, last: mx.array, choice: Choice | int) -> Cycle:
        """Build (lazily) and start one cycle of ``choice.size`` positions (1: a plain step);
        a bare width means the drafter's block of that width."""
        if isinstance(choice, int):
            choice = Choice.width(choice)
        size = choice.size
        with mx.stream(generation_stream):
            history = self._history_tail() if self.sampler.processors else None
            if size == 1:
                cycle = self._plain_step(last, history)
                mx.async_eval(*cycle.arrays())
                return cycle
            copied = choice.source == SUFFIX
            path: list[int] | mx.array
            if copied:  # a suffix copy: known on the host, no drafter pass
                path = list(choice.tokens)
                drafts, log_q = mx.array(path, dtype=mx.int32), None
            else:
                drafts, log_q = self._drafts(last, size, history)
                # A constraint walks the drafted path on the host: one extra sync per cycle.
                path = cast("list[int]", drafts.tolist()) if self.constraint is not None else drafts
            self._apply_rollback()
            verify_input = mx.concatenate([last, drafts.astype(last.dtype)])
            with self.rollback.recording():
                logits, taps = self.target.forward(verify_input[None], self.cache, slice(None))
            logits = self._finish_rows(_rows(logits)[0], history, path)
            if copied and not self.sampler.deterministic:
                log_q = point_mass(drafts, logits.shape[-1])
            accepted, bonus = self.sampler.accept(logits, drafts, log_q)
            result = mx.concatenate(
                [mx.stack([accepted, bonus]).astype(mx.int32), drafts.astype(mx.int32)]
            )
            logprobs = None
            if self.logprobs is not None:
                # Row i emits draft i+1 while it survives; the row after the last one, the bonus.
                emitted = mx.concatenate([drafts, bonus[None]]).astype(mx.int32)
                emitted = mx.where(mx.arange(size) == accepted, bonus, emitted)
                logprobs = self._logprobs(logits, emitted)
            self._timed("verify", result, taps)
        cycle = Cycle(result, taps, size, logprobs, choice.source, choice.confidence)
        mx.async_eval(*cycle.arrays())
        return cycle

    def _drafts(
        self, last: mx.array, size: int, history: mx.array | None
    ) -> tuple[mx.array, mx.array | None]:
        """Start the drafter's pass over ``[last, mask, ...]``: (drafts, their log q)."""
        draft = cast(Drafter, self.draft)  # drafter cycles only come with a drafter
        mask = mx.full((size - 1,), draft.config.mask_token_id, dtype=last.dtype)
        block = mx.concatenate([last, mask])[None]
        drafts, log_q = draft.propose(
            block, self._take_context(), _ctx(self.draft_cache), self.sampler, history
        )
        if self.stats.timings is None:
            # Start drafting now; the rollback and verify graphs are built while it runs
            # (on Metal; on CPU async_eval returns once little work is left queued).
            mx.async_eval(drafts, *([] if log_q is None else [log_q]))
        self._timed("draft", drafts)
        return drafts, log_q

    # -- the loop -----------------------------------------------------------------------------

    def _read(self, cycle: Cycle, first: bool = False) -> tuple[Commit, mx.array]:
        """Sync on a cycle and commit its tokens; queue the caches' rollback for the next
        cycle and feed the policy; return (commit, next anchor)."""
        values = cast("list[int]", cycle.result.tolist())  # the one host sync per cycle
        now = time.perf_counter()
        seconds = None if self._last_read is None else now - self._last_read
        self._last_read = now
        accepted, bonus = values[0], values[1]
        source = SUFFIX if cycle.source == SUFFIX else DRAFTER
        commit = Commit([*values[2 : 2 + accepted], bonus], drafted=accepted, source=source)
        if cycle.logprobs is not None:
            chosen, ids, top = (
                None if a is None else cast(list, a.tolist()) for a in cycle.logprobs
            )
            n = accepted + 1
            commit.logprobs = (chosen or [])[:n]
            if ids is not None and top is not None:
                commit.top_logprobs = [
                    sorted(zip(i, v), key=lambda iv: -iv[1]) for i, v in zip(ids[:n], top[:n])
                ]
        if not first:  # the prefill's token is no cycle
            self.stats.record(cycle.size, accepted, cycle.source)
            if cycle.source == SUFFIX:
                policy = cast(BlockController, self.policy)
                policy.observe(cycle.size, accepted, seconds, SUFFIX, cycle.confidence)
            else:
                self.policy.observe(cycle.size, accepted, seconds)
        if cycle.size > 1:
            self._pending = (accepted + 1, cycle.size)
            if self.draft is not None and cycle.taps is not None:
                # The committed positions' taps are the drafter's next context.
                self._context.append(cycle.taps[:, : accepted + 1])
        return commit, mx.array([bonus], dtype=mx.int32)

    def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        eos_ids: set[int] | frozenset[int] = frozenset(),
        yield_chunks: bool = False,
    ) -> Iterator[Commit]:
        """Yield commits of tokens (the first holds the prefill's token); the only place where
        generation ends on tokens: at an EOS id or after ``max_tokens`` (see ``Commit.finish``).
        ``yield_chunks``: also yield ``PREFILL_CHUNK`` after each prompt chunk but the last, so
        a scheduler can advance other requests while a long prompt prefills.
        """
        if max_tokens <= 0:
            return
        try:
            yield from self._generate(prompt, max_tokens, eos_ids, yield_chunks)
        finally:  # also when the consumer stops early: the output so far joins the shared index
            if self.suffix is not None:
                self.suffix.finish()

    def _generate(
        self,
        prompt: list[int],
        max_tokens: int,
        eos_ids: set[int] | frozenset[int],
        yield_chunks: bool,
    ) -> Iterator[Commit]:
        if yield_chunks:
            first = yield from self.prefill_steps(prompt)
        else:
            first = self.prefill(prompt)
        commit, last = self._read(first, first=True)
        produced = 0
        # Without penalties or constraints (which read the committed tokens on the host), the
        # plain step after a plain step can be queued before that step is read back. A
        # speculative cycle waits for the read: it needs the step's taps, and on CPU queueing
        # it early would run it inside the step's timing, misleading the "auto" cost model.
        lookahead = not self.sampler.processors and self.constraint is None
        queued: Cycle | None = None
        planned: Choice | None = None  # the choice made during a lookahead, not yet queued
        while True:
            commit = terminate(commit, max_tokens - produced, eos_ids)
            produced += len(commit.tokens)
            self._committed(commit.tokens)
            if commit.finish is not None:
                yield commit
                return
            room = max_tokens - produced
            cycle = queued or self._queue_cycle(last, planned or self._choose(room))
            yield commit
            queued = planned = None
            # A lookahead decides before the step's token is known: not while a copy may be
            # verified (one starting at that token would be missed).
            if lookahead and cycle.size == 1 and room > 1 and not self._copying():
                planned = Choice.width(self.policy.next_size(room - 1))
                if planned.size == 1:
                    queued, planned = self._queue_cycle(cycle.result[1:2], planned), None
            commit, last = self._read(cycle)

    def _committed(self, tokens: list[int]) -> None:
        """What committed tokens feed besides the caller: penalties, the suffix index and the
        constraint."""
        self._history.extend(tokens)
        if self.suffix is not None:
            self.suffix.extend(tokens)
        if self.constraint is not None:
            self.constraint.commit(tokens)

    def _choose(self, room: int) -> Choice:
        if self.suffix is None:
            return Choice.width(self.policy.next_size(room))
        proposal = self.suffix.propose(room - 1)
        return cast(BlockController, self.policy).choose(room, proposal)

    def _copying(self) -> bool:
        """Whether the next cycle may verify a copy (cheap: no proposal is built here)."""
        if self.suffix is None or not self.suffix.matches():
            return False
        return cast(BlockController, self.policy).might_copy()


# Narrowing for the type checker only: which values exist follows from whether a drafter runs.
def _tapped(taps: mx.array | None) -> mx.array:
    assert taps is not None, "a target driven with a drafter returns taps"
    return taps


def _ctx(cache: list[Any] | None) -> list[Any]:
    assert cache is not None, "a drafter has a context cache"
    return cache


def _rows(logits: mx.array | None) -> mx.array:
    assert logits is not None, "logit rows were asked for"
    return logits
