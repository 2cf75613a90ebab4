"""An admitted job on the engine's worker thread: what runs it, and the events it ends with."""

from __future__ import annotations

import logging
from collections.abc import Iterator

from dflash_server.chat.logprobs import TokenTexts, token_logprobs
from dflash_server.engine.jobs import Event, Failed, Finished, Job, RequestTimings, TextChunk
from dflash_server.generation.cycle import Commit
from dflash_server.generation.stream import Generation, GenerationResponse

log = logging.getLogger("dflash_server")


class Run:
    """An admitted job on the worker thread: a row of the engine's rows (``generation``) or a
    test double's responses (``gen``), and what its final event needs."""

    def __init__(
        self,
        job: Job,
        texts: TokenTexts | None,
        generation: Generation | None = None,
        gen: Iterator[GenerationResponse] | None = None,
    ) -> None:
        self.job, self.texts, self.generation, self.gen = job, texts, generation, gen
        self.last: GenerationResponse | None = None
        self.produced = 0

    def step(self) -> Event | None:
        """A ``gen`` run: its next response; the final event once it ends."""
        assert self.gen is not None
        try:
            response = next(self.gen)
        except StopIteration:
            return DONE
        except Exception as exc:
            log.exception("generation failed")
            return Failed(f"generation failed: {exc}")
        return self.deliver(response)

    def feed(self, outcome: Commit | Exception) -> Event | None:
        """A row run: what a step of the rows handed it; the final event once it ends."""
        assert self.generation is not None
        if isinstance(outcome, Exception):
            log.error("generation failed", exc_info=outcome)
            return Failed(f"generation failed: {outcome}")
        return self.deliver(self.generation.respond(outcome))

    def deliver(self, response: GenerationResponse) -> Event | None:
        self.last = response
        self.produced += len(response.tokens)
        if response.text or response.tokens:
            lps = None
            if self.texts is not None:
                lps = token_logprobs(
                    self.texts, response.tokens, response.logprobs, response.top_logprobs
                )
            self.job.emit(TextChunk(response.text, len(response.tokens), lps, response.sources))
        return DONE if response.finish_reason is not None else None

    def finished(self) -> Finished:
        """The final event of a run that ended (its stats, timings, usage), and the request's
        log line."""
        job, last = self.job, self.last
        request = job.request
        prompt_tokens = len(request.prompt)
        done = Finished(
            "length", prompt_tokens, 0, request.speculative, request.block.width, None, None
        )
        if last is None:  # the generator yielded nothing at all
            return done
        done.completion_tokens = self.produced
        done.finish_reason = last.finish_reason or "length"
        done.stop_sequence = last.stop
        done.stats = last.stats
        done.cached_tokens = last.stats.cached_tokens if last.stats is not None else 0
        done.timings = RequestTimings(
            queue_wait_s=round((job.started or job.created) - job.created, 3),
            prompt_tps=round(float(last.prompt_tps), 2),
            generation_tps=round(float(last.generation_tps), 2),
            peak_memory_gb=round(float(last.peak_memory), 3),
        )
        speculation = "plain decoding" + (last.stats.batches() if last.stats is not None else "")
        if (request.speculative or request.block.copies) and last.stats is not None:
            speculation = last.stats.summary()  # tau, block sizes used, plain share, estimate
        log.info(
            "request: %d prompt (%s) + %d output tokens (%s), %.1f tok/s, %s",
            done.prompt_tokens,
            f"prefix cache hit: {done.cached_tokens} reused"
            if done.cached_tokens
            else "prefix cache miss",
            done.completion_tokens,
            done.finish_reason,
            done.timings.generation_tps,
            speculation,
        )
        return done


DONE = Finished("", 0, 0)  # sentinel: the run ended; ``Run.finished`` builds the real event
