"""Security defaults: loopback bind, API key on every /v1 path, inert ``model`` field, quiet logs."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dflash_server.cli import build_parser
from dflash_server.settings import Settings
from server_fixtures import RunningServer, make_app, run_server

KEY = "s3cret-key"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def server(tiny_hybrid_path: Path, draft_path: Path) -> Iterator[RunningServer]:
    app = make_app(tiny_hybrid_path, draft_path, api_key=KEY, enable_thinking=False)
    with run_server(app) as srv:
        yield srv


def test_binds_loopback_by_default(tiny_hybrid_path: Path, draft_path: Path) -> None:
    assert build_parser().parse_args([]).host is None  # the flag does not override settings
    assert Settings.load(target=str(tiny_hybrid_path), draft=str(draft_path)).host == "127.0.0.1"


ROUTES = [
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/tiny-qwen3_5", None),
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("GET", "/v1/not-a-route", None),  # unknown paths do not reveal themselves without the key
    ("POST", "/v1/chat/completions", {"messages": "invalid"}),  # checked before validation
]
BAD_AUTH: list[dict[str, Any]] = [
    {},
    {"authorization": "Bearer wrong"},
    {"authorization": f"Basic {KEY}"},
    {"authorization": KEY},
    {"authorization": f"Bearer {KEY}x"},
    {"authorization": "Bearer " + KEY[:-1]},
    {"authorization": b"Bearer " + "ключ".encode()},  # non-ASCII bytes: 401, not 500
]


@pytest.mark.parametrize(("method", "path", "body"), ROUTES)
def test_every_v1_route_needs_the_key(
    server: RunningServer, method: str, path: str, body: Any
) -> None:
    for headers in BAD_AUTH:
        r = httpx.request(method, server.base_url + path, json=body, headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.request(
        method, server.base_url + path, json=body, headers={"authorization": f"Bearer {KEY}"}
    )
    assert r.status_code != 401
    assert httpx.get(server.base_url + "/health").status_code == 200  # stays open


def test_key_compare_is_constant_time(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dflash_server.api.guard as guard

    calls: list[tuple[bytes, bytes]] = []
    real = guard.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(guard.hmac, "compare_digest", spy)
    httpx.get(server.base_url + "/v1/models", headers={"authorization": "Bearer nope"})
    assert calls == [(b"nope", KEY.encode())]


def test_model_field_never_loads_or_reads_anything(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Paths, hub ids and traversal in ``model`` are a 404: no loader call, no file opened."""
    import huggingface_hub
    import mlx_lm

    import dflash_server.engine.loader as loader

    loads: list[str] = []

    def forbid(name: str) -> Any:
        def called(*args: Any, **kwargs: Any) -> Any:
            loads.append(name)
            raise AssertionError(f"{name} called")

        return called

    for mod, attr in [
        (loader, "load_models"),
        (loader, "resolve_model"),
        (mlx_lm, "load"),
        (huggingface_hub, "snapshot_download"),
        (huggingface_hub, "hf_hub_download"),
    ]:
        monkeypatch.setattr(mod, attr, forbid(attr))
    bait = tmp_path / "SENTINEL-model"
    bait.mkdir()
    (bait / "config.json").write_text("{}")
    opened: list[str] = []
    watching = [True]

    def audit(event: str, args: tuple[Any, ...]) -> None:
        watched = watching[0] and event in {"open", "os.listdir", "os.scandir"}
        if watched and args and "SENTINEL" in str(args[0]):
            opened.append(f"{event} {args[0]}")

    sys.addaudithook(audit)  # hooks cannot be removed; ``watching`` turns this one off
    auth = {"authorization": f"Bearer {KEY}"}
    names = [str(bait), "../SENTINEL-model", "SENTINEL-org/SENTINEL-model", "~/SENTINEL-model"]
    try:
        for name in names:
            for path, body in [
                ("/v1/chat/completions", {**CHAT, "model": name}),
                ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "model": name}),
            ]:
                r = httpx.post(server.base_url + path, json=body, headers=auth)
                assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            r = httpx.get(f"{server.base_url}/v1/models/{name}", headers=auth)
            assert r.status_code == 404
    finally:
        watching[0] = False
    assert opened == [] and loads == []


def test_prompt_text_is_logged_only_at_debug(
    server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    # Other tests may have run the CLI, which stops this logger propagating: listen on it.
    logger = logging.getLogger("dflash_server")
    logger.addHandler(caplog.handler)
    try:
        _check_logs(server, caplog)
    finally:
        logger.removeHandler(caplog.handler)


def _check_logs(server: RunningServer, caplog: pytest.LogCaptureFixture) -> None:
    secret = "zebra-quartz-secret"
    auth = {"authorization": f"Bearer {KEY}"}
    body = {"messages": [{"role": "user", "content": secret}], "max_tokens": 3}
    with caplog.at_level(logging.INFO), caplog.at_level(logging.INFO, logger="dflash_server"):
        assert httpx.post(server.base_url + "/v1/chat/completions", json=body, headers=auth)
        r = httpx.post(
            server.base_url + "/v1/completions",
            json={"prompt": secret, "max_tokens": 3, "stream": True},
            headers=auth,
        )
        assert r.status_code == 200
    assert "request:" in caplog.text  # the per-request line is there, without the text
    assert secret not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="dflash_server"):
        httpx.post(server.base_url + "/v1/chat/completions", json=body, headers=auth)
    assert secret in caplog.text  # --log-level debug is the flag that shows prompts
