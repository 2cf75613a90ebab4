"""Sampling parameters, the target's processed distribution, and the acceptance rule.

"Processed" means exactly what mlx-lm's ``generate_step`` samples from: logits processors
(penalties, logit bias) with the token history of that position, log-softmax, then top-p, min-p,
top-k filters, then temperature. Speculation must leave that distribution unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from dflash_server.generation.sampling_params import MAX_INT as MAX_INT
from dflash_server.generation.sampling_params import SERVED_FIELDS as SERVED_FIELDS
from dflash_server.generation.sampling_params import SamplingParams


def apply_mask(logits: mx.array, mask: mx.array) -> mx.array:
    """Forbid tokens outside ``mask``; columns past the mask's width (spare embedding rows) too."""
    if mask.shape[-1] < logits.shape[-1]:
        pad = mx.zeros((mask.shape[0], logits.shape[-1] - mask.shape[-1]), dtype=mx.bool_)
        mask = mx.concatenate([mask, pad], axis=-1)
    return mx.where(mask, logits, -mx.inf)


def token_logprobs(
    logits: mx.array, emitted: mx.array, top: int
) -> tuple[mx.array, mx.array | None, mx.array | None]:
    """Log-probabilities of ``emitted[i]`` under row i, plus each row's ``top`` alternatives.

    Like mlx-lm's ``generate_step``: the processed logits log-softmaxed, before top-p/top-k/min-p.
    """
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, emitted[:, None].astype(mx.int32), axis=-1)[:, 0]
    if top <= 0:
        return chosen, None, None
    ids = mx.argpartition(-logprobs, top - 1, axis=-1)[:, :top]
    return chosen, ids, mx.take_along_axis(logprobs, ids, axis=-1)


def point_mass(drafts: mx.array, vocab: int) -> mx.array:
    """``log q`` of drafts without a distribution of their own (suffix copies): all the mass on
    the proposed token, so ``accept`` keeps one with probability p(token) and a rejection
    resamples from p with that token removed, renormalised (docs/design.md, "Suffix drafts")."""
    return mx.where(mx.arange(vocab)[None] == drafts[:, None], 0.0, -mx.inf)


def fresh_entropy() -> int:
    """A seed for an unseeded request's draws, from the OS."""
    return int.from_bytes(os.urandom(4), "little")


class TokenSampler:
    """Turns logits into tokens under ``SamplingParams``; all on device, no host syncs."""

    def __init__(
        self,
        params: SamplingParams,
        seed: int | None = None,
        sampler: Callable[[mx.array], mx.array] | None = None,
        entropy: int | None = None,
    ):
        """``entropy`` seeds an unseeded sampler's draws (None: fresh from the OS), without
        making them a reproducible ``seed``'s."""
        self.params = params
        # A caller-supplied mlx-lm style sampler (logprobs -> tokens) is a black box: speculation
        # then samples target and draft with it and accepts on equal samples, which is exact too.
        self.custom = sampler
        if sampler is not None and seed is not None:
            mx.random.seed(seed)
        self.seeded = seed is not None
        n = params.penalty_context_size
        self.processors = make_logits_processors(
            params.logit_bias,
            params.repetition_penalty,
            n,
            params.presence_penalty,
            n,
            params.frequency_penalty,
            n,
        )
        if seed is None:
            seed = entropy if entropy is not None else fresh_entropy()
        self._key = mx.random.key(seed)

    def _next_key(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub

    @property
    def reproducible(self) -> bool:
        """Whether its draws must come out the same on every run: a seeded sampler (its
        random draws then depend on how many positions each cycle verifies)."""
        return self.seeded and not self.deterministic

    @property
    def deterministic(self) -> bool:
        """Greedy, or a black-box sampler: drafts then carry no proposal law ``q``."""
        return self.params.greedy or self.custom is not None

    def next_key(self) -> mx.array:
        """A fresh PRNG key from this sampler's seeded stream (for drafters that sample)."""
        return self._next_key()

    def process(self, logits: mx.array, history: mx.array | None) -> mx.array:
        """Apply the logits processors to every row with the same ``history`` (None: no
        history to penalise, as when there are no processors)."""
        if history is None:
            return logits
        for processor in self.processors:
            logits = processor(history, logits)
        return logits

    def process_rows(self, logits: mx.array, history: mx.array, drafts: mx.array) -> mx.array:
        """Row i sees ``history + drafts[:i]``, as plain decoding would at that position."""
        if not self.processors:
            return logits
        drafts = drafts.astype(history.dtype)
        rows = [self.process(logits[:1], history)] + [
            self.process(logits[i : i + 1], mx.concatenate([history, drafts[:i]]))
            for i in range(1, logits.shape[0])
        ]
        return mx.concatenate(rows, axis=0)

    def logprobs(self, logits: mx.array) -> mx.array:
        """Log-probabilities of the distribution actually sampled from (filters + temperature)."""
        p = self.params
        x = logits.astype(mx.float32)
        x = x - mx.logsumexp(x, axis=-1, keepdims=True)
        if 0 < p.top_p < 1:
            x = apply_top_p(x, p.top_p)
        elif p.top_p == 0:  # the OpenAI spec allows 0: no mass at all, so the top token alone
            x = apply_top_k(x, 1)
        if p.min_p != 0:
            x = apply_min_p(x, p.min_p)
        if 0 < p.top_k < x.shape[-1]:
            x = apply_top_k(x, p.top_k)
        x = x * (1 / p.temperature)
        return x - mx.logsumexp(x, axis=-1, keepdims=True)

    def sample(self, logits: mx.array) -> mx.array:
        """One token per row of already-processed logits."""
        if self.custom is not None:
            return self.custom(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        if self.params.greedy:
            return mx.argmax(logits, axis=-1)
        return mx.random.categorical(self.logprobs(logits), key=self._next_key())

    def propose(
        self, draft_logits: mx.array, history: mx.array | None
    ) -> tuple[mx.array, mx.array | None]:
        """Draft tokens and, when sampling, the log-probs ``log q`` they were drawn from."""
        logits = self.process(draft_logits, history)
        if self.deterministic:
            return self.sample(logits), None
        log_q = self.logprobs(logits)
        return mx.random.categorical(log_q, key=self._next_key()), log_q

    def accept(
        self,
        target_logits: mx.array,
        drafts: mx.array,
        log_q: mx.array | None,
    ) -> tuple[mx.array, mx.array]:
        """(number of accepted drafts, bonus token) for a verified block, both on device.

        ``target_logits`` [B, V] are processed; row i scores the token after block position i.
        """
        if log_q is None:
            # Greedy (or a black-box sampler): a draft survives while it equals the target's own
            # choice at that position; the bonus is the target's choice after the last survivor.
            target = self.sample(target_logits)
            n = mx.cumprod(drafts == target[:-1]).sum()
            return n, target[n]
        log_p = self.logprobs(target_logits)
        rows = mx.arange(drafts.shape[0])
        p_d, q_d = mx.exp(log_p[rows, drafts]), mx.exp(log_q[rows, drafts])
        # Accept d_i with probability min(1, p(d_i) / q(d_i)), stopping at the first rejection.
        u = mx.random.uniform(shape=drafts.shape, key=self._next_key())
        n = mx.cumprod(u * q_d < p_d).sum()
        # On rejection at i, resample from norm(max(0, p_i - q_i)); after B-1 accepts, from p_B.
        residual = mx.maximum(mx.exp(log_p[:-1]) - mx.exp(log_q), 0)
        mass = residual.sum(axis=-1, keepdims=True)
        residual = mx.where(mass > 0, mx.log(residual), log_p[:-1])
        choices = mx.concatenate([residual, log_p[-1:]], axis=0)
        bonus = mx.random.categorical(choices, key=self._next_key())
        return n, bonus[n]
