"""Batched speculation: every row's output equals the same request run alone."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from dflash_server.generation.batch import BatchDecoder, drive
from dflash_server.generation.sampling import SamplingParams, TokenSampler
from dflash_server.generation.speculative import PREFILL_CHUNK, SpeculativeDecoder
from dflash_server.generation.target import TargetModel
from dflash_server.testing import ReplayDrafter, random_drafter

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "<|im_start|>user\nhi<|im_end|>\n"]


@pytest.fixture(params=["tiny_hybrid", "tiny_attn"])
def target(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    return request.getfixturevalue(request.param)


def plain_greedy(model: Any, ids: list[int], n: int) -> list[int]:
    return [t for t, _ in generate_step(mx.array(ids), model, max_tokens=n)]


class Scripted:
    """A block policy that follows a fixed list of widths (then repeats the last)."""

    adaptive = False

    def __init__(self, widths: list[int]) -> None:
        self.widths, self.i = widths, 0
        self.block_size = max(widths)

    def next_size(self, room: int) -> int:
        w = self.widths[min(self.i, len(self.widths) - 1)]
        self.i += 1
        return max(1, min(w, room))

    def observe(self, size: int, accepted: int, seconds: float | None) -> None:
        pass

    def estimate(self) -> None:
        return None


def make_decoder(model: Any, draft: Any, block: int, **kw: Any) -> SpeculativeDecoder:
    taps = draft.config.target_layer_ids if draft is not None else ()
    sampler = TokenSampler(kw.pop("sampling", SamplingParams()), kw.pop("seed", None))
    return SpeculativeDecoder(TargetModel.of(model, tuple(taps)), draft, sampler, block, **kw)


def tokens_of(commits: Any) -> list[int]:
    return [t for c in commits if c is not PREFILL_CHUNK for t in c.tokens]


def run_batched(model: Any, specs: dict[str, tuple], start: dict[str, int] | None = None):
    """specs: key -> (decoder factory, prompt, max_tokens); returns key -> tokens, and the batch."""
    inner = random_drafter(model)
    batch = BatchDecoder(TargetModel.of(model, tuple(inner.config.target_layer_ids)))
    streams = {k: batch.join(make(), prompt, n) for k, (make, prompt, n) in specs.items()}
    out: dict[str, list[int]] = {k: [] for k in specs}
    for key, commit in drive(batch, streams, start):
        if commit is not PREFILL_CHUNK:
            out[key].extend(commit.tokens)
    return out, batch


def test_rows_joining_and_leaving_equal_lone_runs(target: tuple[Any, Any]) -> None:
    model, tokenizer = target
    inner = random_drafter(model)
    ids = [list(tokenizer.encode(p)) for p in PROMPTS]
    long = list(tokenizer.encode(" ".join(PROMPTS) * 3))
    refs = [plain_greedy(model, p, 60) for p in [*ids, long]]

    def replay(i: int, pattern: list[int]) -> Any:
        prompt = [*ids, long][i]
        return ReplayDrafter(prompt + refs[i], pattern, inner)

    specs = {
        "a": (lambda: make_decoder(model, replay(0, [0, 3, 1, 2]), 4), ids[0], 40),
        "b": (lambda: make_decoder(model, replay(1, [7, 0, 5]), 8), ids[1], 25),
        "plain": (lambda: make_decoder(model, None, 1), ids[2], 30),
        "long": (lambda: make_decoder(model, replay(3, [15, 2]), 16, prefill_step_size=5),
                 long, 50),
        "widths": (lambda: make_decoder(model, replay(0, [3, 0, 2, 1, 5]), 8,
                   policy=Scripted([1, 1, 4, 8, 2, 1, 6, 8, 3])), ids[0], 45),
    }  # fmt: skip
    out, batch = run_batched(model, specs, start={"b": 3, "long": 2, "widths": 6})
    for key, (make, prompt, n) in specs.items():
        assert out[key] == tokens_of(make().generate(prompt, n)), key
    assert out["a"] == refs[0][:40] and out["long"] == refs[3][:50]
    assert batch.rows == [] and max(batch.histogram) >= 4  # rows overlapped
