"""Generation from a ``GenerationRequest``: token commits in, text segments out.

``Generation`` is one request on a ``ModelPair`` (its row, and what its commits become as
text); ``generate`` runs one alone; ``stream_generate`` is the reference-compatible Python API
in front of it. Token-level termination lives in the row, text-level (detokenizing, stop
strings) in ``generation/text.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from dflash_server.adaptive.controller import BlockController
from dflash_server.adaptive.policy import SUFFIX, FixedBlock, WidthPolicy
from dflash_server.drafters.protocol import Drafter
from dflash_server.drafters.suffix import SuffixProposer
from dflash_server.generation.cycle import PREFILL_CHUNK, Commit
from dflash_server.generation.images import PromptImages
from dflash_server.generation.kv_quant import QUANTIZED_KV_START, KVQuant
from dflash_server.generation.pair import ModelPair
from dflash_server.generation.protocols import PrefixStore, TokenConstraint
from dflash_server.generation.request import (
    BlockSize,
    GenerationRequest,
    Prebuilt,
    block_policy,
    trained_block,
)
from dflash_server.generation.row import Row
from dflash_server.generation.sampling import SamplingParams, TokenSampler
from dflash_server.generation.speculative import SpeculativeDecoder
from dflash_server.generation.stats import SpeculativeStats
from dflash_server.generation.target import TargetModel
from dflash_server.generation.text import TextStream, encode, hidden_tokens
from dflash_server.models.vision import ImageInput, VisionTower, expand_pads, open_image


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


class Generation:
    """One request on a loaded pair: its ``Row``, and the responses its commits become (text,
    stop strings, timings). Run alone by ``generate``, or as a row of the engine's batch.

    ``prefix``: a prefix cache to restore the prompt's longest cached prefix from and to keep
    this prompt's state in (at ``request.checkpoints``). ``block.auto`` decides by the pair's
    cycle costs (``ModelPair.costs``: measured at load by the engine, else on first use).
    """

    def __init__(
        self,
        pair: ModelPair,
        request: GenerationRequest,
        *,
        prefill_step_size: int = 2048,
        profile: bool = False,
        prefix: PrefixStore | None = None,
        kv: KVQuant | None = None,
    ) -> None:
        draft = pair.draft if request.speculative else None
        block = request.block
        policy: WidthPolicy = FixedBlock(block.width if draft else 1)
        suffix = None
        if block.copies:
            suffix = SuffixProposer(request.prompt, pair.suffix_index, block.suffix)
        if (draft is not None and block.auto) or suffix is not None:
            costs = pair.costs.get(block.suffix + 1 if suffix is not None else 0).copy()
            policy = BlockController(block.width if draft else 1, costs, prior=pair.prior)
        target = pair.target if draft is not None else TargetModel(pair.model, ())
        images = None
        if request.images:
            if pair.vision is None:
                raise ValueError("this model takes no images (its checkpoint has no vision tower)")
            images = PromptImages(pair.vision, request.images, request.prompt)
        tokenizer = pair.tokenizer
        constraint = None if request.constraint is None else request.constraint.build(tokenizer)
        self.row = Row(
            target,
            draft,
            TokenSampler(request.sampling, request.seed, request.sampler, request.entropy),
            policy,
            prefill_step_size=prefill_step_size,
            profile=profile,
            logprobs=request.logprobs,
            constraint=constraint,
            prefix=prefix,
            checkpoints=request.checkpoints,
            suffix=suffix,
            images=images,
            kv=kv,
        )
        self.request = request
        self.prompt = list(request.prompt)
        self.eos_ids = tokenizer.eos_token_ids
        hidden = hidden_tokens(tokenizer) if request.skip_special_tokens else frozenset()
        self.text = TextStream(tokenizer, request.stop, hidden)
        self._tic = time.perf_counter()
        self._prompt_tps = 0.0
        self._tokens = 0  # tokens handed out so far
        self._commits = 0  # commits so far (the first holds the prefill's token)

    def respond(self, commit: Commit) -> GenerationResponse:
        """The response for one commit (``PREFILL_CHUNK``: an empty one, the prefill goes on);
        its ``finish_reason`` is set once generation ends, on tokens or on a stop string."""
        prompt = len(self.prompt)
        if commit is PREFILL_CHUNK:
            return GenerationResponse("", [], None, prompt, 0.0, 0, 0.0, 0.0)
        stats = self.row.stats
        if self._commits == 0:
            stats.prefill_s = time.perf_counter() - self._tic
            self._prompt_tps = (prompt - stats.cached_tokens) / stats.prefill_s
            self._tic = time.perf_counter()
        segment, kept, finish = self.text.feed(commit)
        self._tokens += kept
        kept_commit = commit.truncate(kept)
        drafted_as = "suffix" if commit.source == SUFFIX else "draft"
        response = GenerationResponse(
            text=segment,
            tokens=kept_commit.tokens,
            finish_reason=finish,
            prompt_tokens=prompt,
            prompt_tps=self._prompt_tps,
            generation_tokens=self._tokens,
            generation_tps=self._tokens / max(time.perf_counter() - self._tic, 1e-9),
            peak_memory=mx.get_peak_memory() / 1e9,
            stats=stats,
            accepted=None if self._commits == 0 else len(commit.tokens),
            logprobs=kept_commit.logprobs,
            top_logprobs=kept_commit.top_logprobs,
            stop=self.text.hit,
            sources=[
                (piece, drafted_as if j < kept_commit.drafted else "target")
                for j, piece in enumerate(self.text.pieces)
            ],
        )
        self._commits += 1
        return response


def generate(
    pair: ModelPair,
    request: GenerationRequest,
    *,
    prefill_step_size: int = 2048,
    profile: bool = False,
    prefix: PrefixStore | None = None,
    yield_chunks: bool = False,
    kv: KVQuant | None = None,
) -> Iterator[GenerationResponse]:
    """Run one request alone on a loaded pair (its drafter is ignored when not speculative);
    see ``Generation``. ``yield_chunks``: yield an empty response after each prompt chunk but
    the last (a scheduler runs others in between); ``kv``: quantized attention KV."""
    run = Generation(pair, request, prefill_step_size=prefill_step_size, profile=profile,
                     prefix=prefix, kv=kv)  # fmt: skip
    commits = SpeculativeDecoder(run.row).generate(
        run.prompt, request.max_tokens, run.eos_ids, yield_chunks
    )
    try:
        for commit in commits:
            response = run.respond(commit)
            yield response
            if response.finish_reason is not None:
                return
    finally:
        commits.close()  # caches freed now; the output joins the shared suffix index


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
    images: Sequence[Any] = (),
    vision: VisionTower | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = QUANTIZED_KV_START,
) -> Iterator[GenerationResponse]:
    """Generate with DFlash speculative decoding (``draft=None``: plain decoding).

    The output is exactly what the target alone would produce: identical tokens under greedy
    decoding, the same distribution under sampling (docs/design.md, "The acceptance rule"). ``sampler``
    (an mlx-lm sampler, as older reference code passes) replaces temperature/top-p/top-k/min-p.
    ``logprobs=k`` reports each token's log-probability and its k best alternatives (k may be 0);
    ``constraint`` (a grammar matcher, see ``TokenConstraint``) restricts every position.
    ``block_size``: None (as the reference) verifies the drafter's trained block every cycle, a
    number that many positions, ``"auto"`` lets the controller pick 1..trained per cycle.
    ``suffix=n`` (with ``"auto"`` or ``draft=None``) lets it also verify up to n tokens copied
    from the prompt, the output so far and the pair's recent outputs (suffix drafts).
    ``images`` (PIL images, file paths or encoded bytes) need the checkpoint's ``vision``
    (``load_vision``); the prompt holds one ``<|image_pad|>`` per image, as the chat template
    renders an image part. ``kv_bits``, ``kv_group_size`` and ``quantized_kv_start`` quantize
    the target's attention KV as mlx-lm's ``generate_step`` does
    (docs/design.md, "Quantized KV cache").
    """
    kv = KVQuant.of(kv_bits, kv_group_size, quantized_kv_start)
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    sampling = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, logit_bias=logit_bias,
    )  # fmt: skip
    pair = ModelPair.of(model, tokenizer, draft, vision)
    if kv is not None:
        kv.check_model(model)
    ids = encode(tokenizer, prompt)
    inputs: tuple[ImageInput, ...] = ()
    if images:
        if pair.vision is None:
            raise ValueError(
                "images need the checkpoint's vision tower: pass vision=load_vision(path)"
            )
        inputs = tuple(pair.vision.prepare(open_image(image)) for image in images)
        ids = expand_pads(ids, pair.vision.tokens.image, [pair.vision.count(i) for i in inputs])
    request = GenerationRequest(
        prompt=tuple(ids),
        max_tokens=max_tokens,
        sampling=sampling,
        seed=seed,
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        block=replace(block_policy(trained_block(draft), block_size), suffix=suffix),
        logprobs=logprobs,
        constraint=None if constraint is None else Prebuilt(constraint),
        sampler=sampler,
        images=inputs,
    )
    with pair.wired.held():
        yield from generate(
            pair, request, prefill_step_size=prefill_step_size, profile=profile, kv=kv
        )
