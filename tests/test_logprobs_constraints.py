"""Log-probabilities and grammar-style constraints under speculation match plain decoding."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step

from dflash_server import stream_generate
from dflash_server.testing import ReplayDrafter, random_drafter

PROMPT = "def fibonacci(n):"
N = 24


def test_logprobs_equal_plain_decoding(tiny_hybrid):
    model, tokenizer = tiny_hybrid
    ids = tokenizer.encode(PROMPT)
    plain = list(generate_step(mx.array(ids), model, max_tokens=N))
    reference = [t for t, _ in plain]
    draft = ReplayDrafter(ids + reference, [0, 5, 15, 2], random_drafter(model))
    out = list(stream_generate(model, draft, tokenizer, ids, 16, max_tokens=N, logprobs=3))
    logprobs = [lp for r in out for lp in r.logprobs]
    tops = [top for r in out for top in r.top_logprobs]
    assert [t for r in out for t in r.tokens] == reference
    for (token, want), got, top in zip(plain, logprobs, tops):
        assert abs(got - want[token].item()) < 1e-4
        best = mx.argsort(-want)[:3].tolist()
        assert [i for i, _ in top] == best  # the drafter's tokens get real target values too
        assert all(abs(v - want[i].item()) < 1e-4 for i, v in top)


class NoMultipleOfThree:
    """Toy grammar: the next token plus the previous one must not be a multiple of 3."""

    def __init__(self, vocab: int, last: int):
        self.vocab, self.last = vocab, last

    def row(self, previous: int) -> mx.array:
        return (mx.arange(self.vocab) + previous) % 3 != 0

    def allowed(self, drafts: Sequence[int]) -> mx.array:
        path = [self.last, *drafts]
        return mx.stack([self.row(p) for p in path])

    def commit(self, tokens: Sequence[int]) -> None:
        self.last = tokens[-1]

    def processor(self) -> Any:
        """The same rule as an mlx-lm logits processor, for plain-decoding references."""

        def apply(history: mx.array, logits: mx.array) -> mx.array:
            return mx.where(self.row(history[-1].item())[None], logits, -mx.inf)

        return apply


def test_constraint_is_lossless_and_enforced(tiny_attn):
    model, tokenizer = tiny_attn
    ids = tokenizer.encode(PROMPT)
    vocab = model.model.embed_tokens.weight.shape[0]
    rule = NoMultipleOfThree(vocab, ids[-1])
    steps = generate_step(mx.array(ids), model, max_tokens=N, logits_processors=[rule.processor()])
    reference = [t for t, _ in steps]
    assert reference != [t for t, _ in generate_step(mx.array(ids), model, max_tokens=N)]
    for draft in (
        random_drafter(model),
        ReplayDrafter(ids + reference, [3, 15, 0], random_drafter(model)),
    ):
        constraint = NoMultipleOfThree(vocab, ids[-1])
        out = stream_generate(model, draft, tokenizer, ids, 16, max_tokens=N, constraint=constraint)
        tokens = [t for r in out for t in r.tokens]
        assert tokens == reference
        assert all((a + b) % 3 for a, b in zip([ids[-1], *tokens], tokens))
