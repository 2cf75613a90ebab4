"""One request's decoding state, and every step a driver runs on it.

A ``Row`` holds what belongs to one request: its sampler and penalty history, its constraint,
width policy and suffix proposer, the drafter's context, its statistics, and its own target
cache until a batch takes it over. Its public surface follows a cycle's life:

* ``begin``, then ``prefill.py`` feeds the prompt, after what the prefix cache restores, in
  chunks (``restore_prefix``, ``first_token``, ``keep_prefilled`` are its hooks);
* ``choose``: the next cycle's width and source (a drafter block, a suffix copy, a plain step);
* ``draft_row``: what the drafter pass drafts from (the anchor, masks, new context);
* ``score``: the verify's logits -> accepted drafts, bonus token and logprobs (lazy, on device);
* ``read``: the one host sync per cycle: the committed tokens (cut at EOS or ``max_tokens``),
  fed to the policy, stats, penalties, suffix index and constraint; the committed positions'
  taps become drafter context;
* ``finish``: the output joins the shared suffix index.

Two drivers run rows and own the target forward and the rollback: ``SpeculativeDecoder``
(one row on its own cache) and ``BatchDecoder`` (every running row in one pass). Whatever a
row decides, or computes from its own verify rows, lives here, once
(docs/design.md, "The DFlash loop").
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import generation_stream

from dflash_server.adaptive.policy import DRAFTER, PLAIN, SUFFIX, Choice, FixedBlock, WidthPolicy
from dflash_server.drafters.protocol import Drafter, DraftRow
from dflash_server.drafters.suffix import SuffixProposer
from dflash_server.generation.cycle import FLUSH, Commit, Cycle, terminate
from dflash_server.generation.images import PromptImages
from dflash_server.generation.kv_quant import KVQuant
from dflash_server.generation.prefix import Checkpoint, PromptSnapshot, supported
from dflash_server.generation.protocols import PrefixStore, TokenConstraint
from dflash_server.generation.sampling import TokenSampler, apply_mask, point_mass, token_logprobs
from dflash_server.generation.stats import SpeculativeStats
from dflash_server.generation.target import TargetModel

_UNSEEN = object()  # the prefix cache was not asked yet


class Row:
    """One request's decoding state; ``draft=None`` means plain decoding (B = 1).

    ``policy`` picks each cycle (``FixedBlock(B)``, or the "auto" ``BlockController``).
    ``logprobs`` (None, or the number of alternatives per token) adds log-probabilities to each
    commit; ``constraint`` restricts the target's distribution at every position (grammars).
    ``suffix`` proposes copies from the context (it needs an adaptive policy, which may then run
    without a drafter). ``prefix`` is the prefix cache, ``checkpoints`` the prompt positions
    where it keeps the recurrent state; ``profile`` times each phase (``stats.timings``);
    ``images``: the prompt's images (their features, positions and prefix-cache key);
    ``kv``: quantized attention KV (``kv_quant.py``), None for full precision.
    """

    def __init__(
        self,
        target: TargetModel,
        draft: Drafter | None,
        sampler: TokenSampler,
        policy: WidthPolicy,
        *,
        prefill_step_size: int = 2048,
        profile: bool = False,
        logprobs: int | None = None,
        constraint: TokenConstraint | None = None,
        prefix: PrefixStore | None = None,
        checkpoints: tuple[int, ...] = (),
        suffix: SuffixProposer | None = None,
        images: PromptImages | None = None,
        kv: KVQuant | None = None,
    ):
        self.target, self.draft, self.sampler = target, draft, sampler
        self.suffix = suffix if policy.adaptive else None
        self.policy = policy if draft is not None or self.suffix is not None else FixedBlock(1)
        self.prefill_step_size = prefill_step_size
        self.logprobs, self.constraint = logprobs, constraint
        self.cache: list[Any] = target.make_cache()  # a batch takes it over when the row joins
        self.draft_cache: list[Any] | None = draft.make_cache() if draft is not None else None
        # Prefix caching needs caches a snapshot can hold (KV and Gated DeltaNet).
        self.prefix = prefix if prefix is not None and supported(self.cache) else None
        self.checkpoints = frozenset(checkpoints)
        self.kv = kv
        self._prefix_kind = ((target.tap_ids,) if draft is not None else ()) + (
            (kv.key(),) if kv is not None else ()
        )
        self.stats = SpeculativeStats(
            self.policy.block_size,
            adaptive=self.policy.adaptive,
            timings={} if profile else None,
            estimator=self.policy.estimate,
        )
        self.prompt: list[int] = []
        self.key: tuple[int, ...] = ()  # the prompt as the prefix cache keys it (set by begin)
        self.max_tokens, self.produced = 0, 0
        self.eos_ids: frozenset[int] = frozenset()
        self.last = mx.array([0], dtype=mx.int32)  # the next cycle's anchor: the last token
        self.kept = 0  # positions of the last verify that the caches keep (accepted + 1)
        self.done = False
        self._history: list[int] = []  # token ids the penalties look back over
        # Committed positions not yet given to the drafter: (taps [1, T, L*H], tokens fed [T]).
        self._context: list[tuple[mx.array, mx.array]] = []
        self._last_read: float | None = None  # when the previous cycle was read back
        self._hit: object = _UNSEEN  # the prefix cache's answer for this request's prompt
        self.images = images  # until the prompt is prefilled
        # Every position after the prompt is the token count plus this (images: <= 0).
        self.shift = images.shift if images is not None else 0

    def begin(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        eos_ids: set[int] | frozenset[int] = frozenset(),
    ) -> None:
        """Set the request: its prompt and where it ends (an EOS id, ``max_tokens`` tokens)."""
        self.prompt, self._history = list(prompt), list(prompt)
        self.key = self.images.key if self.images is not None else tuple(self.prompt)
        self.max_tokens, self.eos_ids = max_tokens, frozenset(eos_ids)

    @property
    def room(self) -> int:
        """Tokens it may still produce."""
        return self.max_tokens - self.produced

    @property
    def position(self) -> int:
        """Tokens so far (prompt and output): what the next cycle attends to."""
        return len(self._history)

    @property
    def pinned(self) -> bool:
        """Whether its widths are part of its answer (a seeded sampled row: its random draws
        follow the widths), so a batch must not narrow them."""
        return self.sampler.reproducible

    # -- the prompt ---------------------------------------------------------------------------

    def prefix_hit(self) -> tuple[PromptSnapshot, int] | None:
        """The prefix cache's longest restorable prefix of the prompt, or None (asked once: a
        row serves one prompt)."""
        if self._hit is _UNSEEN:
            found = None
            if self.prefix is not None:
                found = self.prefix.lookup(self._prefix_kind, self.key)
            self._hit = found
        return cast("tuple[PromptSnapshot, int] | None", self._hit)

    def first_token(self, logits: mx.array, checkpoints: dict[int, Checkpoint]) -> Cycle:
        """After the prompt's prefill: keep its snapshot (with a prefix cache) and start the
        first token's (lazy) one-row cycle from the last position's logits ([1, V])."""
        with mx.stream(generation_stream):
            if self.prefix is not None:
                snapshot = PromptSnapshot.take(self.key, self.cache, self.draft_cache, checkpoints)
                mx.async_eval(snapshot.arrays())
                self.prefix.store(self._prefix_kind, snapshot)
            logits = self._process(logits, self.history(), None)
            first = self.sampler.sample(logits)
            result = mx.concatenate([mx.zeros((1,), mx.int32), first.astype(mx.int32)])
        logprobs = self._logprobs(logits, first)
        return Cycle(result, None, 1, logprobs, prefill=True, upkeep=self.draft_state())

    def keep_prefilled(self, done: int, checkpoints: dict[int, Checkpoint]) -> None:
        """Store the first ``done`` prompt tokens' state (the caches hold exactly that between
        chunks) as a prefix-cache entry, restorable at ``done``."""
        if self.prefix is None or done <= self.stats.cached_tokens:
            return  # no cache, or nothing prefilled beyond what it restored
        with mx.stream(generation_stream):
            kept = {**checkpoints, done: Checkpoint.take(self.cache, self.draft_cache)}
            snapshot = PromptSnapshot.take(self.key[:done], self.cache, self.draft_cache, kept)
            mx.async_eval(snapshot.arrays())
        self.prefix.store(self._prefix_kind, snapshot)

    def checkpoint_positions(self) -> set[int]:
        """Where the prefill keeps recurrent state (with a prefix cache): the requested
        checkpoints, and just before the last token (a repeated prompt then prefills one)."""
        if self.prefix is None:
            return set()
        n = len(self.prompt)
        return {p for p in self.checkpoints | {n - 1} if 0 < p < n}

    def quantize_kv(self) -> None:
        """After a forward (and its rollback): mlx-lm's rule, attention layers holding
        ``kv.start`` tokens or more become quantized (in place in ``cache``)."""
        if self.kv is not None:
            self.kv.quantize(self.cache)

    def draft_state(self) -> list[Any]:
        """The drafter context's arrays (to evaluate with the target's)."""
        return [c.state for c in self.draft_cache] if self.draft_cache is not None else []

    def restore_prefix(self) -> tuple[int, dict[int, Checkpoint]]:
        """Load the longest cached prefix (never the whole prompt: its last token gives the
        logits); return its length and the checkpoints the new snapshot inherits."""
        hit = self.prefix_hit()
        if hit is None:
            return 0, {}
        snapshot, start = hit
        snapshot.restore(start, self.cache, self.draft_cache)
        self.stats.cached_tokens = start
        return start, {p: s for p, s in snapshot.checkpoints.items() if p <= start}

    # -- a cycle ------------------------------------------------------------------------------

    def choose(self, room: int | None = None) -> Choice:
        """The next cycle (the policy's pick, a suffix copy on offer), at most ``room``
        positions (default: the tokens still wanted)."""
        room = self.room if room is None else room
        proposal = self.suffix.propose(room - 1) if self.suffix is not None else None
        return self.policy.choose(room, proposal, self.position)

    def copying(self) -> bool:
        """Whether the next cycle may verify a copy: a copy the policy would take runs on from
        the committed tokens' end (a proposal is built only where they match something)."""
        if self.suffix is None or not self.suffix.matches():
            return False
        return self.policy.might_copy(self.room, self.suffix.propose(self.room - 1))

    def history(self) -> mx.array | None:
        """The token window the penalties look back over (None without penalties)."""
        if not self.sampler.processors:
            return None
        return mx.array(self._history[-self.sampler.params.penalty_context_size :])

    def draft_row(self, size: int, anchor: mx.array, history: mx.array | None) -> DraftRow:
        """What the drafter drafts ``size - 1`` tokens from: ``[anchor, mask, ...]``, after the
        committed positions it has not seen yet join its context."""
        draft = cast(Drafter, self.draft)  # drafter cycles only come with a drafter
        self._flush_context()
        mask = mx.full((size - 1,), draft.config.mask_token_id, dtype=anchor.dtype)
        block = mx.concatenate([anchor, mask])[None]
        return DraftRow(block, _ctx(self.draft_cache), self.sampler, history)

    def score(
        self,
        choice: Choice,
        logits: mx.array,
        taps: mx.array | None,
        inputs: mx.array,
        log_q: mx.array | None,
        history: mx.array | None,
    ) -> Cycle:
        """A cycle from its verify: the logits of its ``choice.size`` positions ([size, V]),
        their taps ([1, size, L*H]) and the tokens fed there (``inputs``: the anchor, then the
        drafts) -> the accepted drafts, the bonus token and the logprobs, on device."""
        size = choice.size
        inputs = inputs.astype(mx.int32)
        if size == 1:
            upkeep = []
            if self.draft is not None and taps is not None:
                # The drafter needs every committed position; batch plain steps' taps.
                self._context.append((taps, inputs))
                if len(self._context) >= FLUSH:
                    self._flush_context()
                    upkeep = self.draft_state()
            processed = self._process(logits, history, None)
            bonus = self.sampler.sample(processed)
            result = mx.concatenate([mx.zeros((1,), mx.int32), bonus.astype(mx.int32)])
            logprobs = self._logprobs(processed, bonus)
            return Cycle(result, None, 1, logprobs, PLAIN, upkeep=upkeep)
        drafts = inputs[1:]
        copied = choice.source == SUFFIX
        path: list[int] | mx.array = drafts
        if self.constraint is not None:  # a constraint walks the drafted path on the host
            path = list(choice.tokens) if copied else cast("list[int]", drafts.tolist())
        processed = self._process(logits, history, path)
        if copied and not self.sampler.deterministic:  # a copy is a point mass: q = 1 on it
            log_q = point_mass(drafts, processed.shape[-1])
        accepted, bonus = self.sampler.accept(processed, drafts, log_q)
        result = mx.concatenate([mx.stack([accepted, bonus]).astype(mx.int32), drafts])
        logprobs = None
        if self.logprobs is not None:
            # Row i emits draft i+1 while it survives; the row after the last one, the bonus.
            emitted = mx.concatenate([drafts, bonus[None].astype(mx.int32)])
            emitted = mx.where(mx.arange(size) == accepted, bonus, emitted)
            logprobs = self._logprobs(processed, emitted)
        return Cycle(result, taps, size, logprobs, choice.source, choice.confidence, inputs=inputs)

    def read(self, cycle: Cycle, seconds: float | None = None, timed: bool = True) -> Commit:
        """Sync on a cycle (the one host sync per cycle) and commit its tokens: cut at an EOS
        id or ``max_tokens`` (``Commit.finish``), fed to the penalties, the suffix index and
        the constraint. The policy and stats learn from the cycle (``seconds``: what it cost
        this row, a batch's share; else the time since the last read, unless not ``timed``),
        the committed positions' taps become drafter context; ``last`` is the next anchor,
        ``kept`` the verified positions the caches keep (the driver's rollback)."""
        if cycle.prefill and cycle.upkeep:  # the prompt's drafter context: prefill work
            mx.async_eval(*cycle.upkeep)
        values = cast("list[int]", cycle.result.tolist())
        now = time.perf_counter()
        if seconds is None and self._last_read is not None and timed:
            seconds = now - self._last_read
        self._last_read = now
        accepted, bonus = values[0], values[1]
        source = SUFFIX if cycle.source == SUFFIX else DRAFTER
        commit = Commit([*values[2 : 2 + accepted], bonus], drafted=accepted, source=source)
        if cycle.logprobs is not None:
            commit.read_logprobs(cycle.logprobs)
        if not cycle.prefill:  # the prefill's token is no cycle
            self.stats.record(cycle.size, accepted, cycle.source)
            self.policy.observe(cycle.size, accepted, seconds, cycle.source, cycle.confidence)
        self.kept = accepted + 1
        if cycle.size > 1 and self.draft is not None and cycle.taps is not None:
            fed = cycle.inputs if cycle.inputs is not None else self.last  # (always set here)
            self._context.append((cycle.taps[:, : accepted + 1], fed[: accepted + 1]))
        self.last = mx.array([bonus], dtype=mx.int32)
        commit = terminate(commit, self.room, self.eos_ids)
        self.produced += len(commit.tokens)
        self._history.extend(commit.tokens)
        if self.suffix is not None:
            self.suffix.extend(commit.tokens)
        if self.constraint is not None:
            self.constraint.commit(commit.tokens)
        return commit

    def finish(self) -> None:
        """The row ended (finished or cancelled): its output so far joins the shared index."""
        if not self.done:
            self.done = True
            if self.suffix is not None:
                self.suffix.finish()

    # -- helpers ------------------------------------------------------------------------------

    def _process(
        self, logits: mx.array, history: mx.array | None, path: list[int] | mx.array | None
    ) -> mx.array:
        """The target's processed logits per position: penalties (each position sees the
        drafted ``path`` before it), then the constraint's mask along that path."""
        if path is None:
            logits = self.sampler.process(logits, history)
        elif history is not None and self.sampler.processors:
            logits = self.sampler.process_rows(logits, history, mx.array(path))
        if self.constraint is not None:
            mask = self.constraint.allowed(cast("list[int]", path or []))
            if mask is not None:
                logits = apply_mask(logits, mask)
        return logits

    def _logprobs(self, logits: mx.array, emitted: mx.array) -> Any:
        return None if self.logprobs is None else token_logprobs(logits, emitted, self.logprobs)

    def _flush_context(self) -> None:
        """Give the drafter the committed positions it has not seen (taps and tokens)."""
        pieces, self._context = self._context, []
        if not pieces or self.draft is None:
            return
        taps = mx.concatenate([t for t, _ in pieces], axis=1) if len(pieces) > 1 else pieces[0][0]
        fed = mx.concatenate([f for _, f in pieces]) if len(pieces) > 1 else pieces[0][1]
        self.draft.append_context(taps, _ctx(self.draft_cache), fed)


# Narrowing for the type checker only: which values exist follows from whether a drafter runs.
def _ctx(cache: list[Any] | None) -> list[Any]:
    assert cache is not None, "a drafter has a context cache"
    return cache
