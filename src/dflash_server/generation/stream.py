"""``stream_generate``: the public generation API, text in and text segments out."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream, wired_limit
from mlx_lm.tokenizer_utils import TokenizerWrapper

from dflash_server.generation.sampling import SamplingParams, TokenConstraint, TokenSampler
from dflash_server.generation.speculative import SpeculativeDecoder, SpeculativeStats
from dflash_server.generation.target import TargetModel
from dflash_server.models.drafter import DFlashDraftModel


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
    stats: SpeculativeStats = field(repr=False, default=None)  # type: ignore[assignment]
    accepted: int | None = None  # tokens this cycle committed (None for the prefill's token)
    logprobs: list[float] | None = None  # per token in ``tokens``, when asked for
    top_logprobs: list[list[tuple[int, float]]] | None = (
        None  # per token: (id, logprob), best first
    )

    @property
    def token(self) -> int | None:
        return self.tokens[-1] if self.tokens else None


def _encode(tokenizer: TokenizerWrapper, prompt: str | Sequence[int] | mx.array) -> list[int]:
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        return tokenizer.encode(
            prompt, add_special_tokens=bos is None or not prompt.startswith(bos)
        )
    ids = prompt.tolist() if isinstance(prompt, mx.array) else list(prompt)
    return [int(t) for t in ids]


class _StopMatcher:
    """Holds back text that could still become a stop string; never emits past one."""

    def __init__(self, stop: Sequence[str]):
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string was hit)."""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        cut = max(0, len(self.pending) - self.hold)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def stream_generate(
    model: nn.Module,
    draft: DFlashDraftModel | None,
    tokenizer: TokenizerWrapper,
    prompt: str | Sequence[int] | mx.array,
    block_size: int | None = None,
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
    """
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    params = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, logit_bias=logit_bias,
    )  # fmt: skip
    prompt_ids = _encode(tokenizer, prompt)
    if not prompt_ids:
        raise ValueError("prompt is empty: give at least one token")
    if draft is not None:
        trained = draft.config.block_size
        block_size = trained if block_size is None else int(block_size)
        if not 2 <= block_size <= trained:
            raise ValueError(
                f"block_size must be in [2, {trained}] for this drafter, got {block_size}"
            )
        draft.bind(model)
        target = TargetModel.of(model, draft.config.target_layer_ids)
    else:
        target = TargetModel.of(model, ())
    decoder = SpeculativeDecoder(
        target,
        draft,
        TokenSampler(params, seed, sampler),
        block_size or 1,
        prefill_step_size,
        profile,
        logprobs,
        constraint,
    )
    stops = _StopMatcher([stop] if isinstance(stop, str) else list(stop or []))

    with _shared_wired_limit(model):
        yield from _responses(decoder, tokenizer, prompt_ids, max_tokens, stops)


_wired = {"users": 0, "context": None}
_wired_lock = threading.Lock()


@contextlib.contextmanager
def _shared_wired_limit(model: nn.Module) -> Iterator[None]:
    """mlx-lm's ``wired_limit`` (Metal: keep weights resident; no-op on CPU), entered by the first
    of several interleaved generations and left by the last, so they never restore it out of order.
    """
    with _wired_lock:
        if _wired["users"] == 0:
            _wired["context"] = wired_limit(model, [generation_stream])
            _wired["context"].__enter__()
        _wired["users"] += 1
    try:
        yield
    finally:
        with _wired_lock:
            _wired["users"] -= 1
            if _wired["users"] == 0:
                _wired["context"].__exit__(None, None, None)


def _responses(
    decoder: SpeculativeDecoder,
    tokenizer: TokenizerWrapper,
    prompt_ids: list[int],
    max_tokens: int,
    stops: _StopMatcher,
) -> Iterator[GenerationResponse]:
    eos_ids = set(tokenizer.eos_token_ids)
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    tic = time.perf_counter()
    prompt_tps, n = 0.0, 0
    for i, commit in enumerate(decoder.generate(prompt_ids, max_tokens, eos_ids)):
        if i == 0:
            prompt_tps = len(prompt_ids) / (time.perf_counter() - tic)
            tic = time.perf_counter()
        finish, tokens, text, hit = None, [], "", False
        for token in commit.tokens:
            if token in eos_ids:
                finish = "stop"
                break
            tokens.append(token)
            detokenizer.add_token(token)
            segment, hit = stops.feed(detokenizer.last_segment)
            text += segment
            if hit:
                finish = "stop"
                break
        n += len(tokens)
        commit = commit.truncate(len(tokens))
        if finish is None and n >= max_tokens:
            finish = "length"
        if finish is not None and not hit:  # flush held-back bytes and text
            detokenizer.finalize()
            tail, hit = stops.feed(detokenizer.last_segment)
            text += tail if hit else tail + stops.flush()
            finish = "stop" if hit else finish
        elapsed = max(time.perf_counter() - tic, 1e-9)
        yield GenerationResponse(
            text=text,
            tokens=tokens,
            finish_reason=finish,
            prompt_tokens=len(prompt_ids),
            prompt_tps=prompt_tps,
            generation_tokens=n,
            generation_tps=n / elapsed,
            peak_memory=mx.get_peak_memory() / 1e9,
            stats=decoder.stats,
            accepted=None if i == 0 else len(commit.tokens),
            logprobs=commit.logprobs,
            top_logprobs=commit.top_logprobs,
        )
        if finish is not None:
            return
