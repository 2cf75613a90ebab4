"""Every rank runs the same engine rounds; rank 0 alone decides.

What a round decides may depend on the clock or on chance: which requests start (and how much
of each prompt the prefix cache restores: its disk tier is written in the background), which
stop (cancelled, or ended on a stop string), and each running row's cycle (the "auto" widths
follow wall-clock timings, suffix copies the shared index, the verify budget measured costs).
Rank 0's engine decides all of that as on one machine; its ``Leader`` records the decisions and
sends them as one ``Round`` before the step, and every other rank's ``Follower`` applies exactly
those and steps the same batch. The rest follows from the same inputs: sampling draws come from
each request's ``entropy`` (drawn once, on rank 0, when the request was built), and what a rank
samples from (hidden states, gathered logits) comes out of the same collectives on every rank.
Each round also carries a digest of the previous round's tokens on rank 0, so a rank that
diverged stops at once instead of answering wrongly (docs/design.md, "Several machines").
"""

from __future__ import annotations

import hashlib
import logging
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dflash_server.adaptive.policy import Choice
from dflash_server.engine.distributed import Channel, RankLost, Watchdog, lost
from dflash_server.engine.prefix_cache import PrefixCache
from dflash_server.generation.batch import BatchDecoder, Outcome
from dflash_server.generation.request import GenerationRequest
from dflash_server.generation.row import Row
from dflash_server.generation.stream import Generation

if TYPE_CHECKING:
    from dflash_server.generation.pair import ModelPair
    from dflash_server.generation.prefix import PromptSnapshot

log = logging.getLogger("dflash_server")


@dataclass(frozen=True)
class Added:
    """A request rank 0 admitted: its id on every rank, the request itself (its entropy
    included) and how many prompt tokens rank 0's prefix cache restores (0: none)."""

    id: int
    request: GenerationRequest
    restored: int


@dataclass(frozen=True)
class Removed:
    """A request rank 0 dropped before it finished (cancelled, or ended on a stop string)."""

    id: int


@dataclass
class Round:
    """One round's decisions, in the order rank 0 made them, and its pass's cycles."""

    events: list[Added | Removed] = field(default_factory=list)
    plan: list[tuple[int, Choice]] = field(default_factory=list)  # running rows, by id
    step: bool = False  # whether the batch steps this round (else: a heartbeat)
    digest: bytes = b""  # the previous round's outcomes on rank 0
    stop: bool = False  # rank 0 shuts down: every rank exits

    def encode(self) -> bytes:
        return pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def decode(data: bytes) -> Round:
        message = pickle.loads(data)  # from rank 0 of the same launch, trusted as the model is
        if not isinstance(message, Round):
            raise RankLost(f"rank 0 sent a {type(message).__name__}, not a round")
        return message


def _digest(outcomes: dict[Row, Outcome], ids: dict[Row, int]) -> bytes:
    """What a step produced, by request id: every rank's must be rank 0's."""
    seen = sorted(
        (ids.get(row, -1), "error" if isinstance(o, Exception) else (o.tokens, o.finish))
        for row, o in outcomes.items()
    )
    return hashlib.blake2b(repr(seen).encode(), digest_size=8).digest()


def _step(batch: BatchDecoder, plan: dict[Row, Choice]) -> dict[Row, Outcome]:
    """One step of the batch with rank 0's plan; a transport error among its outcomes means a
    rank was lost (raised), not a failed request."""
    outcomes = batch.step(plan)
    for outcome in outcomes.values():
        if isinstance(outcome, Exception) and lost(outcome):
            raise RankLost(f"lost another rank ({outcome}): restart every rank") from outcome
    return outcomes


class Leader:
    """Rank 0's side: the engine's ``lockstep``. The engine reports each admitted and dropped
    request; ``step`` sends the round's decisions, then steps the batch by them."""

    def __init__(self, channel: Channel, timeout_s: float, on_lost: Callable[[str], None]):
        self.channel = channel
        self.watchdog = Watchdog(timeout_s, on_lost)
        self.heartbeat_s = min(1.0, timeout_s / 4)  # an idle engine still sends a round
        self._ids: dict[Row, int] = {}
        self._next = 0
        self._round = Round()

    @property
    def memory(self) -> list[tuple[int, int]]:
        """Each rank's (active, peak) MLX memory in bytes, as of the last round."""
        return self.channel.memory

    def added(self, row: Row, request: GenerationRequest) -> None:
        """A request became a row (after ``rows.add``): every rank adds it, restoring what
        this rank's prefix cache restores."""
        hit = row.prefix_hit()
        self._ids[row] = self._next
        self._round.events.append(Added(self._next, request, hit[1] if hit else 0))
        self._next += 1

    def removed(self, row: Row) -> None:
        """A request's row is leaving (before ``rows.remove``); one that ended by itself ended
        on every rank already."""
        rid = self._ids.pop(row, None)
        if rid is not None and not row.done:
            self._round.events.append(Removed(rid))

    def step(self, batch: BatchDecoder) -> dict[Row, Outcome]:
        """Send this round's decisions (a heartbeat when there are none), then step the batch
        by them when it has work."""
        message, self._round = self._round, Round()
        with self.watchdog.round():
            plan = batch.plan() if batch.busy else {}
            message.plan = [(self._ids[row], choice) for row, choice in plan.items()]
            message.step = batch.busy
            self.channel.exchange(message.encode())
            outcomes = _step(batch, plan) if message.step else {}
        self._round.digest = _digest(outcomes, self._ids)
        return outcomes

    def close(self) -> None:
        """Tell every rank to exit (rank 0 is shutting down)."""
        with self.watchdog.round():
            self.channel.exchange(Round(stop=True).encode())


class Follower:
    """A rank other than 0: no HTTP, no queue; each round it applies rank 0's decisions and
    steps the same batch. ``run`` returns when rank 0 shuts down; a lost or diverged rank
    raises ``RankLost``."""

    def __init__(
        self,
        pair: ModelPair,
        batch: BatchDecoder,
        channel: Channel,
        *,
        timeout_s: float,
        on_hang: Callable[[str], None],
        prefill_step_size: int,
        prefix_cache: PrefixCache | None,
    ) -> None:
        self.pair, self.batch, self.channel = pair, batch, channel
        self.watchdog = Watchdog(timeout_s, on_hang)
        self.prefill_step_size, self.prefix_cache = prefill_step_size, prefix_cache
        self.rows: dict[int, Row] = {}
        self._digest = _digest({}, {})

    def run(self) -> None:
        while True:
            with self.watchdog.round():
                message = Round.decode(self.channel.exchange())
                if message.stop:
                    return
                if message.digest and message.digest != self._digest:
                    raise RankLost(
                        f"rank {self.channel.rank} diverged from rank 0 in round "
                        f"{self.channel.rounds - 1}: its tokens differ"
                    )
                for event in message.events:
                    self._apply(event)
                outcomes = self._step(message.plan) if message.step else {}
            ids = {row: rid for rid, row in self.rows.items()}
            self._digest = _digest(outcomes, ids)
            for row, outcome in outcomes.items():  # rows that ended by themselves
                if isinstance(outcome, Exception) or outcome.finish is not None:
                    self.rows.pop(ids[row], None)

    def _apply(self, event: Added | Removed) -> None:
        if isinstance(event, Removed):
            row = self.rows.pop(event.id, None)
            if row is not None:
                self.batch.remove(row)
            return
        store = None
        if self.prefix_cache is not None:
            store = AgreedPrefix(self.prefix_cache, event.restored, self.channel.rank)
        generation = Generation(
            self.pair, event.request, prefill_step_size=self.prefill_step_size, prefix=store,
            kv=self.batch.kv,
        )  # fmt: skip
        row = generation.row
        self.batch.add(row, generation.prompt, event.request.max_tokens, generation.eos_ids)
        row.prefix_hit()  # where rank 0 looked: before anything else changes the cache
        self.rows[event.id] = row

    def _step(self, plan: list[tuple[int, Choice]]) -> dict[Row, Outcome]:
        choices = {self.rows[rid]: choice for rid, choice in plan if rid in self.rows}
        if len(choices) != len(plan) or set(choices) != set(self.batch.rows):
            raise RankLost(
                f"rank {self.channel.rank} diverged from rank 0: its running requests differ"
            )
        return _step(self.batch, choices)


class AgreedPrefix:
    """A follower's prefix store for one request: it restores exactly the prefix rank 0
    restored. The caches hold the same entries on every rank (the same prompts stored in the
    same order), but a disk write may still be in flight on one rank: then it waits for it."""

    def __init__(self, cache: PrefixCache, restored: int, rank: int) -> None:
        self.cache, self.restored, self.rank = cache, restored, rank

    def lookup(self, kind: tuple, prompt: Sequence[int]) -> tuple[PromptSnapshot, int] | None:
        if self.restored == 0:
            return None
        wanted = list(prompt[: self.restored + 1])  # nothing longer than rank 0's prefix
        found = self.cache.lookup(kind, wanted)
        if (found is None or found[1] != self.restored) and self.cache.disk is not None:
            self.cache.disk.flush()
            found = self.cache.lookup(kind, wanted)
        if found is None or found[1] != self.restored:
            raise RankLost(
                f"rank {self.rank}'s prefix cache cannot restore the {self.restored} prompt "
                "tokens rank 0 restored (its disk tier lost a file?); restart every rank"
            )
        return found

    def store(self, kind: tuple, snapshot: PromptSnapshot) -> None:
        self.cache.store(kind, snapshot)
