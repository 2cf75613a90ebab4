"""Several models on one server (``--models``), over HTTP with the tiny fixture models: routing
by id and alias, 404s naming the ids, loading while a request waits (a stream sends keepalives
meanwhile), one load for many first requests, a failed load answered clearly while the others
keep serving, eviction under a small budget, the operators' load/unload behind the API key,
/v1/models' state and kind, metrics by model; every answer the one a one-model server gives."""

from __future__ import annotations

import concurrent.futures
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dflash_server.testing import build_target
from server_fixtures import make_app, run_server

PROMPT = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 12, "temperature": 0}


def multi_app(folder: Path, toml: str, **settings: Any) -> Any:
    """The app ``dflash-serve --models`` serves for this models file."""
    from dflash_server.api.app import create_app
    from dflash_server.api.metrics import Metrics
    from dflash_server.models_file import read_models_file
    from dflash_server.serve.models import build_models
    from dflash_server.settings import Settings

    path = folder / "models.toml"
    path.write_text(toml)
    s = Settings.load(models=str(path), **settings)
    metrics = Metrics()
    return create_app(s, build_models(s, read_models_file(path, s), metrics=metrics), metrics)


@pytest.fixture(scope="module")
def folders(
    tiny_hybrid_path: Path, tiny_attn_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("several")
    out = {"a": tiny_hybrid_path, "b": tiny_attn_path}
    for name in ("c", "slow"):  # copies: models of their own, loaded by one test each
        out[name] = Path(shutil.copytree(tiny_attn_path, root / name))
    out["emb"] = build_target(root / "emb", arch="qwen3", seed=5)
    out["broken"] = root / "broken"
    out["broken"].mkdir()
    (out["broken"] / "config.json").write_text('{"model_type": "no-such-model"}')
    return out


def _toml(f: dict[str, Path], draft: Path) -> str:
    plain = 'suffix_drafts = false\nmax_kv_memory = "16MiB"'
    return f"""
[[models]]
id = "a"
target = "{f["a"]}"
draft = "{draft}"
aliases = ["alpha"]
max_kv_memory = "16MiB"
[[models]]
id = "b"
target = "{f["b"]}"
{plain}
[[models]]
id = "c"
target = "{f["c"]}"
{plain}
[[models]]
id = "slow"
target = "{f["slow"]}"
{plain}
[[models]]
id = "emb"
kind = "embeddings"
target = "{f["emb"]}"
pinned = true
[[models]]
id = "broken"
target = "{f["broken"]}"
"""


@pytest.fixture(scope="module")
def server(
    folders: dict[str, Path], draft_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    import dflash_server.serve.engine as composition

    real = composition.load_models

    def slowed(target: str, *args: Any, **kwargs: Any) -> Any:
        if Path(target).name == "slow":  # a load that takes a while, pausing as loads do
            import time

            from dflash_server.generation.pauses import pause

            for _ in range(20):
                time.sleep(0.05)
                pause()
        return real(target, *args, **kwargs)

    composition.load_models = slowed
    app = multi_app(
        tmp_path_factory.mktemp("several-app"), _toml(folders, draft_path), keepalive=0.1,
        prefix_cache=False, max_model_memory="4GB",
    )  # fmt: skip
    try:
        with run_server(app) as srv:
            yield srv
    finally:
        composition.load_models = real


@pytest.fixture(scope="module")
def alone(tiny_hybrid_path: Path, draft_path: Path) -> Iterator[Any]:
    """The one-model server of model "a"."""
    app = make_app(tiny_hybrid_path, draft_path, prefix_cache=False, max_kv_memory="16MiB")
    with run_server(app) as srv:
        yield srv


def _states(url: str) -> dict[str, tuple[str, str]]:
    return {m["id"]: (m["state"], m["kind"]) for m in httpx.get(f"{url}/v1/models").json()["data"]}


def _complete(url: str, model: str, **extra: Any) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/completions", json={**PROMPT, "model": model, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _tokens(answer: dict[str, Any]) -> list[str]:
    """The generated tokens one by one (``logprobs`` names each: the API gives no ids)."""
    tokens = answer["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == answer["usage"]["completion_tokens"]
    return tokens


def test_v1_models_lists_every_model_with_its_state_and_kind(server: Any) -> None:
    data = httpx.get(f"{server.base_url}/v1/models").json()["data"]
    card = next(m for m in data if m["id"] == "a")
    assert {"id", "object", "created", "owned_by"} <= set(card) and card["aliases"] == ["alpha"]
    states = _states(server.base_url)
    assert states["emb"] == ("loaded", "embeddings")  # pinned: loaded at start
    assert states["broken"] == ("unloaded", "chat") and len(states) == 6


def test_routed_by_id_and_alias_and_equal_to_a_one_model_server(server: Any, alone: Any) -> None:
    by_alias = _complete(server.base_url, "alpha", logprobs=0)
    by_id = _complete(server.base_url, "a", logprobs=0)
    reference = _complete(alone.base_url, alone.app.state.settings.model_id, logprobs=0)
    for answer in (by_alias, by_id):
        assert answer["choices"][0]["text"] == reference["choices"][0]["text"]
        assert _tokens(answer) == _tokens(reference)  # token by token, not just the text
        assert answer["usage"] == reference["usage"]
    assert by_alias["model"] == "alpha" and _states(server.base_url)["a"][0] == "loaded"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}
    mine = httpx.post(f"{server.base_url}/v1/chat/completions", json={**chat, "model": "a"})
    theirs = httpx.post(f"{alone.base_url}/v1/chat/completions", json=chat)
    assert mine.json()["choices"][0]["message"] == theirs.json()["choices"][0]["message"]


def test_an_unknown_model_is_a_404_naming_the_ids(server: Any) -> None:
    url, ids = server.base_url, "'a', 'b', 'c', 'slow', 'emb', 'broken'"
    hi = [{"role": "user", "content": "hi"}]
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "gpt-5", "messages": hi})
    assert r.status_code == 404
    assert r.json()["error"] == {
        "message": f"model 'gpt-5' is not served here; available: {ids}",
        "type": "not_found_error", "param": "model", "code": "model_not_found",
    }  # fmt: skip
    r = httpx.post(
        f"{url}/v1/messages",
        json={"model": "gpt-5", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 404 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "not_found_error" and ids in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/embeddings", json={"model": "a", "input": "x"})
    assert r.status_code == 400 and "needs an embeddings model (here: 'emb')" in r.text
    r = httpx.post(f"{url}/v1/completions", json={**PROMPT, "model": "emb"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported"


def test_a_stream_waits_for_its_model_with_keepalives(server: Any) -> None:
    body = {**PROMPT, "model": "slow", "stream": True}
    lines = []
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
    assert any(line.startswith(":") for line in lines[:first_data])  # keepalive comments
    assert lines[-1] == "data: [DONE]"
    slot = server.app.state.models.find("slow")
    assert slot.loads == 1 and slot.state == "loaded"


def test_many_first_requests_load_their_model_once(server: Any) -> None:
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: _complete(server.base_url, "c"), range(4)))
    assert server.app.state.models.find("c").loads == 1
    assert len({a["choices"][0]["text"] for a in answers}) == 1


def test_a_failed_load_answers_clearly_and_the_others_keep_serving(server: Any) -> None:
    r = httpx.post(f"{server.base_url}/v1/completions", json={**PROMPT, "model": "broken"})
    assert r.status_code == 500
    error = r.json()["error"]
    assert error["code"] == "model_load_failed" and "cannot load target" in error["message"]
    stream = {**PROMPT, "model": "broken", "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=stream) as s:
        text = "".join(s.iter_lines())
    assert "model_load_failed" in text and "[DONE]" in text  # the stream's error event
    assert _complete(server.base_url, "b")["usage"]["completion_tokens"] > 0
    health = httpx.get(f"{server.base_url}/health")
    assert health.status_code == 200
    broken = next(m for m in health.json()["model_states"] if m["id"] == "broken")
    assert broken["state"] == "unloaded" and "cannot load target" in broken["error"]


def test_metrics_are_labelled_by_model(
    server: Any, folders: dict[str, Path], draft_path: Path
) -> None:
    _complete(server.base_url, "a")
    _complete(server.base_url, "b")
    httpx.post(f"{server.base_url}/v1/embeddings", json={"model": "emb", "input": ["x", "y"]})
    text = httpx.get(f"{server.base_url}/metrics").text
    assert 'dflash_model_generations_total{model="b",outcome="length"}' in text
    assert 'dflash_model_state{model="emb",state="loaded"} 1.0' in text
    assert 'dflash_embedding_inputs_total{model="emb"}' in text
    assert 'dflash_model_loads_total{model="b"}' in text
    # Each loaded chat model says what it serves: "a" with the fixture drafter, "b" without;
    # the embeddings model is no chat model.
    info = {
        s.labels["model"]: s.labels
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "dflash_model_info" and s.value == 1
    }
    for model, (draft, family) in {"a": (str(draft_path), "DFlash"), "b": ("", "none")}.items():
        labels = {"target": str(folders[model]), "draft": draft, "draft_family": family}
        assert info[model] == {"model": model, **labels}
    assert "emb" not in info


def test_a_small_budget_switches_models_and_answers_stay_equal(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    toml = "".join(
        f'[[models]]\nid = "{name}"\ntarget = "{folders[name]}"\nsuffix_drafts = false\n'
        for name in ("b", "c")
    )
    # Each takes about 1 MB of weights (a plain-attention cache has no KV budget): one fits.
    app = multi_app(tmp_path, toml, prefix_cache=False, max_model_memory="1500KiB", api_key="k")
    auth = {"authorization": "Bearer k"}
    with run_server(app) as srv:
        url = srv.base_url
        body = {**PROMPT, "logprobs": 0}
        first = httpx.post(f"{url}/v1/completions", json={**body, "model": "b"}, headers=auth)
        other = httpx.post(f"{url}/v1/completions", json={**body, "model": "c"}, headers=auth)
        states = {
            m["id"]: m["state"] for m in httpx.get(f"{url}/v1/models", headers=auth).json()["data"]
        }
        assert states == {"b": "unloaded", "c": "loaded"}  # b made room for c
        again = httpx.post(f"{url}/v1/completions", json={**body, "model": "b"}, headers=auth)
        # "c" is a copy of "b": every answer the same, token by token, before and after a switch.
        assert again.json()["choices"] == first.json()["choices"]  # logprobs included
        assert _tokens(again.json()) == _tokens(first.json()) == _tokens(other.json())
        # The operators' endpoints, behind the API key like all of /v1.
        assert httpx.post(f"{url}/v1/models/c/load").status_code == 401
        loaded = httpx.post(f"{url}/v1/models/c/load", headers=auth)
        assert loaded.status_code == 200 and loaded.json()["state"] == "loaded"
        unloaded = httpx.post(f"{url}/v1/models/c/unload", headers=auth)
        assert unloaded.status_code == 200 and unloaded.json()["state"] == "unloaded"
        assert httpx.post(f"{url}/v1/models/zz/load", headers=auth).status_code == 404
