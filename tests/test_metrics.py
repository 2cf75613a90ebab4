"""GET /metrics: Prometheus text with request, token, latency and speculation metrics."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from server_fixtures import ScriptedGenerate, make_app, run_server

# A fixed block: "auto" drafts or not by the costs measured at load (timings), and the drafter
# metrics below must have cycles to count.
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10, "block_size": 8}


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_after_real_requests(tiny_hybrid_path: Path, draft_path: Path) -> None:
    app = make_app(tiny_hybrid_path, draft_path, served_model_name="tiny", api_key="k")
    key = {"Authorization": "Bearer k"}
    with run_server(app) as srv:
        url = srv.base_url
        assert httpx.get(f"{url}/metrics").status_code == 401  # behind the key by default
        produced = []  # completion tokens of each chat request
        usage = {"stream": True, "stream_options": {"include_usage": True}}
        for body in (CHAT, {**CHAT, **usage}):
            r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=key)
            assert r.is_success
            last = r.text.split("data: ")[-2] if body.get("stream") else r.text  # before [DONE]
            produced.append(json.loads(last)["usage"]["completion_tokens"])
        msg = {"model": "tiny", "max_tokens": 4, "messages": CHAT["messages"], "block_size": 8}
        r = httpx.post(f"{url}/v1/messages", json=msg, headers={"x-api-key": "k"})
        assert r.is_success
        answered = r.json()["usage"]["output_tokens"]
        httpx.post(f"{url}/v1/chat/completions", json={"messages": []}, headers=key)
        r = httpx.get(f"{url}/metrics", headers=key)
        cache = getattr(srv.engine, "prefix_cache", None)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = _samples(r.text)
    chat = (("endpoint", "/v1/chat/completions"),)
    assert m[("dflash_requests_total", (*chat, ("status", "200")))] == 2
    assert m[("dflash_requests_total", (*chat, ("status", "400")))] == 1
    assert m[("dflash_requests_total", (("endpoint", "/metrics"), ("status", "401")))] == 1
    assert m[("dflash_requests_total", (("endpoint", "/v1/messages"), ("status", "200")))] == 1
    assert m[("dflash_generated_tokens_total", (("endpoint", "chat"),))] > 0
    assert m[("dflash_generated_tokens_total", (("endpoint", "messages"),))] <= 4
    assert m[("dflash_time_to_first_token_seconds_count", (("endpoint", "chat"),))] == 2
    # Time per output token needs a second token. A cycle runs after any first token that is
    # not an EOS id (max_tokens leaves room), even one whose only token is the EOS (dropped:
    # one token produced); a prefill's EOS produces none and runs no cycle, so no tau.
    per_token = sum(n > 1 for n in produced)
    tpot = ("dflash_time_per_output_token_seconds_count", (("endpoint", "chat"),))
    assert m.get(tpot, 0) == per_token  # (a label never observed has no sample)
    cycled = sum(n >= 1 for n in [*produced, answered])
    assert m[("dflash_tau_count", ())] == cycled
    assert m[("dflash_accepted_drafts_count", ())] > 0
    assert m[("dflash_block_size_sum", ())] == 3 * 8
    assert m[("dflash_queue_depth", ())] == 0 and m[("dflash_active_requests", ())] == 0
    sources = ("drafter", "suffix", "plain")
    cycles = [m[("dflash_cycles_total", (("source", s),))] for s in sources]
    committed = [m[("dflash_committed_tokens_total", (("source", s),))] for s in sources]
    assert cycles[0] > 0 and all(t >= c for t, c in zip(committed, cycles))
    # Batched passes: one row each here (the requests ran one after another), 8 wide at most.
    passes = m[("dflash_batch_rows_count", ())]
    assert passes > 0 and m[("dflash_batch_rows_sum", ())] == passes
    assert passes <= m[("dflash_batch_verify_tokens_sum", ())] <= 8 * passes
    assert m[("dflash_active_rows", ())] == 0
    # What is served, as /health says it: the target, its drafter and the drafter's family.
    info = {"model": "tiny", "target": str(tiny_hybrid_path), "draft": str(draft_path)}
    assert m[("dflash_model_info", tuple(sorted({**info, "draft_family": "DFlash"}.items())))] == 1
    if cache is not None:  # the prefix cache's own counters
        assert m[("dflash_prefix_cache_hits_total", ())] == cache.stats()["hits"]
    assert not any(name.endswith("_created") for name, _ in m)


def test_memory_gauges_name_what_holds_the_memory(
    tiny_hybrid_path: Path, draft_path: Path, tmp_path: Path
) -> None:
    """RSS, MLX's allocator and each cache's own bytes, as the caches report them."""
    import mlx.core as mx

    app = make_app(tiny_hybrid_path, draft_path, prefix_cache_dir=str(tmp_path))
    with run_server(app) as srv:
        body = {"messages": [{"role": "user", "content": "one two three " * 20}], "max_tokens": 10}
        assert httpx.post(f"{srv.base_url}/v1/chat/completions", json=body).is_success
        m = _samples(httpx.get(f"{srv.base_url}/metrics").text)
        cache, index = srv.engine.prefix_cache, srv.engine.models.pair.suffix_index
        assert m[("dflash_prefix_cache_bytes", ())] == cache.stats()["bytes"] > 0
        assert m[("dflash_suffix_index_bytes", ())] == index.bytes > 0
    assert m[("dflash_suffix_index_budget_bytes", ())] == index.budget
    assert m[("dflash_prefix_cache_disk_bytes", ())] == 0  # nothing evicted to disk yet
    assert m[("dflash_prefix_cache_disk_writable", ())] == 1
    rss = m[("dflash_process_resident_bytes", ())]
    assert rss > 50 * 2**20  # Python, MLX and the models at least
    mlx = {kind: m[("dflash_mlx_memory_bytes", (("kind", kind),))] for kind in ("active", "peak")}
    assert 0 < mlx["active"] <= mlx["peak"] <= mx.get_peak_memory()
    assert ("dflash_mlx_memory_bytes", (("kind", "cache"),)) in m


def test_metrics_open_or_off(tiny_hybrid_path: Path, draft_path: Path) -> None:
    gen = ScriptedGenerate(["a", "b"])
    app = make_app(tiny_hybrid_path, draft_path, generate=gen, api_key="k", metrics_auth=False)
    with run_server(app) as srv:
        r = httpx.get(f"{srv.base_url}/metrics")
        assert r.status_code == 200 and "dflash_requests_total" in r.text
    off = make_app(tiny_hybrid_path, draft_path, generate=gen, metrics=False)
    with run_server(off) as srv:
        assert httpx.get(f"{srv.base_url}/metrics").status_code == 404
        assert "x-request-id" in httpx.get(f"{srv.base_url}/health").headers
