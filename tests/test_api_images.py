"""Images on every API, tried as clients send them: the OpenAI SDK (chat with data URLs, the
Responses API's input_image), the Anthropic SDK (base64 image blocks), an Open WebUI-style
payload, remote URLs, and every malformed image as a 400 naming the field and the cause.

A real server on loopback over the tiny vision-language checkpoint; each answer is compared
with mlx-vlm's greedy decoding of the same prompt and images."""

from __future__ import annotations

import base64
import contextlib
import http.server
import io
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import mlx.core as mx
import openai
import pytest
from PIL import Image

from dflash_server.chat.logprobs import TokenTexts
from server_fixtures import RunningServer, build_draft, make_app, run_server
from test_images import PICTURES, picture, vlm_greedy, vlm_logits

N = 24
QUESTION = "What is in this picture?"


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(encoded(image, fmt)).decode()}"


def image_part(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def user(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}


@pytest.fixture(scope="module")
def vl_draft(tiny_vl_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_draft(tmp_path_factory.mktemp("vl-draft") / "d", tiny_vl_path, block_size=4)


@pytest.fixture(scope="module")
def server(tiny_vl_path: Path, vl_draft: Path) -> Iterator[RunningServer]:
    app = make_app(tiny_vl_path, vl_draft, temperature=0.0, max_images=2, enable_thinking=False)
    with run_server(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def vlm(tiny_vl_path: Path) -> tuple[Any, Any]:
    from mlx_vlm.utils import load

    return load(str(tiny_vl_path))


@pytest.fixture(scope="module")
def reference(tiny_vl: tuple, vlm: tuple) -> Any:
    """mlx-vlm's greedy tokens for ``pictures`` with the question, and their logprobs."""
    _, tokenizer, _ = tiny_vl

    def greedy(pictures: list[Image.Image]) -> tuple[list[int], list[float]]:
        parts: list[dict[str, Any]] = [{"type": "image"} for _ in pictures]
        messages = [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, enable_thinking=False
        )
        tokens = vlm_greedy(vlm, text, pictures, N)
        logits = vlm_logits(vlm, text, pictures, tokens)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        start = logits.shape[0] - len(tokens) - 1
        return tokens, [logprobs[start + i, t].item() for i, t in enumerate(tokens)]

    return greedy


@pytest.fixture(scope="module")
def token_ids(tiny_vl: tuple) -> Any:
    """Token ids from logprobs entries (each names its token's exact bytes)."""
    _, tokenizer, _ = tiny_vl
    texts = TokenTexts(tokenizer)
    by_bytes = {tuple(texts(i)[1]): i for i in range(len(tokenizer.vocab))}
    return lambda entries: [by_bytes[tuple(e["bytes"])] for e in entries]


def oai(srv: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0)


def chat(srv: RunningServer, *parts: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A chat completion of the question with ``parts``, with logprobs (plain HTTP)."""
    body = {"messages": [user(*parts)], "max_tokens": N, "logprobs": True, **extra}
    r = httpx.post(f"{srv.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_equals_mlx_vlm(server: RunningServer, reference: Any, token_ids: Any) -> None:
    """One image and two, PNG data URLs: token-identical to mlx-vlm's greedy decoding, each
    logprob within 1e-4 of mlx-vlm's."""
    for pictures in ([PICTURES[0]], PICTURES[1:3]):
        answer = chat(server, *(image_part(data_url(p), detail="auto") for p in pictures))
        entries = answer["choices"][0]["logprobs"]["content"]
        tokens, logprobs = reference(pictures)
        assert token_ids(entries) == tokens
        assert max(abs(e["logprob"] - lp) for e, lp in zip(entries, logprobs)) < 1e-4


def test_formats(server: RunningServer, reference: Any, token_ids: Any) -> None:
    """JPEG and WebP decode as mlx-vlm decodes them; a GIF counts by its first frame."""
    for fmt in ("JPEG", "WEBP"):
        decoded = Image.open(io.BytesIO(encoded(PICTURES[0], fmt))).convert("RGB")
        answer = chat(server, image_part(data_url(PICTURES[0], fmt)))
        assert token_ids(answer["choices"][0]["logprobs"]["content"]) == reference([decoded])[0]
    buffer = io.BytesIO()
    frames = [PICTURES[1], picture(9, (64, 128))]
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:])
    first = Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
    gif = f"data:image/gif;base64,{base64.b64encode(buffer.getvalue()).decode()}"
    answer = chat(server, image_part(gif))
    assert token_ids(answer["choices"][0]["logprobs"]["content"]) == reference([first])[0]


def test_openai_sdk_streams_data_urls(server: RunningServer) -> None:
    """The OpenAI SDK, streamed with usage: the same text as the whole answer."""
    parts = [image_part(data_url(p)) for p in PICTURES[1:3]]
    whole = chat(server, *parts)["choices"][0]["message"]["content"]
    stream = oai(server).chat.completions.create(
        model="tiny-vl",
        messages=[user(*parts)],  # type: ignore[list-item]
        max_tokens=N,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > 20


def test_anthropic_sdk_base64_block(server: RunningServer) -> None:
    """A base64 image block: the chat API's answer for the same image and question."""
    client = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
    data = base64.b64encode(encoded(PICTURES[1])).decode()
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    messages = [{"role": "user", "content": [block, {"type": "text", "text": QUESTION}]}]
    message = client.messages.create(model="tiny-vl", max_tokens=N, messages=messages)  # type: ignore[arg-type]
    whole = chat(server, image_part(data_url(PICTURES[1])))
    text = "".join(b.text for b in message.content if b.type == "text")
    assert text == whole["choices"][0]["message"]["content"]
    assert message.usage.input_tokens == whole["usage"]["prompt_tokens"]
    counted = client.messages.count_tokens(model="tiny-vl", messages=messages)  # type: ignore[arg-type]
    assert counted.input_tokens == message.usage.input_tokens


def test_responses_input_image(server: RunningServer) -> None:
    response = oai(server).responses.create(
        model="tiny-vl",
        max_output_tokens=N,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url(PICTURES[0]), "detail": "auto"},
                    {"type": "input_text", "text": QUESTION},
                ],
            }
        ],
    )
    whole = chat(server, image_part(data_url(PICTURES[0])))
    assert response.output_text == whole["choices"][0]["message"]["content"]


def test_open_webui_payload_and_the_next_turn(server: RunningServer) -> None:
    """Open WebUI's shape (text part first, its own extra fields, streamed with usage); its
    next turn resends the image in the history, and the prefix cache covers it."""
    url = data_url(PICTURES[0])
    first = {"role": "user", "content": [{"type": "text", "text": QUESTION}, image_part(url)]}
    body = {
        "model": "tiny-vl",
        "messages": [first],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": N,
        "metadata": {"chat_id": "c1", "message_id": "m1"},
        "params": {},
    }
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert len(lines) > 2
    second = {**body, "stream": False}
    second["messages"] = [first, {"role": "assistant", "content": "Noise."}, user()]
    answer = httpx.post(f"{server.base_url}/v1/chat/completions", json=second).json()
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 20
    assert answer["choices"][0]["message"]["content"]


BAD = base64.b64encode(b"\x89PNG not really").decode()
INVALID: list[tuple[str, dict[str, Any], str, str]] = [
    ("base64", user(image_part("data:image/png;base64,@@@")), "messages.0.content", "base64"),
    ("unreadable", user(image_part(f"data:image/png;base64,{BAD}")), "messages.0.content",
     "not an image"),
    ("remote off", user(image_part("https://example.com/cat.png")), "messages.0.content",
     "--allow-remote-images"),
    ("no url", user({"type": "image_url", "image_url": {}}), "messages.0.content", "URL"),
    ("detail", user(image_part(data_url(PICTURES[0]), detail="huge")), "messages.0.content",
     "detail"),
    ("video", user({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AA=="}}),
     "messages.0.content", "not supported yet"),
    ("video data", user(image_part("data:video/mp4;base64,AAAA")), "messages.0.content",
     "not supported yet"),
    ("too many", user(*[image_part(data_url(PICTURES[0]))] * 3), "messages.0.content",
     "--max-images"),
    ("assistant", {"role": "assistant", "content": [image_part(data_url(PICTURES[0]))]},
     "messages.0.content", "user and tool messages"),
    ("text/plain", user(image_part("data:text/plain;base64,aGk=")), "messages.0.content",
     "base64 image"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "message", "param", "cause"), INVALID, ids=[c[0] for c in INVALID]
)
def test_bad_images_are_400s_naming_field_and_cause(
    server: RunningServer, case: str, message: dict[str, Any], param: str, cause: str
) -> None:
    body = {"model": "tiny-vl", "messages": [message], "max_tokens": 4}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and cause in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_pixel_limits(
    server: RunningServer, tiny_vl: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An image over the decoding limit (a decompression bomb) and one the processor cannot
    resize (aspect ratio over 200) are 400s naming the field and the cause; a large one within
    the limits is resized to --max-image-pixels (its tokens counted in the prompt)."""
    import dflash_server.api.images as images

    def post(image: Image.Image) -> httpx.Response:
        body = {"messages": [user(image_part(data_url(image)))], "max_tokens": 1}
        return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)

    monkeypatch.setattr(images, "MAX_DECODED_PIXELS", 64 * 64)
    r = post(picture(4, (96, 64)))
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content"
    assert "this server decodes" in r.json()["error"]["message"]
    monkeypatch.undo()
    r = post(picture(5, (1, 300)))
    assert r.status_code == 400 and "aspect ratio" in r.json()["error"]["message"]
    vision = tiny_vl[2]
    sizes = [(96, 64), (1024, 768)]
    small, large = (post(picture(6, size)).json()["usage"]["prompt_tokens"] for size in sizes)
    capped = vision.count(vision.prepare(picture(6, sizes[1])))  # the processor's 256 x 256
    assert large - small == capped - 6 and capped * 32 * 32 <= vision.max_pixels


def test_bad_images_on_the_other_apis(server: RunningServer) -> None:
    client = oai(server)
    with pytest.raises(openai.BadRequestError, match="file_id"):
        client.responses.create(
            model="tiny-vl",
            input=[{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}],
        )
    with pytest.raises(openai.BadRequestError, match=r"input\.0\.content\.0.*base64"):
        client.responses.create(
            model="tiny-vl",
            input=[
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": "data:image/png;base64,%"}],
                }
            ],
        )
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
    bad = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": BAD}}
    with pytest.raises(anthropic.BadRequestError, match=r"messages\.0\.content\.1.*not an image"):
        claude.messages.create(
            model="tiny-vl",
            max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}, bad]}],
        )
    remote = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    with pytest.raises(anthropic.BadRequestError, match="--allow-remote-images"):
        claude.messages.create(
            model="tiny-vl", max_tokens=4, messages=[{"role": "user", "content": [remote]}]
        )


def test_models_say_the_model_takes_images(server: RunningServer) -> None:
    card = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]
    assert "vision" in card["capabilities"] and card["modalities"]["input"] == ["text", "image"]
    assert httpx.get(f"{server.base_url}/health").json()["vision"] is True


@contextlib.contextmanager
def image_host(files: dict[str, bytes]) -> Iterator[str]:
    """A loopback http server of ``files`` (path -> bytes); yields its base URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            data = files.get(self.path)
            self.send_response(200 if data is not None else 404)
            self.end_headers()
            self.wfile.write(data or b"")

        def log_message(self, *args: Any) -> None:
            pass

    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=host.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{host.server_address[1]}"
    finally:
        host.shutdown()


def test_remote_images_when_allowed(
    tiny_vl_path: Path, vl_draft: Path, reference: Any, token_ids: Any
) -> None:
    app = make_app(tiny_vl_path, vl_draft, temperature=0.0, enable_thinking=False,
                   allow_remote_images=True, allowed_image_hosts=["127.0.0.1"])  # fmt: skip
    with run_server(app) as srv, image_host({"/a.png": encoded(PICTURES[0])}) as host:
        answer = chat(srv, image_part(f"{host}/a.png"))
        assert token_ids(answer["choices"][0]["logprobs"]["content"]) == reference(PICTURES[:1])[0]
        with pytest.raises(openai.BadRequestError, match="could not fetch the image"):
            oai(srv).chat.completions.create(
                model="tiny-vl",
                messages=[user(image_part(f"{host}/missing.png"))],  # type: ignore[list-item]
                max_tokens=4,
            )


def test_no_vision_serves_text_only(tiny_vl_path: Path, vl_draft: Path) -> None:
    app = make_app(tiny_vl_path, vl_draft, vision=False)
    with run_server(app) as srv:
        card = httpx.get(f"{srv.base_url}/v1/models").json()["data"][0]
        assert "vision" not in card["capabilities"] and card["modalities"]["input"] == ["text"]
        body = {"messages": [user(image_part(data_url(PICTURES[0])))], "max_tokens": 4}
        r = httpx.post(f"{srv.base_url}/v1/chat/completions", json=body)
        assert r.status_code == 400 and "--no-vision" in r.json()["error"]["message"]
        text = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
        assert httpx.post(f"{srv.base_url}/v1/chat/completions", json=text).status_code == 200
