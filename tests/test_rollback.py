"""After a block with k accepted drafts, caches equal a fresh target fed prompt + committed."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from dflash_server.adaptive.policy import Choice, FixedBlock
from dflash_server.generation.prefill import prefill
from dflash_server.generation.row import Row
from dflash_server.generation.sampling import SamplingParams, TokenSampler
from dflash_server.generation.speculative import SpeculativeDecoder
from dflash_server.generation.target import TargetModel
from dflash_server.models import hooks as hooks_module
from dflash_server.testing import ReplayDrafter, random_drafter

BLOCK = 8


def cache_arrays(cache) -> list[mx.array]:
    """Comparable content of each layer cache (KV up to its offset, or the recurrent arrays)."""
    out = []
    for c in cache:
        if c.is_trimmable():
            out += [c.keys[..., : c.offset, :], c.values[..., : c.offset, :], mx.array(c.offset)]
        else:
            out += list(c.cache)
    return out


@pytest.mark.parametrize(
    "arch",
    ["tiny_hybrid", "tiny_attn", "tiny_hybrid-replay", "tiny_hybrid-step"],
    ids=["hybrid", "attn", "replay", "step"],
)
@pytest.mark.parametrize("accepted", range(BLOCK))
def test_rollback_equals_fresh_prefill(request, monkeypatch, arch, accepted):
    if arch.endswith("-replay"):  # the Metal-kernel path: record inputs, replay the recurrence
        monkeypatch.setattr(hooks_module, "sequential_ops", lambda: False)
    if arch.endswith("-step"):  # ops path without the compiled recurrence: step the original
        monkeypatch.setattr(hooks_module, "FAST_RECURRENCE", False)
    model, tokenizer = request.getfixturevalue(arch.split("-")[0])
    prompt = tokenizer.encode("def fibonacci(n):")
    reference = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=2 * BLOCK)]
    draft = ReplayDrafter(prompt + reference, [accepted], random_drafter(model))
    target = TargetModel(model, draft.config.target_layer_ids)
    row = Row(target, draft, TokenSampler(SamplingParams()), FixedBlock(BLOCK))
    decoder = SpeculativeDecoder(row)

    row.begin(prompt, 2 * BLOCK)
    row.read(prefill(row))
    commit = decoder._read(decoder._queue(Choice.width(BLOCK), row.last))
    assert commit.tokens == reference[1 : accepted + 2]
    decoder._apply_rollback()  # deferred to the next cycle, after its draft is queued

    fresh = target.make_cache()
    fed = prompt + reference[: accepted + 1]  # the bonus token is not fed yet
    target.forward(mx.array(fed)[None], fresh)
    got, want = cache_arrays(row.cache), cache_arrays(fresh)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        assert mx.allclose(a, b, atol=1e-4, rtol=1e-4).item()
    # The drafter's context now covers exactly the committed positions.
    assert sum(taps.shape[1] for taps, _ in row._context) == accepted + 1


@pytest.mark.parametrize("gates", ["mixed", "closed", "open"])
def test_chunk_form_equals_mlx_lm_steps(gates):
    """The chunk-form recurrence (outputs, and the state after every prefix) against mlx-lm's
    own gated_delta_update stepped token by token, with value heads sharing key heads."""
    from mlx_lm.models.gated_delta import gated_delta_update

    from dflash_server.models.hooks import _step_by_step
    from dflash_server.models.recurrence import state_at, with_states

    mx.random.seed(3)
    B, T, Hk, Hv, D = 1, 16, 2, 4, 32
    q, k = (mx.random.normal((B, T, Hk, D)) / D**0.5 for _ in range(2))
    v = mx.random.normal((B, T, Hv, D))
    shift = {"mixed": 0.0, "closed": 30.0, "open": -30.0}[gates]  # gates near 0 / near 1
    a = mx.random.normal((B, T, Hv)) + shift
    b = mx.random.normal((B, T, Hv))
    A_log, dt_bias = mx.random.normal((Hv,)), mx.random.normal((Hv,))
    state = mx.random.normal((B, Hv, D, D)) * 0.5
    args = (q, k, v, a, b, A_log, dt_bias, state)
    y, states = with_states(args, {"use_kernel": False})
    y_ref, states_ref = _step_by_step(gated_delta_update, args, {"use_kernel": False})
    assert mx.allclose(y, y_ref, atol=1e-5, rtol=1e-4).item()
    for n in range(1, T + 1):
        assert mx.allclose(state_at(states, n), states_ref[n - 1], atol=1e-5, rtol=1e-4).item()
