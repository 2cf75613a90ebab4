"""Continuous batching under speculation: all running requests advance in one target pass.

Each request is a ``Row`` (sampler, penalties, constraint, width policy, drafter context, stats);
only the target cache is shared, as rows of a ``BatchCache``. A pass:

1. every row chooses its cycle (a drafter block, a suffix copy, or width 1 = a plain decoding
   row), narrowed by the verify budget; the drafting rows draft, each drafter's rows in one
   call (``Drafter.propose``); copies need no drafter pass;
2. one target forward verifies all rows, each right-padded to the widest;
3. each row scores its own verify positions (``Row.score``: acceptance, bonus, logprobs, exactly
   as alone) and commits (``Row.read``);
4. per row rollback: attention columns past the row's kept prefix become unattendable, each
   Gated DeltaNet row takes the state after its own kept prefix, and the drafter context gets
   only the row's committed positions' taps.

``step`` runs one round of the batch and returns what each row committed, as mlx-lm's
``BatchGenerator.next`` does; its owner (the engine) calls it and routes the commits. Before
the pass, prompts make progress: prompts of one chunk or less that the prefix cache does not hold
are prefilled together in one forward (``prefill.py``); a longer prompt, a prefix hit or
a prompt with images prefills alone one chunk per step, so the running rows keep decoding. A
prefilled row joins the next pass; it leaves when it finishes or is removed (cancelled). Each
row rotates at its own positions (a prompt with images shifts its later ones: its ``shift``,
applied to its row only). Outputs are those of the request
run alone: greedy token for token (on fp32, where kernels do not change with row count;
docs/design.md, "Batching under speculation"), sampled rows with the same law.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Generator
from typing import cast

import mlx.core as mx
from mlx_lm.generate import generation_stream

from dflash_server.adaptive.pass_costs import PassCosts, choose_widths, predicted_gain
from dflash_server.adaptive.policy import DRAFTER, SUFFIX, Choice
from dflash_server.drafters.protocol import Drafter, DraftRow
from dflash_server.generation.batch_cache import BatchCache, batchable, rollback_rows
from dflash_server.generation.batch_probes import Probes
from dflash_server.generation.cycle import PREFILL_CHUNK, Commit, Cycle
from dflash_server.generation.kv_quant import KVQuant
from dflash_server.generation.prefill import prefill, prefill_steps, prefill_together
from dflash_server.generation.row import Row
from dflash_server.generation.speculative import LoneRows
from dflash_server.generation.target import TargetModel
from dflash_server.models.mrope import Positions

Outcome = Commit | Exception  # what a step hands a row: its commit, or the error that ended it
_TIME_PLAIN = 8  # a plain pass of several rows times them every this many passes


class BatchDecoder:
    """The running rows of one target model and their shared cache.

    ``costs`` (measured pass costs, ``adaptive/pass_costs.py``) caps the adaptive rows' widths where
    the batch commits the most tokens per second; ``max_verify`` caps the positions one pass
    verifies (rows x width): the widest rows are narrowed to fit (None: no cap). Rows it cannot
    hold (another model or taps, caches it cannot batch) run alone beside it (``LoneRows``).
    """

    def __init__(
        self,
        target: TargetModel,
        max_verify: int | None = None,
        costs: PassCosts | None = None,
        kv: KVQuant | None = None,
    ) -> None:
        self.target, self.max_verify, self.costs = target, max_verify, costs
        self.kv = kv  # the attention KV quantization of every row it runs
        self.rows: list[Row] = []  # running, in the order of the cache's rows
        self.cache: BatchCache | None = None
        self.prefilling: dict[Row, Generator[Commit, None, Cycle]] = {}  # alone, chunk by chunk
        self.waiting: list[Row] = []  # short cold prompts for the next shared prefill
        self.alone = LoneRows()
        self._joining: list[Row] = []  # prefilled this step: they join after its pass
        self.passes = 0
        self.last_pass: tuple[int, int] = (0, 0)  # (rows, verified positions) of the last pass
        self.probes = Probes()  # when the budget lets a narrowed pass through
        self.histogram: dict[int, int] = {}  # rows in a pass -> passes
        self.prefilled_together = 0  # prompts prefilled in a shared forward

    def supports(self, row: Row) -> bool:
        """Whether a request can run as a row (same model, taps and KV quantization, KV / GDN
        caches)."""
        same_taps = row.draft is None or row.target.tap_ids == self.target.tap_ids
        same = row.target.model is self.target.model and same_taps and row.kv == self.kv
        return same and batchable(row.cache)

    @property
    def busy(self) -> bool:
        """Whether a ``step`` has anything to do."""
        return bool(self.rows or self.prefilling or self.waiting or self.alone.runs)

    # -- rows ---------------------------------------------------------------------------------

    def add(
        self,
        row: Row,
        prompt: list[int],
        max_tokens: int,
        eos_ids: set[int] | frozenset[int] = frozenset(),
    ) -> None:
        """Take a request: its prompt starts prefilling at the next ``step``, which hands out
        its commits from then on (the first holds the prefill's token)."""
        if max_tokens <= 0 or not self.supports(row):
            self.alone.add(row, prompt, max_tokens, eos_ids)
            return
        row.begin(prompt, max_tokens, eos_ids)
        short = len(row.prompt) <= row.prefill_step_size and row.images is None
        # A quantized row prefills alone: mlx-lm's chunks, so its KV switches where it would.
        if short and row.prefix_hit() is None and row.kv is None:
            self.waiting.append(row)  # one chunk, cold, text: prefilled with other short ones
        else:
            self.prefilling[row] = prefill_steps(row)

    def remove(self, row: Row) -> None:
        """A row stops (cancelled, or ended on text): it leaves before the next pass."""
        self.alone.remove(row)
        steps = self.prefilling.pop(row, None)
        if steps is not None:
            steps.close()
        if row in self.waiting:
            self.waiting.remove(row)
        self._end(row)

    def _enter(self, row: Row) -> None:
        with mx.stream(generation_stream):
            if self.cache is None:
                self.cache = BatchCache([type(c) for c in row.cache], self.kv)
            self.cache.add_row(row.cache)
        row.cache = []  # the batch holds it now
        self.rows.append(row)

    def _end(self, row: Row) -> None:
        """The row is done: it leaves the batch, and its output joins the shared index."""
        if row in self.rows:
            index = self.rows.index(row)
            self.rows.pop(index)
            assert self.cache is not None
            with mx.stream(generation_stream):
                self.cache.remove_row(index)
        row.finish()

    # -- one step -----------------------------------------------------------------------------

    def plan(self) -> dict[Row, Choice]:
        """The running rows' next cycles, as ``step`` would choose them: what ranks that share
        a sharded target are sent by the one that decides (engine/lockstep.py)."""
        return dict(zip(self.rows, self._choices(self.rows))) if self.rows else {}

    def step(self, plan: dict[Row, Choice] | None = None) -> dict[Row, Outcome]:
        """One round: every prefilling row advances a chunk (``PREFILL_CHUNK``) or gives its
        first token, the waiting short prompts are prefilled together, then one pass over the
        rows that were running (each row's cycle from ``plan`` when given). Returns each row's
        commit, or the error that ended it (that row has left); a row whose commit finishes
        has left too."""
        out = self.alone.step()
        running = list(self.rows)
        for row, steps in list(self.prefilling.items()):
            try:
                next(steps)
            except StopIteration as prefilled:
                del self.prefilling[row]
                out[row] = self._started(row, prefilled.value)
                continue
            except Exception as exc:
                del self.prefilling[row]
                out[row] = exc
                self._end(row)
                continue
            out[row] = PREFILL_CHUNK
        if self.waiting:
            out |= self._prefill_waiting()
        if running:
            out |= self._pass(running, plan)
        for row in self._joining:  # after the pass: the cache holds the running rows only
            self._enter(row)
        self._joining.clear()
        return out

    def _started(self, row: Row, first: Cycle) -> Outcome:
        """Read a prefilled row's first token; it joins the batch unless that ends it."""
        try:
            commit = row.read(first)
        except Exception as exc:
            self._end(row)
            return exc
        if commit.finish is None:
            self._joining.append(row)
        else:
            self._end(row)
        return commit

    def _prefill_waiting(self) -> dict[Row, Outcome]:
        """Prefill the waiting prompts that fit one chunk of padded tokens (in arrival order)
        together; the others wait for later steps."""
        group: list[Row] = []
        widest = 0
        for row in self.waiting:
            widest = max(widest, len(row.prompt))
            if group and widest * (len(group) + 1) > row.prefill_step_size:
                break
            group.append(row)
        del self.waiting[: len(group)]
        try:
            if len(group) == 1:
                cycles = [prefill(group[0])]
            else:
                cycles = prefill_together(self.target, group)
                self.prefilled_together += len(group)
        except Exception as exc:  # each of these requests ends with it; the others go on
            for row in group:
                self._end(row)
            return dict.fromkeys(group, exc)
        return {row: self._started(row, cycle) for row, cycle in zip(group, cycles)}

    def _pass(self, rows: list[Row], plan: dict[Row, Choice] | None) -> dict[Row, Outcome]:
        try:
            commits = self._verify(rows, plan)
        except Exception as exc:  # every row of the pass ends with it; the batch goes on
            for row in rows:
                self._end(row)
            return dict.fromkeys(rows, exc)
        for row, commit in commits.items():
            if commit.finish is not None:
                self._end(row)
        return dict(commits)

    def _choices(self, rows: list[Row]) -> list[Choice]:
        """Each row's next cycle (its policy: drafter block, suffix copy or plain), narrowed by
        the verify budget and the ``max_verify`` cap. A pinned row (seeded sampling) keeps its
        width, so its answer never depends on the rows beside it."""
        if self.costs is not None and self.probes.quiet(rows):  # held, no probe due: no looks
            return [Choice.width(1)] * len(rows)
        choices = [row.choose() for row in rows]
        widths = [c.size for c in choices]
        if self.costs is not None and len(rows) > 1:  # the verify budget (adaptive/pass_costs.py)
            budget = choose_widths(rows, choices, self.costs)
            if budget == widths:
                self.probes.unnarrowed(max(widths) > 1)
            else:
                widths = self.probes.narrowed(rows, choices, self.costs) or budget
        if self.max_verify is not None:
            free = [not row.pinned for row in rows]
            while len(rows) * max(widths) > self.max_verify:
                top = max((w for w, f in zip(widths, free) if f), default=1)
                if top <= 1:
                    break
                widths = [w - 1 if w == top and f else w for w, f in zip(widths, free)]
        if self.probes.followed:  # narrowing persists: the rows follow it a while
            for row, c, w in zip(rows, choices, widths):
                if w < c.size:
                    row.policy.narrowed(w)
        return [c.narrow(w) for c, w in zip(choices, widths)]

    def _verify(self, rows: list[Row], plan: dict[Row, Choice] | None) -> dict[Row, Commit]:
        """One pass: draft, verify every row in one forward, score and commit each row, then
        roll each row back to its own kept prefix; the pass's wall time refines the budget."""
        assert self.cache is not None
        start = time.perf_counter()
        choices = self._choices(rows) if plan is None else [plan[row] for row in rows]
        with mx.stream(generation_stream):
            histories = [row.history() for row in rows]
            drafts = _drafts(rows, choices, histories)
            # A drafter may cut a block short (DSpark's confidence head): verify what it drafted.
            choices = [c.narrow(_size(d)) for c, (d, _) in zip(choices, drafts)]
            width = max(c.size for c in choices)
            # The budget's prediction for a pass of several rows with drafter rows (a lone row
            # is never budgeted: its passes must not judge the batch's, ``PassCosts.bias``).
            predicted = None
            if (
                self.costs is not None
                and len(rows) > 1
                and any(c.source == DRAFTER for c in choices)
            ):
                predicted = predicted_gain(rows, choices, self.costs)
            inputs = []
            for row, (proposal, _) in zip(rows, drafts):
                tokens = row.last if proposal is None else mx.concatenate([row.last, proposal])
                padding = width - tokens.shape[0]  # right padding: computed, never kept
                inputs.append(mx.concatenate([tokens, mx.zeros((padding,), mx.int32)]))
            self.cache.quantize_due()
            self.cache.layout.reserve(width)
            recording = self.target.hooks.recording() if width > 1 else contextlib.nullcontext()
            shifts = [row.shift for row in rows]  # each row's own (images), on its own row
            positions = Positions(shift=mx.array(shifts)) if any(shifts) else None
            with recording as record:
                logits, taps = self.target.forward(
                    mx.stack(inputs), self.cache.layers, slice(None), positions=positions
                )
            cycles = [
                row.score(c, logits[i, : c.size],
                          None if taps is None else taps[i : i + 1, : c.size],
                          inputs[i][: c.size], drafts[i][1], h)
                for i, (row, c, h) in enumerate(zip(rows, choices, histories))
            ]  # fmt: skip
            mx.eval(*[a for c in cycles for a in c.arrays()])
        # Each row learns what its own cycle would have cost alone (the rows' cost models are
        # lone ones): never a wider row's width (docs/design.md, "Batching under speculation").
        seconds = time.perf_counter() - start
        # Rows of a plain pass learn its pace every _TIME_PLAIN-th pass: their controllers look
        # at speculation as seldom, and timing every row of every pass cost a busy batch 1-2 %.
        timed = width > 1 or len(rows) == 1 or self.passes % _TIME_PLAIN == 0
        shares = self._lone_shares(rows, choices, width) if timed else [0.0] * len(rows)
        commits = {
            row: row.read(cycle, seconds * share if timed else None, timed)
            for row, cycle, share in zip(rows, cycles, shares)
        }
        for row in rows:
            row.stats.batch_histogram[len(rows)] = row.stats.batch_histogram.get(len(rows), 0) + 1
        keep = [row.kept for row in rows]
        with mx.stream(generation_stream):
            self.cache.layout.commit(keep, width)
            if width > 1:
                rollback_rows(self.target.hooks, self.cache, record, keep, width)
            lay = self.cache.layout
            if lay.idx > 2 * lay.step and lay.hole_share() > 0.5:
                self.cache.compact()
        if self.costs is not None:
            seconds = time.perf_counter() - start
            contexts = [row.position for row in rows]
            committed = sum(row.kept for row in rows)
            error = self.costs.observe(len(rows), width, seconds, contexts, committed, predicted)
            self.probes.observed(self.costs, rows, width, seconds, error)
        self.passes += 1
        self.last_pass = (len(rows), len(rows) * width)
        self.histogram[len(rows)] = self.histogram.get(len(rows), 0) + 1
        return commits

    def _lone_shares(self, rows: list[Row], choices: list[Choice], width: int) -> list[float]:
        """Each row's share of the pass's time: what its cycle (its own width and context)
        costs alone over what the whole pass costs, on the measured curve; without one, the
        whole pass (a lone pass: exactly its own)."""
        if self.costs is None or len(rows) < 2:
            return [1.0] * len(rows)
        contexts = [row.position for row in rows]
        whole = self.costs.cost(len(rows), width, contexts)
        return [self.costs.cost(1, c.size, [n]) / whole for c, n in zip(choices, contexts)]


def _drafts(
    rows: list[Row], choices: list[Choice], histories: list[mx.array | None]
) -> list[tuple[mx.array | None, mx.array | None]]:
    """(drafts, log q) per row: a copy's from the host, the drafting rows' from their drafters
    (each drafter's rows in one call where it can), none for a plain row."""
    out: list[tuple[mx.array | None, mx.array | None]] = [(None, None)] * len(rows)
    drafting: dict[int, list[tuple[int, DraftRow]]] = {}  # each drafter's rows, one call
    for i, (row, choice, history) in enumerate(zip(rows, choices, histories)):
        if choice.source == SUFFIX:
            out[i] = (mx.array(choice.tokens, dtype=mx.int32), None)
        elif choice.source == DRAFTER:
            mine = drafting.setdefault(id(row.draft), [])
            mine.append((i, row.draft_row(choice.size, row.last, history)))
    for mine in drafting.values():
        draft = cast(Drafter, rows[mine[0][0]].draft)
        for (i, _), (drafts, log_q) in zip(mine, draft.propose([d for _, d in mine])):
            out[i] = (drafts.astype(mx.int32), log_q) if drafts.shape[0] else (None, None)
    return out


def _size(drafts: mx.array | None) -> int:
    """The positions a row verifies: its anchor and its drafts."""
    return 1 if drafts is None else drafts.shape[0] + 1
