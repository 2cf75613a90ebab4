"""What the engine's round steps: the running requests as streams of responses (``Streams``).

``RowStreams`` runs each request as a ``Generation`` on the resident pair: its row joins the
engine's rows (the ``BatchDecoder``, or ``LoneRows`` when interleaving), and each step's commits
become each request's responses (text, stop strings, timings). With the target sharded over
several machines, the ``lockstep`` hears of every row that starts or stops and steps the batch
itself, so every rank runs the same round. Tests put a double of their own in its place
(``Engine(streams=...)``); the round is the same either way.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Protocol

from dflash_server.generation.batch import BatchDecoder
from dflash_server.generation.kv_quant import KVQuant
from dflash_server.generation.pair import ModelPair
from dflash_server.generation.protocols import PrefixStore
from dflash_server.generation.request import GenerationRequest
from dflash_server.generation.row import Row
from dflash_server.generation.speculative import LoneRows
from dflash_server.generation.stream import Generation, GenerationResponse

if TYPE_CHECKING:
    from dflash_server.engine.lockstep import Leader

# What a step hands a stream: its next response, or the error that ended it.
Outcome = GenerationResponse | Exception


class Streams(Protocol):
    """The running requests, stepped together once per round."""

    @property
    def busy(self) -> bool:  # whether a step has anything to do
        ...

    def start(self, request: GenerationRequest) -> Hashable:
        """Take a request; its first response comes from a later ``step``. Raises (a
        ValueError naming the cause) for a request it cannot run."""
        ...

    def stop(self, stream: Hashable) -> None:
        """A stream leaves (ended, or cancelled): its caches are freed now."""
        ...

    def step(self) -> dict[Hashable, Outcome]:
        """One round: each running stream's next response (empty while its prompt prefills);
        a stream whose response ends it, or that failed, is done."""
        ...


class RowStreams:
    """Each request a ``Generation`` on ``pair``, its row one of ``rows``."""

    def __init__(
        self,
        pair: ModelPair,
        rows: BatchDecoder | LoneRows,
        *,
        prefill_step_size: int,
        prefix: PrefixStore | None,
        kv: KVQuant | None,
        lockstep: Leader | None = None,
    ) -> None:
        self.pair, self.rows, self.lockstep = pair, rows, lockstep
        self.prefill_step_size, self.prefix, self.kv = prefill_step_size, prefix, kv
        self._by_row: dict[Row, Generation] = {}

    @property
    def busy(self) -> bool:
        # Under lockstep an idle round still steps: it is the other ranks' heartbeat.
        return self.lockstep is not None or self.rows.busy

    def start(self, request: GenerationRequest) -> Generation:
        generation = Generation(
            self.pair, request, prefill_step_size=self.prefill_step_size, prefix=self.prefix,
            kv=self.kv,
        )  # fmt: skip
        row = generation.row
        self.rows.add(row, generation.prompt, request.max_tokens, generation.eos_ids)
        if self.lockstep is not None:
            self.lockstep.added(row, request)
        self._by_row[row] = generation
        return generation

    def stop(self, stream: Hashable) -> None:
        assert isinstance(stream, Generation)
        row = stream.row
        self._by_row.pop(row, None)
        if self.lockstep is not None:
            self.lockstep.removed(row)
        self.rows.remove(row)

    def step(self) -> dict[Hashable, Outcome]:
        if self.lockstep is not None:
            assert isinstance(self.rows, BatchDecoder), "ranks run in lockstep only batched"
            commits = self.lockstep.step(self.rows)  # the round's decisions go to every rank
        else:
            commits = self.rows.step()
        out: dict[Hashable, Outcome] = {}
        for row, commit in commits.items():
            generation = self._by_row[row]
            out[generation] = (
                commit if isinstance(commit, Exception) else generation.respond(commit)
            )
        return out
