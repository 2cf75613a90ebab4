"""``POST /v1/embeddings`` against an independent computation: a numpy forward pass of the
tiny ``qwen3`` fixture (the last token's hidden state after the final norm, L2-normalised),
its tokens from the ``tokenizers`` library; float and base64, ``dimensions``, token inputs,
input order, usage, and OpenAI's 400s for bad input; the OpenAI SDK as the client."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from dflash_server.testing import build_target
from server_fixtures import run_server
from test_several_models import multi_app

TEXTS = ["hello world", "a", "the quick brown fox jumps over the lazy dog " * 3]


@pytest.fixture(scope="module")
def emb_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_target(tmp_path_factory.mktemp("emb") / "emb", arch="qwen3", seed=11)


@pytest.fixture(scope="module")
def server(emb_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    toml = f'[[models]]\nid = "emb"\nkind = "embeddings"\ntarget = "{emb_path}"\naliases = ["e"]\n'
    with run_server(multi_app(tmp_path_factory.mktemp("emb-app"), toml)) as srv:
        yield srv


def _weights(path: Path) -> dict[str, np.ndarray]:
    import mlx.core as mx

    arrays = mx.load(str(path / "model.safetensors"))
    return {k.removeprefix("model."): np.array(v, dtype=np.float64) for k, v in arrays.items()}


def reference(path: Path, tokens: list[int]) -> np.ndarray:
    """Qwen3's forward in numpy (float64): RMSNorm, q/k norms, RoPE over the whole head,
    grouped-query causal attention, SwiGLU; the last token after the final norm, unit length."""
    import json

    cfg = json.loads((path / "config.json").read_text())
    w, eps = _weights(path), cfg["rms_norm_eps"]
    heads, kv, dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def norm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight

    def rope(x: np.ndarray) -> np.ndarray:  # [heads, T, dim], non-traditional halves
        half = dim // 2
        freqs = cfg["rope_theta"] ** (-np.arange(half) * 2 / dim)
        angles = np.arange(x.shape[1])[:, None] * freqs[None]
        cos, sin = np.cos(angles), np.sin(angles)
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], -1)

    t = len(tokens)
    h = w["embed_tokens.weight"][tokens]
    mask = np.triu(np.full((t, t), -np.inf), 1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        x = norm(h, w[p + "input_layernorm.weight"])
        q = (x @ w[p + "self_attn.q_proj.weight"].T).reshape(t, heads, dim).transpose(1, 0, 2)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).reshape(t, kv, dim).transpose(1, 0, 2)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).reshape(t, kv, dim).transpose(1, 0, 2)
        q = rope(norm(q, w[p + "self_attn.q_norm.weight"]))
        k = rope(norm(k, w[p + "self_attn.k_norm.weight"]))
        k, v = np.repeat(k, heads // kv, 0), np.repeat(v, heads // kv, 0)
        scores = q @ k.transpose(0, 2, 1) / np.sqrt(dim) + mask
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        out = (scores / scores.sum(-1, keepdims=True)) @ v
        h = h + out.transpose(1, 0, 2).reshape(t, -1) @ w[p + "self_attn.o_proj.weight"].T
        x = norm(h, w[p + "post_attention_layernorm.weight"])
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    last = norm(h, w["norm.weight"])[-1]
    return last / np.linalg.norm(last)


def _ids(path: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json")).encode(text).ids


def _post(server: Any, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/embeddings", json={"model": "emb", **body}, timeout=60)


def test_vectors_equal_an_independent_computation_in_input_order(
    server: Any, emb_path: Path
) -> None:
    r = _post(server, input=TEXTS)
    assert r.status_code == 200
    body = r.json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and body["object"] == "list"
    ids = [_ids(emb_path, t) for t in TEXTS]
    for item, tokens in zip(body["data"], ids):
        assert item["object"] == "embedding"
        np.testing.assert_allclose(item["embedding"], reference(emb_path, tokens), atol=2e-5)
    total = sum(len(t) for t in ids)
    assert body["usage"] == {"prompt_tokens": total, "total_tokens": total}
    assert body["model"] == "emb"


def test_token_inputs_base64_and_dimensions(server: Any, emb_path: Path) -> None:
    ids = [_ids(emb_path, t) for t in TEXTS]
    as_text = _post(server, input=TEXTS).json()["data"]
    as_tokens = _post(server, input=ids).json()["data"]
    assert [d["embedding"] for d in as_tokens] == [d["embedding"] for d in as_text]
    one = _post(server, input=ids[0]).json()["data"]  # one input as its token ids
    # Alone, not padded beside others: BLAS may sum in another order (last bits only).
    np.testing.assert_allclose(one[0]["embedding"], as_text[0]["embedding"], atol=1e-6)
    packed = _post(server, input=TEXTS, encoding_format="base64").json()["data"]
    for a, b in zip(packed, as_text):
        assert np.frombuffer(base64.b64decode(a["embedding"]), "<f4").tolist() == b["embedding"]
    short = _post(server, input=TEXTS[0], dimensions=8).json()["data"][0]["embedding"]
    full = reference(emb_path, ids[0])[:8]
    np.testing.assert_allclose(short, full / np.linalg.norm(full), atol=2e-5)
    assert len(short) == 8 and abs(np.linalg.norm(short) - 1) < 1e-5


def test_a_long_input_runs_in_chunks_and_equals_the_reference(server: Any, emb_path: Path) -> None:
    tokens = [(7 * i) % 300 + 3 for i in range(1300)]  # longer than a chunk (512 tokens)
    got = _post(server, input=[tokens, [5, 6]]).json()["data"]
    np.testing.assert_allclose(got[0]["embedding"], reference(emb_path, tokens), atol=5e-5)
    np.testing.assert_allclose(got[1]["embedding"], reference(emb_path, [5, 6]), atol=2e-5)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": ""}, "input", "empty string"),
        ({"input": []}, "input", "non-empty"),
        ({"input": ["a", 3]}, "input", "input[0] is neither"),
        ({"input": [[1, 2], []]}, "input", "input[1] is neither"),
        ({"input": [10**6]}, "input", "token ids must be in"),
        ({"input": ["x"] * 2049}, "input", "at most 2048"),
        ({"input": "x", "dimensions": 0}, "dimensions", "dimensions must be in [1, 64]"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", ""),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    server: Any, body: dict[str, Any], param: str, words: str
) -> None:
    r = _post(server, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_the_openai_sdk_reads_them(server: Any, emb_path: Path) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    got = client.embeddings.create(model="e", input=TEXTS[:2])  # base64 on the wire by default
    for item, text in zip(got.data, TEXTS[:2]):
        np.testing.assert_allclose(
            item.embedding, reference(emb_path, _ids(emb_path, text)), atol=2e-5
        )
    assert got.usage.prompt_tokens == sum(len(_ids(emb_path, t)) for t in TEXTS[:2])
