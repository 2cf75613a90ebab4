"""A prompt into a row's caches: alone, in chunks (``prefill_steps``, or ``prefill`` at once), or
several short ones in one forward (``prefill_together``, the batched engine's short prompts).

Alone, a prompt is fed after what the prefix cache restores, in chunks cut at absolute multiples
of the step and at the checkpoints, where the recurrent state is kept; a prefill stopped between
chunks (a cancelled request: a client that timed out and will retry) keeps what it prefilled as
an entry, so the retry resumes there (docs/design.md, "Prefix cache internals").

Together, each prompt is a row of a fresh ``BatchCache``, right-padded to the longest, so a
row's columns are its prompt's positions: attention never sees the padding (it comes after every
real token, and causal masking hides later columns), and each Gated DeltaNet row stops at its own
length (mlx-lm's ``ArraysCache.prepare(lengths=...)``: a masked step keeps the state, and the
conv window is taken at the row's end). With a prefix cache the forward is cut at every row's
checkpoints, as a lone prefill cuts its chunks. Each request then gets its own caches back and
goes on exactly as after a lone prefill (docs/design.md, "Batching under speculation").
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import ArraysCache, KVCache

from dflash_server.drafters.prompt import feed_prompt, prompt_reads
from dflash_server.generation.batch_cache import BatchCache
from dflash_server.generation.cycle import PREFILL_CHUNK, Commit, Cycle
from dflash_server.generation.prefix import Checkpoint
from dflash_server.generation.row import Row
from dflash_server.generation.target import TargetModel


def prefill(row: Row) -> Cycle:
    """Feed ``row``'s whole prompt (see ``prefill_steps``); return the first token's cycle."""
    steps = prefill_steps(row)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def prefill_steps(row: Row) -> Generator[Commit, None, Cycle]:
    """Feed ``row``'s prompt into its own cache (after what the prefix cache restores), yielding
    ``PREFILL_CHUNK`` after each chunk but the last so a scheduler can run other work in
    between; return the first token as a (lazy) one-row cycle."""
    prompt = row.prompt
    start, checkpoints = row.restore_prefix()
    tokens = mx.array(prompt)[None]
    wanted = row.checkpoint_positions()
    reads = prompt_reads(row.draft, len(prompt), wanted) if row.draft is not None else None
    logits: mx.array | None = None
    for begin, end in prefill_chunks(start, len(prompt), row.prefill_step_size, wanted):
        last = end == len(prompt)
        rows = slice(-1, None) if last else None  # the logits of the last position only
        with mx.stream(generation_stream):
            chunk = tokens[:, begin:end]
            inputs = row.images.inputs(chunk, begin, end, row.target) if row.images else {}
            logits, taps = row.target.forward(chunk, row.cache, rows, **inputs)
            row.quantize_kv()
            if row.draft is not None:
                assert taps is not None and row.draft_cache is not None, "a drafter row taps"
                feed_prompt(row.draft, row.draft_cache, taps, tokens[0], (begin, end), reads)
            if end in wanted:
                checkpoints[end] = Checkpoint.take(row.cache, row.draft_cache)
            if not last:  # bound peak memory: materialise this chunk before the next
                mx.eval([c.state for c in row.cache], *row.draft_state())
                mx.clear_cache()
        if not last:
            try:
                yield PREFILL_CHUNK
            except GeneratorExit:
                row.keep_prefilled(end, checkpoints)
                raise
    assert logits is not None, "the last chunk asks for its logits"
    row.images = None  # the features are in the cache now
    return row.first_token(logits[0], checkpoints)


def prefill_chunks(start: int, end: int, step: int, cuts: set[int]) -> list[tuple[int, int]]:
    """Prefill chunks from ``start`` to ``end``: at most ``step`` long, cut at absolute multiples
    of it and at ``cuts`` (checkpoints), so a warm run computes exactly the chunks a cold run did
    after the restored prefix."""
    step = max(1, step)
    ends = set(range(step, end, step)) | {end} | cuts
    # As mlx-lm, the last token on its own: a chunk without logits skips the top layer's
    # output (no cache reads it); with the logits, every row of the chunk would run it.
    if end > 1:
        ends.add(end - 1)
    kept = sorted(c for c in ends if start < c <= end)
    return list(zip([start, *kept[:-1]], kept))


def prefill_together(target: TargetModel, rows: list[Row]) -> list[Cycle]:
    """Prefill the rows' cold prompts (no prefix-cache hit) as rows of one forward per
    segment; return each request's first-token cycle, its caches and drafter context filled
    in."""
    prompts = [row.prompt for row in rows]
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    cache = BatchCache.empty([type(c) for c in rows[0].cache], len(prompts))
    tokens = mx.array([p + [0] * (width - len(p)) for p in prompts], dtype=mx.int32)
    wanted = [row.checkpoint_positions() for row in rows]
    cuts = sorted(set().union(*wanted) | {width})
    checkpoints: list[dict[int, Checkpoint]] = [{} for _ in rows]
    last: list[Any] = [None] * len(prompts)  # each row's final hidden state [1, H]
    start = 0
    with mx.stream(generation_stream):
        for end in cuts:
            keep = [min(max(n - start, 0), end - start) for n in lengths]
            for c in cache.linear:
                c.prepare(lengths=keep)
            cache.layout.reserve(end - start)
            hidden = target.parts.backbone(tokens[:, start:end], cache.layers)
            taps = target.hooks.take_taps(target.tap_ids)
            cache.layout.commit(keep, end - start)
            for c in cache.linear:
                c.finalize()
            for i, row in enumerate(rows):
                if keep[i] == 0:
                    continue
                if row.draft is not None and taps is not None and row.draft_cache is not None:
                    fed = tokens[i, start : start + keep[i]]
                    row.draft.append_context(taps[i : i + 1, : keep[i]], row.draft_cache, fed)
                if start < lengths[i] <= end:
                    last[i] = hidden[i : i + 1, lengths[i] - 1 - start]
                if end in wanted[i]:
                    checkpoints[i][end] = Checkpoint.take(_row(cache, i), row.draft_cache)
            if end < width:  # bound peak memory, as a lone prefill does between chunks
                mx.eval(cache.state(), *[row.draft_state() for row in rows])
                mx.clear_cache()
            start = end
        logits = target.parts.lm_head(mx.concatenate(last))  # [rows, V]
    cycles = []
    for i, row in enumerate(rows):
        _fill(row.cache, cache, i, lengths[i])
        cycles.append(row.first_token(logits[i : i + 1], checkpoints[i]))
    return cycles


def _row(cache: BatchCache, i: int) -> list[ArraysCache]:
    """Row ``i``'s recurrent layers as one request's caches (what ``Checkpoint.take`` reads)."""
    views = []
    for c in cache.linear:
        view = ArraysCache(len(c.cache))
        view.cache = [None if x is None else x[i : i + 1] for x in c.cache]
        views.append(view)
    return views


def _fill(own: list[Any], cache: BatchCache, i: int, length: int) -> None:
    """Load row ``i`` (``length`` tokens, at columns 0..length) into a request's fresh caches
    (views: joining the batch copies them once, and a snapshot takes its own copy)."""
    for mine, batched in zip(own, cache.layers):
        if isinstance(mine, KVCache):
            mine.keys = batched.keys[i : i + 1, :, :length]
            mine.values = batched.values[i : i + 1, :, :length]
            mine.offset = length
        else:
            mine.cache = [None if x is None else x[i : i + 1] for x in batched.cache]
