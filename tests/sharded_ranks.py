"""Run by ``mlx.launch -n 2`` from test_distributed.py: one rank each, the target sharded over both.

Every rank computes the oracle (mlx-lm's own sharded model and ``generate_step``, greedy), then
loads the pair as the server does and runs the engine: rank 0 an ``Engine`` with its ``Leader``
(requests submitted here, not over HTTP), rank 1 a ``Follower``. The drafter is a
``ReplayDrafter`` over the oracle's tokens, so every acceptance length happens. Rank 0 writes
what each case produced (each token as its bytes) and the oracle's to ``OUT`` (JSON); rank 1
writes how its follower ended. Usage: ``sharded_ranks.py OUT TARGET DRAFT``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.utils import sharded_load

from dflash_server.chat.logprobs import TokenTexts
from dflash_server.engine.distributed import Channel, world
from dflash_server.engine.jobs import Failed, Finished, Job, TextChunk
from dflash_server.engine.loader import LoadedModels, load_models
from dflash_server.engine.lockstep import Follower, Leader
from dflash_server.engine.prefix_cache import PrefixCache
from dflash_server.engine.worker import Engine, make_batch
from dflash_server.generation.pair import ModelPair
from dflash_server.generation.request import BlockPolicy, GenerationRequest
from dflash_server.generation.sampling import SamplingParams
from dflash_server.generation.target import TargetModel
from dflash_server.testing import ReplayDrafter
from test_sampling import exact_law  # the script's folder is first on sys.path

PATTERN = [0, 1, 2, 3, 4, 5, 6, 7]  # drafts right per cycle: every acceptance length, full too
N = 40  # tokens per greedy case
STARTS = (0, 3, 7)  # the batched case's prompts: the prompt and 3 or 7 of its greedy tokens
LAW = SamplingParams(temperature=1.5, top_k=2, repetition_penalty=1.2)
LAW_RUNS = 192


def oracle(model: Any, prompt: list[int], n: int) -> list[int]:
    tokens = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]
    # generate_step leaves one more step in flight; its collectives must finish before any
    # other stream issues its own, or the ranks would pair them differently.
    mx.synchronize(generation_stream)
    return tokens


def taps(sharded: Any, target: str, group: Any, prompt: list[int], ids: tuple) -> dict:
    """The tapped layers' outputs on the sharded model: the same on every rank (each layer
    ends in a sharded-to-all sum, so the drafter needs no gather) and the whole model's to
    float tolerance."""
    tokens = mx.array(prompt)[None]
    mine = TargetModel(sharded, ids).forward(tokens, None)[1]
    both = mx.distributed.all_gather(mine.reshape(1, -1), group=group, stream=generation_stream)
    single = TargetModel(mlx_lm.load(target)[0], ids).forward(tokens, None)[1]
    assert mine is not None and single is not None
    return {
        "ranks_equal": mx.array_equal(both[0], both[1]).item(),
        "vs_single": mx.abs(mine - single).max().item(),
    }


def load(group: Any, target: str, draft: str, reference: list[int]) -> LoadedModels:
    """The pair as the server loads it (sharded, costs measured together, or read from the
    session's calibration cache when every rank has them), its drafter then swapped for a
    replay of ``reference``."""
    folder = os.environ.get("DFLASH_CALIBRATION_CACHE")
    models = load_models(target, draft, group=group, suffix_tokens=32, calibration_cache=folder)
    real = models.pair
    replay = ReplayDrafter(reference, PATTERN, real.draft)  # type: ignore[arg-type]
    pair = ModelPair.build(
        real.model, real.tokenizer, replay, measured=real.costs.measured, lockstep=True
    )
    return LoadedModels(pair, models.summary, models.calibration)


async def run(engine: Engine, request: GenerationRequest, cancel_after: int = 0) -> dict:
    """Submit one request; its tokens (as bytes), its end and how much of it was cached."""
    job = Job(request)
    engine.submit(job)
    tokens: list[list[int]] = []
    while True:
        for event in await job.next_events() or []:
            if isinstance(event, TextChunk):
                tokens += [lp.bytes for lp in event.logprobs or []]
                if cancel_after and len(tokens) >= cancel_after:
                    job.cancel()
            elif isinstance(event, Finished):
                return {"tokens": tokens, "cached": event.cached_tokens, "end": "finished"}
            elif isinstance(event, Failed):
                return {"tokens": tokens, "end": event.message}


async def cases(engine: Engine, prompt: list[int], path: list[int]) -> dict[str, Any]:
    """Every case on the running engine; ``path``: the oracle's greedy tokens after ``prompt``."""
    greedy = SamplingParams()
    fixed, auto = BlockPolicy(8), BlockPolicy(8, auto=True, suffix=16)

    def request(p: list[int], block: BlockPolicy, **kw: Any) -> GenerationRequest:
        return GenerationRequest(tuple(p), kw.pop("max_tokens", N), greedy, block=block,
                                 logprobs=0, **kw)  # fmt: skip

    out: dict[str, Any] = {}
    out["lone"] = await run(engine, request(prompt, fixed))
    out["hit"] = await run(engine, request(prompt, fixed))  # the same prompt: a prefix hit
    out["cancelled"] = await run(engine, request(prompt, fixed, max_tokens=200), cancel_after=5)
    # Prompts along the same greedy path, batched, their widths and copies chosen by rank 0.
    batched = [run(engine, request(prompt + path[:k], auto)) for k in STARTS]
    for k, result in zip(STARTS, await asyncio.gather(*batched)):
        out[f"batched+{k}"] = result
    sampled = [
        run(engine, GenerationRequest(tuple(prompt), 3, LAW, block=BlockPolicy(4), logprobs=0))
        for _ in range(LAW_RUNS)
    ]
    counts = Counter(json.dumps(result["tokens"]) for result in await asyncio.gather(*sampled))
    out["law"] = dict(counts)
    return out


def main(out: str, target: str, draft: str) -> None:
    group = world()
    assert group is not None and group.size() == 2, "run me with mlx.launch -n 2"
    sharded, tokenizer = sharded_load(target, tensor_group=group)
    prompt = list(tokenizer.encode("The quick brown fox jumps over"))
    path = oracle(sharded, prompt, N + 8)
    # A prompt along the greedy path continues it: batched+k's oracle is path[k:].
    want = {name: path[:N] for name in ("lone", "hit", "cancelled")}
    want |= {f"batched+{k}": path[k : k + N] for k in STARTS}
    law = exact_law(sharded, prompt, LAW)
    models = load(group, target, draft, prompt + path)
    tapped = taps(sharded, target, group, prompt, models.pair.target.tap_ids)
    cache = PrefixCache(64 * 2**20)
    if group.rank() > 0:
        follower = Follower(models.pair, make_batch(models, None), Channel(group), timeout_s=60,
                            on_hang=print, prefill_step_size=512, prefix_cache=cache)  # fmt: skip
        follower.run()
        Path(f"{out}.rank{group.rank()}").write_text("followed to the end")
        return
    leader = Leader(Channel(group), 60, lambda why: engine.abort(why))
    engine = Engine(
        lambda: models, max_active=16, max_queue=LAW_RUNS, lockstep=leader, prefix_cache=cache
    )
    engine.start()
    assert engine.wait_ready(300), engine.error
    got = asyncio.run(cases(engine, prompt, path))
    engine.stop()
    texts = TokenTexts(models.pair.tokenizer)
    result = {
        "prompt": prompt,
        "strings": [texts(t)[0] for t in path[:N]],  # as /v1/completions names them
        "got": got,
        "want": {k: [texts(t)[1] for t in v] for k, v in want.items()},
        "law": {json.dumps([texts(t)[1] for t in k]): p for k, p in law.items()},
        "taps": tapped,
        "rounds": leader.channel.rounds,
        "message_bytes": leader.channel.bytes,
    }
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:4])
