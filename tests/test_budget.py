"""Thinking budget: the constraint's rows along a drafted path, and exactness under speculation."""

from __future__ import annotations

import json
from typing import Any

import mlx.core as mx
import pytest

from dflash_server.chat.budget import Both, Budgeted, ThinkingBudget
from dflash_server.chat.structured import Grammar, response_format_grammar
from dflash_server.generation.pair import ModelPair
from dflash_server.generation.request import BlockPolicy, GenerationRequest
from dflash_server.generation.sampling import SamplingParams
from dflash_server.generation.stream import generate
from dflash_server.testing import ReplayDrafter, random_drafter

END = 5  # the think-end id in the unit tests


def _rows(mask: mx.array | None, n: int = 1, width: int = 8) -> list[list[int]]:
    """Each row's allowed ids (None, no restriction: each of the ``n`` rows allows all)."""
    if mask is None:
        return [list(range(width))] * n
    return [[i for i, ok in enumerate(row) if ok] for row in mask.tolist()]


def test_rows_along_a_drafted_path() -> None:
    budget = ThinkingBudget(3, END, width=8)
    assert _rows(budget.allowed([1, 2]), 3) == [list(range(8))] * 3  # 0, 1, 2 tokens used
    assert _rows(budget.allowed([1, 2, 3, 4])) == [list(range(8))] * 3 + [[END]] * 2
    budget.commit([1, 2])
    # Row 1 (2 + 1 = 3 used) may only close; a draft that does frees the rows after it.
    assert _rows(budget.allowed([1, END, 4])) == [list(range(8)), [END], *[list(range(8))] * 2]
    budget.commit([1, END, 7])
    assert budget.used == 3 and not budget.open
    assert _rows(budget.allowed([1, 2, 3]), 4) == [list(range(8))] * 4  # reasoning is over


def test_zero_budget_closes_at_once_and_both_and_masks() -> None:
    zero = ThinkingBudget(0, END, width=8)
    assert _rows(zero.allowed([])) == [[END]]

    class Even:
        def allowed(self, drafts: Any) -> mx.array:  # a narrower mask: ids 6, 7 forbidden
            return mx.array([[i % 2 == 0 for i in range(6)]] * (len(drafts) + 1))

        def commit(self, tokens: Any) -> None:
            pass

    both = Both(ThinkingBudget(1, 4, width=8), Even())
    assert _rows(both.allowed([2])) == [[0, 2, 4], [4]]
    with pytest.raises(ValueError, match="budget"):
        ThinkingBudget(-1, END, 8)


@pytest.fixture(scope="module")
def chat(tiny_hybrid: tuple[Any, Any]) -> tuple[Any, Any, list[int], int]:
    model, tokenizer = tiny_hybrid
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Is it sunny?"}],
        add_generation_prompt=True,
        tokenize=False,
        enable_thinking=True,
    )
    assert text.endswith("<think>\n")
    return model, tokenizer, tokenizer.encode(text), tokenizer.think_end_id


def _run(chat: Any, draft: Any, block: int, constraint: Any, n: int = 48) -> list[int]:
    model, tokenizer, prompt, _ = chat
    request = GenerationRequest(tuple(prompt), n, block=BlockPolicy(block), constraint=constraint)
    pair = ModelPair.of(model, tokenizer, draft)
    return [t for r in generate(pair, request) for t in r.tokens]


@pytest.mark.parametrize("with_grammar", [False, True])
def test_speculation_is_exact_under_a_budget(chat: Any, with_grammar: bool) -> None:
    """The random model never closes its reasoning: the budget does, at exactly its count;
    drafting (every acceptance length, the forced token drafted too) changes no token."""
    model, tokenizer, prompt, end = chat
    fmt = {"type": "json_schema", "json_schema": {"schema": {"enum": ["yes", "no"]}}}
    inner = Grammar(response_format_grammar(fmt), end) if with_grammar else None
    rows = model.language_model.model.embed_tokens.weight.shape[0]  # spare ids included
    spec = Budgeted(10, end, rows, inner)
    plain = _run(chat, None, 1, spec)
    assert plain.index(end) == 10
    if with_grammar:
        assert json.loads(tokenizer.decode(plain[11:])) in ("yes", "no")
    draft = ReplayDrafter(prompt + plain + [0] * 32, [15, 3, 0, 7], random_drafter(model))
    assert _run(chat, draft, 16, spec) == plain
    assert _run(chat, random_drafter(model), 8, spec) == plain


def test_no_end_token_while_reasoning_under_a_grammar(chat: Any) -> None:
    """Rows before the think-end token allow every token but the end tokens; after it, the
    grammar's rows (here: a JSON enum)."""
    _, tokenizer, _, end = chat
    fmt = {"type": "json_schema", "json_schema": {"schema": {"enum": ["yes", "no"]}}}
    grammar = Grammar(response_format_grammar(fmt), end).build(tokenizer)
    eos = sorted(tokenizer.eos_token_ids)
    width = grammar.width
    free = [i for i in range(width) if i not in eos]
    assert _rows(grammar.allowed([7, 8]), width=width) == [free] * 3
    rows = _rows(grammar.allowed([7, end, 9]), width=width)
    assert rows[:2] == [free] * 2  # up to (and predicting) the think-end token: reasoning
    assert rows[2] and not set(rows[2]) & set(eos)  # the JSON must start: no end yet
    grammar.commit([7, end])
    assert _rows(grammar.allowed([]), width=width) == [rows[2]]


def test_end_biased_model_still_answers_exactly(chat: Any) -> None:
    """A model that wants to end at once (the end token biased far up) must still close its
    reasoning (the budget) and write the JSON; drafted end tokens are refused on the path,
    so speculation gives the plain decoding's tokens."""
    model, tokenizer, prompt, end = chat
    (eos,) = tokenizer.eos_token_ids
    fmt = {"type": "json_schema", "json_schema": {"schema": {"enum": ["yes", "no"]}}}
    rows = model.language_model.model.embed_tokens.weight.shape[0]
    spec = Budgeted(6, end, rows, Grammar(response_format_grammar(fmt), end))
    sampling = SamplingParams(logit_bias={eos: 50.0})

    def run(draft: Any, block: int) -> list[int]:
        policy = BlockPolicy(block)
        request = GenerationRequest(tuple(prompt), 48, sampling, block=policy, constraint=spec)
        out = list(generate(ModelPair.of(model, tokenizer, draft), request))
        assert out[-1].finish_reason == "stop"
        return [t for r in out for t in r.tokens]

    unconstrained = GenerationRequest(tuple(prompt), 48, sampling)
    first = list(generate(ModelPair.of(model, tokenizer, None), unconstrained))
    assert first[-1].finish_reason == "stop" and first[-1].generation_tokens == 0  # ends at once
    plain = run(None, 1)
    assert plain.index(end) == 6 and eos not in plain
    assert json.loads(tokenizer.decode(plain[7:])) in ("yes", "no")
    # The replayed drafts put the end token on reasoning positions: each is refused.
    planted = [eos if i % 3 == 1 and i < 6 else t for i, t in enumerate(plain)]
    draft = ReplayDrafter(prompt + planted + [0] * 32, [15, 3, 7], random_drafter(model))
    assert run(draft, 16) == plain
    assert run(random_drafter(model), 8) == plain
