"""The soak's requests (tests/load/soak.py): what each kind of request in the mix sends.

A server's mix is a fixed list of ``Spec``s: every (protocol, feature) pair its model takes, plain
and streamed, greedy (each answer is checked against the same request's solo run), plus a few
sampled ones (seeded) and streamed ones the client leaves after the first text (a disconnect).

Protocols: chat completions, legacy completions, Anthropic Messages, OpenAI Responses. Features:

* ``plain``, ``tools`` (a forced call), ``schema`` (a JSON schema), ``turn`` (a second turn: the
  first turn's prefix is cached);
* ``image``: pictures in the user message (``image_url`` data URLs, ``image`` blocks,
  ``input_image`` parts), on a server whose target has a vision tower;
* ``tool_image``: a picture inside a tool result, as agents send it (a chat ``tool`` message
  with an ``image_url`` part, an Anthropic ``tool_result`` holding an ``image`` block, a
  Responses ``function_call_output`` holding an ``input_image``: tests/test_api_tool_images.py);
* ``echo``: the prompt restates a passage and an earlier answer holds it, so the context repeats
  itself and suffix copies have something to copy (block size ``auto``, which copies need).

Every greedy request comes back many times in a run with the same answer, so from its second
time on the shared suffix index holds that answer too: copies come from both.
"""

from __future__ import annotations

import base64
import functools
import io
from dataclasses import dataclass
from typing import Any

PROTOCOLS = ("chat", "completions", "messages", "responses")
PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "messages": "/v1/messages",
    "responses": "/v1/responses",
}
TEXT_FEATURES = ("plain", "tools", "schema", "turn", "echo")
IMAGE_FEATURES = ("image", "tool_image")
COMPLETION_FEATURES = ("plain", "echo")  # a raw prompt: no roles, tools or images

SYSTEMS = [
    f"You are helper {k}. " + "Answer briefly, exactly and politely. " * 24 for k in range(3)
]
QUESTIONS = ["What is the capital of France?", "Name three colors.", "Count to five.", "Hi!"]
PASSAGE = "The quick brown fox jumps over the lazy dog; pack my box with five dozen jugs. " * 3
PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}
SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}
READ = {"type": "object", "properties": {"file_path": {"type": "string"}}}  # the agent's Read tool
READ_ARGS = '{"file_path": "a.png"}'
FN = {"name": "get_weather", "description": "Weather for a city"}
# Picture sizes: the tiny vision target makes (w/32)·(h/32) tokens of each (4 to 8 here).
SIZES = ((64, 64), (96, 64), (64, 128))


@dataclass(frozen=True)
class Spec:
    n: int  # its place in its server's mix
    server: str  # which server's mix ("main": vision, DFlash drafter, 8-bit KV; "mtp")
    protocol: str
    feature: str
    stream: bool
    greedy: bool
    disconnect: bool = False  # leave after the first text (a client going away)

    @property
    def kind(self) -> str:
        return f"{self.protocol}/{self.feature}"

    @property
    def block_size(self) -> int | str:
        # Suffix copies need "auto" (their costs); a fixed block keeps the drafter's path busy too.
        return "auto" if self.feature == "echo" or self.n % 4 in (1, 2) else 4


def mix(server: str, vision: bool) -> list[Spec]:
    """``server``'s mix: each feature its model takes on each protocol, plain and streamed and
    greedy; then per protocol a sampled request, a sampled stream and a disconnecting stream."""
    specs: list[Spec] = []

    def add(protocol: str, feature: str, stream: bool, greedy: bool, leave: bool = False) -> None:
        specs.append(Spec(len(specs), server, protocol, feature, stream, greedy, leave))

    for protocol in PROTOCOLS:
        features = COMPLETION_FEATURES if protocol == "completions" else TEXT_FEATURES
        if vision and protocol != "completions":
            features = (*features, *IMAGE_FEATURES)
        for feature in features:
            for stream in (False, True):
                add(protocol, feature, stream, greedy=True)
    for protocol in PROTOCOLS:
        add(protocol, "plain", False, greedy=False)
        add(protocol, "turn" if protocol != "completions" else "plain", True, greedy=False)
        add(protocol, "image" if vision and protocol != "completions" else "plain", True,
            greedy=True, leave=True)  # fmt: skip
    return specs


@functools.lru_cache(maxsize=16)
def picture_url(seed: int) -> str:
    """A deterministic random RGB picture as a PNG data URL."""
    import numpy as np
    from PIL import Image

    w, h = SIZES[seed % len(SIZES)]
    pixels = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _parts(protocol: str, seed: int, text: str, images: int) -> list[dict[str, Any]]:
    """``images`` pictures then ``text``, as parts of ``protocol``'s user content."""
    out: list[dict[str, Any]] = []
    for i in range(images):
        url = picture_url(seed + i)
        if protocol == "chat":
            out.append({"type": "image_url", "image_url": {"url": url}})
        elif protocol == "messages":
            data = url.split(",", 1)[1]
            source = {"type": "base64", "media_type": "image/png", "data": data}
            out.append({"type": "image", "source": source})
        else:
            out.append({"type": "input_image", "image_url": url})
    kind = "input_text" if protocol == "responses" else "text"
    return [*out, {"type": kind, "text": text}]


def _turns(s: Spec, question: str) -> list[dict[str, Any]]:
    """The conversation after the system prompt (chat messages; Messages and Responses take the
    same user/assistant turns, except for images and tool results)."""
    if s.feature == "turn":  # a second turn: the first one's prefix is cached
        return [
            {"role": "user", "content": question},
            {"role": "assistant", "content": "Sure."},
            {"role": "user", "content": "Why?"},
        ]
    if s.feature == "echo":  # the passage said twice, then asked for again
        return [
            {"role": "user", "content": f"Repeat after me: {PASSAGE}"},
            {"role": "assistant", "content": PASSAGE},
            {"role": "user", "content": "Again, word for word."},
        ]
    if s.feature == "image":
        return [{"role": "user", "content": _parts(s.protocol, s.n, question, 1 + s.n % 2)}]
    if s.feature == "tool_image":
        return _tool_image(s)
    return [{"role": "user", "content": question}]


def _tool_image(s: Spec) -> list[dict[str, Any]]:
    """The model called Read on a picture; the tool answered with its name and the picture."""
    ask = {"role": "user", "content": "Show me the picture a.png."}
    url = picture_url(100 + s.n)
    if s.protocol == "chat":
        fn = {"name": "Read", "arguments": READ_ARGS}
        call = {"id": "call_1", "type": "function", "function": fn}
        result: list[dict[str, Any]] = [
            {"type": "text", "text": "a.png"},
            {"type": "image_url", "image_url": {"url": url}},
        ]
        return [
            ask,
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": result},
        ]
    if s.protocol == "messages":
        use = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "a.png"}}
        content = _parts("messages", 100 + s.n, "a.png", 1)[::-1]  # the name, then the picture
        block = {"type": "tool_result", "tool_use_id": "toolu_1", "content": content}
        return [ask, {"role": "assistant", "content": [use]}, {"role": "user", "content": [block]}]
    output = [{"type": "input_text", "text": "a.png"}, {"type": "input_image", "image_url": url}]
    call = {"type": "function_call", "call_id": "call_1", "name": "Read", "arguments": READ_ARGS}
    return [ask, call, {"type": "function_call_output", "call_id": "call_1", "output": output}]


def body(s: Spec) -> dict[str, Any]:
    """The request body of ``s`` (sampled ones draw with a fixed seed)."""
    system, question = SYSTEMS[s.n % 3], QUESTIONS[(s.n // 3) % 4]
    out: dict[str, Any] = {"stream": s.stream, "block_size": s.block_size}
    out |= {"temperature": 0.0} if s.greedy else {"temperature": 0.9, "top_p": 0.95, "seed": s.n}
    tokens = 16 + (s.n % 4) * 8
    if s.protocol == "completions":
        prompt = f"{system}\n\nQ: {question}\nA:" if s.feature == "plain" else PASSAGE * 3
        return out | {"prompt": prompt, "max_tokens": tokens}
    turns = _turns(s, question)
    if s.protocol == "chat":
        out |= {"messages": [{"role": "system", "content": system}, *turns], "max_tokens": tokens}
        out["enable_thinking"] = False
        if s.feature == "tools":
            out["tools"] = [{"type": "function", "function": {**FN, "parameters": PARAMS}}]
            out["tool_choice"] = "required"
        elif s.feature == "tool_image":
            out["tools"] = [{"type": "function", "function": {"name": "Read", "parameters": READ}}]
        elif s.feature == "schema":
            out["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "w", "schema": SCHEMA, "strict": True},
            }
            out["max_tokens"] = 64
    elif s.protocol == "messages":
        out |= {"model": "tiny", "system": system, "messages": turns, "max_tokens": tokens}
        if s.feature in ("tools", "schema"):  # a forced tool call: its input follows the schema
            out["tools"] = [{**FN, "input_schema": PARAMS if s.feature == "tools" else SCHEMA}]
            out["tool_choice"] = {"type": "any"}
            out["max_tokens"] = 64
        elif s.feature == "tool_image":
            out["tools"] = [{"name": "Read", "input_schema": READ}]
    else:
        out |= {"model": "tiny", "instructions": system, "input": turns}
        out["max_output_tokens"] = tokens
        if s.feature == "tools":
            out["tools"] = [{"type": "function", **FN, "parameters": PARAMS}]
            out["tool_choice"] = "required"
        elif s.feature == "tool_image":
            out["tools"] = [{"type": "function", "name": "Read", "parameters": READ}]
        elif s.feature == "schema":
            fmt = {"type": "json_schema", "name": "w", "schema": SCHEMA, "strict": True}
            out |= {"text": {"format": fmt}, "max_output_tokens": 64}
    return out
