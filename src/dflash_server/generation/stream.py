"""Generation from a ``GenerationRequest``: token commits in, text segments out.

``generate`` is what the engine runs on its ``ModelPair``; ``stream_generate`` is the
reference-compatible Python API in front of it. Token-level termination lives in the decoder,
text-level (detokenizing, stop strings) in ``generation/text.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from dflash_server.generation.controller import SUFFIX, BlockController, FixedBlock
from dflash_server.generation.pair import ModelPair
from dflash_server.generation.protocols import Drafter, PrefixStore, TokenConstraint
from dflash_server.generation.request import (
    BlockSize,
    GenerationRequest,
    Prebuilt,
    block_policy,
)
from dflash_server.generation.sampling import SamplingParams, TokenSampler
from dflash_server.generation.speculative import (
    PREFILL_CHUNK,
    SpeculativeDecoder,
    SpeculativeStats,
)
from dflash_server.generation.suffix import SuffixProposer
from dflash_server.generation.target import TargetModel
from dflash_server.generation.text import TextStream, encode, hidden_tokens

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
    # Per token: its text and source: "draft" (accepted drafter token), "suffix" (accepted
    # suffix copy) or "target" (the target's own token).
    sources: list[tuple[str, str]] | None = None

    @property
    def token(self) -> int | None:
        return self.tokens[-1] if self.tokens else None


def generate(
    pair: ModelPair,
    request: GenerationRequest,
    *,
    prefill_step_size: int = 2048,
    profile: bool = False,
    prefix: PrefixStore | None = None,
    yield_chunks: bool = False,
    batch: BatchDecoder | None = None,
) -> Iterator[GenerationResponse]:
    """Run one request on a loaded pair (its drafter is ignored when not speculative).

    ``prefix``: a prefix cache to restore the prompt's longest cached prefix from and to keep
    this prompt's state in (at ``request.checkpoints``). ``block.auto`` decides by the pair's
    cycle costs (``ModelPair.costs``: measured at load by the engine, else on first use).
    ``yield_chunks``: yield an empty response after each prompt chunk but the last (the engine
    advances other streams in between). ``batch``: after its prefill the request's cycles run
    as one row of this batch (``generation/batch.py``), which its owner steps.
    """
    draft = pair.draft if request.speculative else None
    block = request.block
    policy: FixedBlock | BlockController = FixedBlock(block.width if draft else 1)
    suffix = None
    if block.copies:
        suffix = SuffixProposer(request.prompt, pair.suffix_index, block.suffix)
    if (draft is not None and block.auto) or suffix is not None:
        costs = pair.costs(block.suffix + 1 if suffix is not None else 0).copy()
        policy = BlockController(block.width if draft else 1, costs, prior=pair.prior)
    target = pair.target if draft is not None else TargetModel(pair.model, ())
    tokenizer = pair.tokenizer
    constraint = None if request.constraint is None else request.constraint.build(tokenizer)
    decoder = SpeculativeDecoder(
        target,
        draft,
        TokenSampler(request.sampling, request.seed, request.sampler),
        policy,
        prefill_step_size=prefill_step_size,
        profile=profile,
        logprobs=request.logprobs,
        constraint=constraint,
        prefix=prefix,
        checkpoints=request.checkpoints,
        suffix=suffix,
    )
    hidden = hidden_tokens(tokenizer) if request.skip_special_tokens else frozenset()
    text = TextStream(tokenizer, request.stop, hidden)
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
            drafted_as = "suffix" if commit.source == SUFFIX else "draft"
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
                sources=[
                    (piece, drafted_as if j < kept_commit.drafted else "target")
                    for j, piece in enumerate(text.pieces)
                ],
            )
            i += 1
            if finish is not None:
                return
    finally:
        close = getattr(commits, "close", None)  # a batch row leaves its batch now
        if close is not None:
            close()


def stream_generate(
    model: nn.Module,
    draft: Drafter | None,
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
    suffix: int = 0,
) -> Iterator[GenerationResponse]:
    """Generate with DFlash speculative decoding (``draft=None``: plain decoding).

    The output is exactly what the target alone would produce: identical tokens under greedy
    decoding, the same distribution under sampling (see README, "Acceptance rule"). ``sampler``
    (an mlx-lm sampler, as older reference code passes) replaces temperature/top-p/top-k/min-p.
    ``logprobs=k`` reports each token's log-probability and its k best alternatives (k may be 0);
    ``constraint`` (a grammar matcher, see ``TokenConstraint``) restricts every position.
    ``block_size``: None (as the reference) verifies the drafter's trained block every cycle, a
    number that many positions, ``"auto"`` lets the controller pick 1..trained per cycle.
    ``suffix=n`` (with ``"auto"`` or ``draft=None``) lets it also verify up to n tokens copied
    from the prompt, the output so far and the pair's recent outputs (suffix drafts).
    """
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    sampling = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, logit_bias=logit_bias,
    )  # fmt: skip
    pair = ModelPair.of(model, tokenizer, draft)
    request = GenerationRequest(
        prompt=tuple(encode(tokenizer, prompt)),
        max_tokens=max_tokens,
        sampling=sampling,
        seed=seed,
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        block=replace(block_policy(draft, block_size), suffix=suffix),
        logprobs=logprobs,
        constraint=None if constraint is None else Prebuilt(constraint),
        sampler=sampler,
    )
    with pair.wired.held():
        yield from generate(pair, request, prefill_step_size=prefill_step_size, profile=profile)
