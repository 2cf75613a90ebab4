"""Images inside tool results, on every API, as agents send them: Claude Code's Read of a
picture (an Anthropic ``tool_result`` holding an ``image`` block), Codex's ``view_image`` (a
Responses ``function_call_output`` holding an ``input_image``) and a chat ``tool`` message
holding an ``image_url`` part. Each is the same prompt, the image inside ``<tool_response>`` as
Qwen3.5's template renders it, and the same greedy answer as mlx-vlm's on that prompt; usage
counts the image, the prefix cache covers it, and a text-only model says why it refuses it.

The prompt and answer token ids are read where the engine runs each request (``Run.deliver``),
so every protocol is compared on ids, never on text."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from PIL import Image

from dflash_server.api.anthropic import MessagesRequest, to_chat
from dflash_server.engine.runs import Run
from server_fixtures import RunningServer, make_app, run_server
from test_api_images import data_url, encoded, vl_draft, vlm  # noqa: F401 (module fixtures)
from test_images import PICTURES, vlm_greedy

N = 24
ASK = "Show me the picture."
SCHEMA = {"type": "object", "properties": {"file_path": {"type": "string"}}}
ARGS = '{"file_path": "a.png"}'
CHAT_TOOLS = [{"type": "function", "function": {"name": "Read", "parameters": SCHEMA}}]


@pytest.fixture(scope="module")
def server(tiny_vl_path: Path, vl_draft: Path) -> Iterator[RunningServer]:  # noqa: F811
    app = make_app(tiny_vl_path, vl_draft, temperature=0.0, max_images=2, enable_thinking=False)
    with run_server(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def text_only(tiny_vl_path: Path, vl_draft: Path) -> Iterator[RunningServer]:  # noqa: F811
    with run_server(make_app(tiny_vl_path, vl_draft, vision=False)) as srv:
        yield srv


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> Callable[[], list[dict[str, list[int]]]]:
    """The requests the engine ran from here on, in order: each one's prompt ids and answer
    ids."""
    seen: dict[Any, dict[str, list[int]]] = {}
    deliver = Run.deliver

    def recording(run: Run, response: Any) -> bool:
        entry = seen.setdefault(run.job, {"prompt": list(run.job.request.prompt), "answer": []})
        entry["answer"] += response.tokens
        return deliver(run, response)

    monkeypatch.setattr(Run, "deliver", recording)
    return lambda: list(seen.values())


# -- the same conversation on the three APIs -------------------------------------------------


def chat_messages(picture: Image.Image) -> list[dict[str, Any]]:
    """The model called Read; the tool answered with the file name and the picture."""
    call = {"id": "call_1", "type": "function", "function": {"name": "Read", "arguments": ARGS}}
    image = {"type": "image_url", "image_url": {"url": data_url(picture)}}
    result = [{"type": "text", "text": "a.png"}, image]
    return [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": result},
    ]


def anthropic_messages(picture: Image.Image, is_error: bool = False) -> list[dict[str, Any]]:
    """The conversation as Claude Code sends it: the Read result as a tool_result block."""
    data = base64.b64encode(encoded(picture)).decode()
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    use = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "a.png"}}
    content = [{"type": "text", "text": "a.png"}, image]
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": content}
    if is_error:
        result["is_error"] = True
    return [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": [result]},
    ]


def response_items(picture: Image.Image) -> list[dict[str, Any]]:
    """The conversation as Codex sends it: view_image's output as input_image parts."""
    image = {"type": "input_image", "image_url": data_url(picture)}
    output = [{"type": "input_text", "text": "a.png"}, image]
    return [
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": "call_1", "name": "Read", "arguments": ARGS},
        {"type": "function_call_output", "call_id": "call_1", "output": output},
    ]


def chat(srv: RunningServer, messages: list[dict[str, Any]]) -> dict[str, Any]:
    body = {"messages": messages, "tools": CHAT_TOOLS, "max_tokens": N}
    r = httpx.post(f"{srv.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def claude(srv: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.base_url, api_key="x", max_retries=0)


def oai(srv: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0)


def oracle(
    tiny_vl: tuple,
    vlm: tuple,  # noqa: F811
    messages: list[dict[str, Any]],
    pictures: list[Image.Image],
) -> tuple[list[int], list[int]]:
    """mlx-vlm's prompt ids and greedy answer for chat ``messages`` (images as the template's
    image parts)."""
    kwargs = {"add_generation_prompt": True, "tokenize": False, "enable_thinking": False}
    text = tiny_vl[1].apply_chat_template(template_ready(messages), tools=CHAT_TOOLS, **kwargs)
    ids = vlm[1](text=[text], images=pictures, return_tensors="np")["input_ids"][0].tolist()
    return ids, vlm_greedy(vlm, text, pictures, N)


def template_ready(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as a template takes them: image parts as ``{"type": "image"}``, tool call
    arguments as mappings."""
    out = []
    for m in messages:
        m = dict(m)
        if isinstance(m["content"], list):
            m["content"] = [p if p["type"] == "text" else {"type": "image"} for p in m["content"]]
        for i, call in enumerate(m.get("tool_calls") or []):
            arguments = json.loads(call["function"]["arguments"])
            m["tool_calls"][i] = {**call, "function": {**call["function"], "arguments": arguments}}
        out.append(m)
    return out


def test_tool_result_images_equal_on_every_api(
    server: RunningServer,
    runs: Any,
    tiny_vl: tuple,
    vlm: tuple,  # noqa: F811
) -> None:
    """A chat tool message, an Anthropic tool_result and a Responses function_call_output, each
    holding the same picture: one prompt (mlx-vlm's processor's ids for the same conversation),
    one greedy answer (mlx-vlm's), the picture's tokens inside <tool_response>, all counted."""
    picture = PICTURES[0]
    answer = chat(server, chat_messages(picture))
    anthropic_tools = [{"name": "Read", "input_schema": SCHEMA}]
    message = claude(server).messages.create(
        model="tiny-vl",
        max_tokens=N,
        tools=anthropic_tools,
        messages=anthropic_messages(picture),  # type: ignore[arg-type]
    )
    response = oai(server).responses.create(
        model="tiny-vl",
        max_output_tokens=N,
        input=response_items(picture),  # type: ignore[arg-type]
        tools=[{"type": "function", "name": "Read", "parameters": SCHEMA}],  # type: ignore[list-item]
    )
    ran = runs()
    assert len(ran) == 3
    prompt, greedy = oracle(tiny_vl, vlm, chat_messages(picture), [picture])
    for run in ran:
        assert run["prompt"] == prompt and run["answer"] == greedy
    # The image's tokens sit inside the tool response, as Qwen3.5's template places them.
    vision = tiny_vl[2]
    count = vision.count(vision.prepare(picture))
    rendered = tiny_vl[1].decode(prompt)
    pads = "<|vision_start|>" + "<|image_pad|>" * count + "<|vision_end|>"
    assert f"<tool_response>\na.png{pads}\n</tool_response>" in rendered
    assert prompt.count(vision.tokens.image) == count
    # Usage counts them: prefilled plus restored is the whole prompt, on each API.
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    usage = message.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == len(prompt)
    assert response.usage is not None and response.usage.input_tokens == len(prompt)
    counted = claude(server).messages.count_tokens(
        model="tiny-vl",
        tools=anthropic_tools,
        messages=anthropic_messages(picture),  # type: ignore[arg-type]
    )
    assert counted.input_tokens == len(prompt)


def test_prefix_cache_hit_after_a_tool_result_image_equals_a_cold_run(
    server: RunningServer,
    runs: Any,
    tiny_vl: tuple,
    vlm: tuple,  # noqa: F811
) -> None:
    """The turn after a tool result's picture restores the cached prefix (the picture
    included) and answers as mlx-vlm does on the whole prompt, cold."""
    picture = PICTURES[2]
    first = chat_messages(picture)
    reply = chat(server, first)["choices"][0]["message"]["content"]
    second = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "And?"}]
    answer = chat(server, second)
    prompt, greedy = oracle(tiny_vl, vlm, second, [picture])
    assert runs()[1] == {"prompt": prompt, "answer": greedy}
    last_pad = max(i for i, t in enumerate(prompt) if t == tiny_vl[2].tokens.image)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > last_pad


def test_anthropic_is_error_and_tool_result_translation() -> None:
    """is_error marks the result's text, images stay in place; text blocks join as today."""
    data = base64.b64encode(encoded(PICTURES[1])).decode()
    body = {"max_tokens": 4, "messages": anthropic_messages(PICTURES[1], is_error=True)}
    tool = to_chat(MessagesRequest.model_validate(body)).messages[-1]
    assert tool.role == "tool" and isinstance(tool.content, list)
    parts = [p.model_dump(exclude_none=True) for p in tool.content]
    assert parts[0] == {"type": "text", "text": "Error: a.png"}
    assert parts[1]["image_url"] == {"url": f"data:image/png;base64,{data}"}
    image_first = anthropic_messages(PICTURES[1], is_error=True)
    image_first[-1]["content"][0]["content"] = image_first[-1]["content"][0]["content"][::-1]
    tool = to_chat(MessagesRequest.model_validate({**body, "messages": image_first})).messages[-1]
    assert [p.type for p in tool.content] == ["text", "image_url", "text"]  # type: ignore[union-attr]
    assert tool.content[0].text == "Error: "  # type: ignore[index]
    texts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    plain = anthropic_messages(PICTURES[1])
    plain[-1]["content"][0]["content"] = texts
    tool = to_chat(MessagesRequest.model_validate({**body, "messages": plain})).messages[-1]
    assert tool.content == "a\n\nb"


def test_text_only_model_refuses_tool_result_images_on_every_api(text_only: RunningServer) -> None:
    """A 400 on each protocol naming the part, the cause and the fix."""
    picture = PICTURES[0]
    r = httpx.post(
        f"{text_only.base_url}/v1/chat/completions",
        json={"messages": chat_messages(picture), "tools": CHAT_TOOLS, "max_tokens": 4},
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "messages.2.content" and error["code"] == "unsupported_content"
    assert "messages.2.content.1: this model takes no images" in error["message"]
    assert "without --no-vision" in error["message"]
    refused = r"this model takes no images: text only \(--no-vision\); restart the server without"
    with pytest.raises(
        anthropic.BadRequestError, match=rf"messages\.2\.content\.0\.content\.1: {refused}"
    ):
        claude(text_only).messages.create(
            model="tiny-vl",
            max_tokens=4,
            messages=anthropic_messages(picture),  # type: ignore[arg-type]
        )
    with pytest.raises(openai.BadRequestError, match=rf"input\.2\.output\.1: {refused}"):
        oai(text_only).responses.create(model="tiny-vl", input=response_items(picture))  # type: ignore[arg-type]


def test_unsupported_parts_name_what_is_supported_there(server: RunningServer) -> None:
    """Each refusal names what the place it is in does take, never the refused type."""
    picture = data_url(PICTURES[0])
    document = {"type": "document", "source": {"type": "text", "data": "x"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [document]}
    messages = [*anthropic_messages(PICTURES[0])[:2], {"role": "user", "content": [result]}]
    with pytest.raises(anthropic.BadRequestError, match=r"'document' is not supported in a tool_result \(text and image blocks are\)"):  # fmt: skip
        claude(server).messages.create(model="tiny-vl", max_tokens=4, messages=messages)  # type: ignore[arg-type]
    items = response_items(PICTURES[0])
    items[-1]["output"] = [{"type": "input_file", "file_id": "file-1"}]
    with pytest.raises(openai.BadRequestError, match=r"input\.2\.output\.0: content part type 'input_file' is not supported \(input_text, output_text, refusal and input_image parts are\)"):  # fmt: skip
        oai(server).responses.create(model="tiny-vl", input=items)  # type: ignore[arg-type]
    assistant = {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": picture}}]}  # fmt: skip
    r = httpx.post(
        f"{server.base_url}/v1/chat/completions", json={"messages": [assistant], "max_tokens": 4}
    )
    assert r.status_code == 400
    assert "images are supported in user and tool messages, not in assistant messages" in r.text
