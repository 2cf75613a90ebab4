"""A drafter family added from one file (tests/toy_drafter.py) is served with nothing else
changed: registered, it loads from its folder, drafts in every cycle, and its greedy answers
equal plain decoding's, alone and in a batch (docs/development.md, "A drafter family")."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from dflash_server.drafters import registry
from dflash_server.testing import mask_token_id
from server_fixtures import make_app, run_server
from toy_drafter import FAMILY, write_toy


@pytest.fixture(scope="module")
def toy(tiny_hybrid_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    registry.register(FAMILY)
    try:
        folder = tmp_path_factory.mktemp("toy") / "toy"
        yield write_toy(folder, 64, (1, 2), mask_token_id(tiny_hybrid_path))
    finally:
        registry.FAMILIES.remove(FAMILY)


def tokens(reply: dict[str, Any]) -> list[str]:
    return [t["token"] for t in reply["choices"][0]["logprobs"]["content"]]


def test_a_registered_family_is_served_exactly(tiny_hybrid_path: Path, toy: Path) -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Count to ten."}],
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": True,
        "block_size": 4,
    }
    app = make_app(tiny_hybrid_path, toy, served_model_name="m", enable_thinking=False)
    with run_server(app) as srv:
        health = httpx.get(f"{srv.base_url}/health").json()
        assert health["draft_family"] == "Toy" and health["block_size"] == 4
        plain = httpx.post(
            f"{srv.base_url}/v1/chat/completions", json=body | {"speculative": False}, timeout=60
        ).json()
        url = f"{srv.base_url}/v1/chat/completions"
        with httpx.Client(timeout=60) as client:  # alone, then three at once (one batch)
            alone = client.post(url, json=body).json()
            with ThreadPoolExecutor(3) as pool:
                batch = list(pool.map(lambda _: client.post(url, json=body).json(), range(3)))
    assert tokens(alone) == tokens(plain) and len(tokens(plain)) > 4
    assert all(tokens(reply) == tokens(plain) for reply in batch)
    stats = alone["dflash"]
    assert stats["block_size"] == 4 and stats["drafted"] > 0  # the toy drafted every cycle


@pytest.mark.slow  # a server per family; tests/test_dspark.py and test_eagle3.py check them in-process
@pytest.mark.parametrize("family", ["DSpark", "EAGLE-3"])
def test_published_families_are_served_exactly(
    family: str, tiny_hybrid_path: Path, tiny_hybrid: Any, tmp_path: Path
) -> None:
    """A DSpark and an EAGLE-3 folder in their published layouts, served: /health names the
    family, and greedy answers alone and three at once equal plain decoding's."""
    from dflash_server.testing.layouts import write_dspark, write_eagle3

    model, _ = tiny_hybrid
    write = write_dspark if family == "DSpark" else write_eagle3
    folder = write(tmp_path / "drafter", model)
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Count to ten."}],
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": True,
        "block_size": 4,
    }
    app = make_app(tiny_hybrid_path, folder, served_model_name="m", enable_thinking=False)
    with run_server(app) as srv:
        assert httpx.get(f"{srv.base_url}/health").json()["draft_family"] == family
        url = f"{srv.base_url}/v1/chat/completions"
        with httpx.Client(timeout=60) as client:
            plain = client.post(url, json=body | {"speculative": False}).json()
            alone = client.post(url, json=body).json()
            with ThreadPoolExecutor(3) as pool:
                batch = list(pool.map(lambda _: client.post(url, json=body).json(), range(3)))
    assert tokens(alone) == tokens(plain) and len(tokens(plain)) > 4
    assert all(tokens(reply) == tokens(plain) for reply in batch)
    assert alone["dflash"]["drafted"] > 0
