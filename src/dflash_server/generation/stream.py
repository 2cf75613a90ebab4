"""Generation from a ``GenerationRequest``: token commits in, text segments out.

``generate`` is what the engine runs; ``stream_generate`` is the reference-compatible Python API
in front of it. Token-level termination lives in the decoder, text-level (detokenizing, stop
strings) in ``TextStream``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream, wired_limit
from mlx_lm.tokenizer_utils import TokenizerWrapper

from dflash_server.generation.controller import BlockController, SharedPrior
from dflash_server.generation.costs import CostModel, costs_for
from dflash_server.generation.prefix import PrefixStore
from dflash_server.generation.request import (
    BlockSize,
    GenerationRequest,
    Prebuilt,
    block_policy,
)
from dflash_server.generation.sampling import SamplingParams, TokenConstraint, TokenSampler
from dflash_server.generation.speculative import (
    PREFILL_CHUNK,
    Commit,
    SpeculativeDecoder,
    SpeculativeStats,
)
from dflash_server.generation.target import TargetModel
from dflash_server.models.drafter import DFlashDraftModel

if TYPE_CHECKING:
    from dflash_server.generation.batch import BatchDecoder


@dataclass
class GenerationResponse:
    """One streamed step: the text and tokens committed since the previous response."""

    text: str
    tokens: list[int]
    finish_reason: str | None  # None while running, then "stop" (EOS / stop string) or "length"
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float  # GB
    stats: SpeculativeStats | None = None
    accepted: int | None = None  # tokens this cycle committed (None for the prefill's token)
    logprobs: list[float] | None = None  # per token in ``tokens``, when asked for
    top_logprobs: list[list[tuple[int, float]]] | None = (
        None  # per token: (id, logprob), best first
    )
    stop: str | None = None  # the stop string that ended generation (finish_reason "stop")
    # Per token: its text and whether it was an accepted draft (else the target's own token).
    sources: list[tuple[str, bool]] | None = None

    @property
    def token(self) -> int | None:
        return self.tokens[-1] if self.tokens else None


def encode(tokenizer: TokenizerWrapper, prompt: str | Sequence[int] | mx.array) -> list[int]:
    """Token ids of a prompt, tokenized like mlx-lm's generate (BOS added unless present)."""
    if isinstance(prompt, str):
        bos = getattr(tokenizer, "bos_token", None)
        add_special = bos is None or not prompt.startswith(bos)
        return list(tokenizer.encode(prompt, add_special_tokens=add_special))
    ids = prompt.tolist() if isinstance(prompt, mx.array) else list(prompt)
    return [int(t) for t in ids]


class _StopMatcher:
    """Holds back text that could still become a stop string; never emits past one."""

    def __init__(self, stop: Sequence[str]):
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Add text; return (text safe to emit, the stop string hit first, if any)."""
        self.pending += text
        hits = [(at, s) for s in self.stop if (at := self.pending.find(s)) >= 0]
        if hits:
            at, stop = min(hits)
            out, self.pending = self.pending[:at], ""
            return out, stop
        cut = max(0, len(self.pending) - self.hold)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, None

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class TextStream:
    """Token commits -> text: the detokenizer plus stop strings (text-level termination)."""

    def __init__(self, tokenizer: TokenizerWrapper, stop: Sequence[str]) -> None:
        self.detokenizer = tokenizer.detokenizer
        self.detokenizer.reset()
        self.stops = _StopMatcher(stop)
        self.hit: str | None = None  # the stop string that ended the text
        self.pieces: list[str] = []  # each token's own text in the last ``feed`` (detokenized)

    def feed(self, commit: Commit) -> tuple[str, int, str | None]:
        """(text safe to emit, tokens it covers, finish reason or None)."""
        text, finish, self.pieces = "", commit.finish, []
        for n, token in enumerate(commit.tokens, 1):
            self.detokenizer.add_token(token)
            self.pieces.append(self.detokenizer.last_segment)
            segment, self.hit = self.stops.feed(self.pieces[-1])
            text += segment
            if self.hit is not None:
                return text, n, "stop"
        if finish is not None:  # flush held-back bytes and text
            self.detokenizer.finalize()
            held = self.detokenizer.last_segment  # reading it consumes it
            if self.pieces:  # bytes held back by the detokenizer belong to the last token
                self.pieces[-1] += held
            tail, self.hit = self.stops.feed(held)
            text += tail if self.hit is not None else tail + self.stops.flush()
            finish = "stop" if self.hit is not None else finish
        return text, len(commit.tokens), finish


def generate(
    model: nn.Module,
    draft: DFlashDraftModel | None,
    tokenizer: TokenizerWrapper,
    request: GenerationRequest,
    *,
    prefill_step_size: int = 2048,
    profile: bool = False,
    prefix: PrefixStore | None = None,
    costs: CostModel | None = None,
    yield_chunks: bool = False,
    batch: BatchDecoder | None = None,
) -> Iterator[GenerationResponse]:
    """Run one request (``draft`` must be bound to ``model``; ignored when not speculative).

    ``prefix``: a prefix cache to restore the prompt's longest cached prefix from and to keep
    this prompt's state in (at ``request.checkpoints``). ``costs``: the pair's cycle costs for
    ``request.adaptive`` (default: measured once per pair, see ``costs_for``).
    ``yield_chunks``: yield an empty response after each prompt chunk but the last (the engine
    advances other streams in between). ``batch``: after its prefill the request's cycles run
    as one row of this batch (``generation/batch.py``), which its owner steps.
    """
    draft = draft if request.speculative else None
    policy = None
    if draft is not None and request.adaptive:
        costs = costs if costs is not None else costs_for(model, draft)
        policy = BlockController(request.block_size, costs.copy(), prior=SharedPrior.of(draft))
    target = TargetModel.of(model, draft.config.target_layer_ids if draft else ())
    constraint = None if request.constraint is None else request.constraint.build(tokenizer)
    decoder = SpeculativeDecoder(
        target,
        draft,
        TokenSampler(request.sampling, request.seed, request.sampler),
        request.block_size,
        prefill_step_size,
        profile,
        request.logprobs,
        constraint,
        prefix,
        request.checkpoints,
        policy,
    )
    text = TextStream(tokenizer, request.stop)
    prompt = list(request.prompt)
    tic = time.perf_counter()
    prompt_tps, n = 0.0, 0
    if batch is not None:
        commits = batch.join(decoder, prompt, request.max_tokens, tokenizer.eos_token_ids)
    else:
        commits = decoder.generate(
            prompt, request.max_tokens, tokenizer.eos_token_ids, yield_chunks
        )
    i = 0  # commits so far (the first holds the prefill's token)
    try:
        for commit in commits:
            if commit is PREFILL_CHUNK:  # the prefill goes on: nothing to say yet
                yield GenerationResponse("", [], None, len(prompt), 0.0, 0, 0.0, 0.0)
                continue
            if i == 0:
                decoder.stats.prefill_s = time.perf_counter() - tic
                prompt_tps = (len(prompt) - decoder.stats.cached_tokens) / decoder.stats.prefill_s
                tic = time.perf_counter()
            segment, kept, finish = text.feed(commit)
            n += kept
            kept_commit = commit.truncate(kept)
            yield GenerationResponse(
                text=segment,
                tokens=kept_commit.tokens,
                finish_reason=finish,
                prompt_tokens=len(prompt),
                prompt_tps=prompt_tps,
                generation_tokens=n,
                generation_tps=n / max(time.perf_counter() - tic, 1e-9),
                peak_memory=mx.get_peak_memory() / 1e9,
                stats=decoder.stats,
                accepted=None if i == 0 else len(commit.tokens),
                logprobs=kept_commit.logprobs,
                top_logprobs=kept_commit.top_logprobs,
                stop=text.hit,
                sources=[(piece, j < kept_commit.drafted) for j, piece in enumerate(text.pieces)],
            )
            i += 1
            if finish is not None:
                return
    finally:
        commits.close()  # a batch row leaves its batch now, not when collected


class WiredLimit:
    """mlx-lm's ``wired_limit`` for one model (Metal: keep weights resident; no-op on CPU), held
    by the engine for its lifetime, or by each Python API generation; the first holder sets it
    and the last restores it, so interleaved holders never restore it out of order."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.holders = model, 0
        self._context: contextlib.AbstractContextManager | None = None
        self._lock = threading.Lock()

    @classmethod
    def of(cls, model: nn.Module) -> WiredLimit:
        """The one holder per model, kept on the model itself."""
        if "_dflash_wired_limit" not in model.__dict__:
            model.__dict__["_dflash_wired_limit"] = cls(model)
        return model.__dict__["_dflash_wired_limit"]

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if self.holders == 0:
                self._context = wired_limit(self.model, [generation_stream])
                self._context.__enter__()
            self.holders += 1
        try:
            yield
        finally:
            with self._lock:
                self.holders -= 1
                if self.holders == 0 and self._context is not None:
                    self._context.__exit__(None, None, None)


def stream_generate(
    model: nn.Module,
    draft: DFlashDraftModel | None,
    tokenizer: TokenizerWrapper,
    prompt: str | Sequence[int] | mx.array,
    block_size: BlockSize | None = None,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    stop: str | Sequence[str] | None = None,
    seed: int | None = None,
    prefill_step_size: int = 2048,
    logit_bias: dict[int, float] | None = None,
    sampler: Callable[[mx.array], mx.array] | None = None,
    logprobs: int | None = None,
    constraint: TokenConstraint | None = None,
    profile: bool = False,
) -> Iterator[GenerationResponse]:
    """Generate with DFlash speculative decoding (``draft=None``: plain decoding).

    The output is exactly what the target alone would produce: identical tokens under greedy
    decoding, the same distribution under sampling (see README, "Acceptance rule"). ``sampler``
    (an mlx-lm sampler, as older reference code passes) replaces temperature/top-p/top-k/min-p.
    ``logprobs=k`` reports each token's log-probability and its k best alternatives (k may be 0);
    ``constraint`` (a grammar matcher, see ``TokenConstraint``) restricts every position.
    ``block_size``: None (as the reference) verifies the drafter's trained block every cycle, a
    number that many positions, ``"auto"`` lets the controller pick 1..trained per cycle.
    """
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    sampling = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, logit_bias=logit_bias,
    )  # fmt: skip
    if draft is not None:
        draft.bind(model)  # cheap; the engine binds once at load and calls ``generate``
    width, adaptive = block_policy(draft, block_size)
    request = GenerationRequest(
        prompt=tuple(encode(tokenizer, prompt)),
        max_tokens=max_tokens,
        sampling=sampling,
        seed=seed,
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        block_size=width,
        adaptive=adaptive,
        logprobs=logprobs,
        constraint=None if constraint is None else Prebuilt(constraint),
        sampler=sampler,
    )
    with WiredLimit.of(model).held():
        yield from generate(
            model, draft, tokenizer, request, prefill_step_size=prefill_step_size, profile=profile
        )
