"""An admitted job on the engine's worker thread: its stream's responses become its events."""

from __future__ import annotations

import logging
from collections.abc import Hashable

from dflash_server.chat.logprobs import TokenTexts, token_logprobs
from dflash_server.engine.jobs import Finished, Job, RequestTimings, TextChunk
from dflash_server.generation.stream import GenerationResponse

log = logging.getLogger("dflash_server")


class Run:
    """An admitted job: its stream (of the engine's ``Streams``), the token names its logprobs
    need, and what its final event needs."""

    def __init__(self, job: Job, stream: Hashable, texts: TokenTexts | None) -> None:
        self.job, self.stream, self.texts = job, stream, texts
        self.last: GenerationResponse | None = None
        self.produced = 0

    def deliver(self, response: GenerationResponse) -> bool:
        """Emit a response's text; True once it ends the run."""
        self.last = response
        self.produced += len(response.tokens)
        if response.text or response.tokens:
            lps = None
            if self.texts is not None:
                lps = token_logprobs(
                    self.texts, response.tokens, response.logprobs, response.top_logprobs
                )
            self.job.emit(TextChunk(response.text, len(response.tokens), lps, response.sources))
        return response.finish_reason is not None

    def finished(self) -> Finished:
        """The final event of a run that ended (its stats, timings, usage), and the request's
        log line."""
        job, last = self.job, self.last
        assert last is not None, "a run ends on a response"
        request = job.request
        stats = last.stats
        done = Finished(
            finish_reason=last.finish_reason or "length",
            prompt_tokens=len(request.prompt),
            completion_tokens=self.produced,
            speculative=request.speculative,
            block_size=request.block.width,
            stats=stats,
            timings=RequestTimings(
                queue_wait_s=round((job.started or job.created) - job.created, 3),
                prompt_tps=round(float(last.prompt_tps), 2),
                generation_tps=round(float(last.generation_tps), 2),
                peak_memory_gb=round(float(last.peak_memory), 3),
            ),
            cached_tokens=stats.cached_tokens if stats is not None else 0,
            stop_sequence=last.stop,
        )
        speculation = "plain decoding" + (stats.batches() if stats is not None else "")
        if (request.speculative or request.block.copies) and stats is not None:
            speculation = stats.summary()  # tau, block sizes used, plain share, estimate
        log.info(
            "request: %d prompt (%s) + %d output tokens (%s), %.1f tok/s, %s",
            done.prompt_tokens,
            f"prefix cache hit: {done.cached_tokens} reused"
            if done.cached_tokens
            else "prefix cache miss",
            done.completion_tokens,
            done.finish_reason,
            last.generation_tps,
            speculation,
        )
        return done
