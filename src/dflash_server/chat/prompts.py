"""Turn chat messages or a raw prompt into token ids, with the tokenizer's own chat template."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dflash_server.chat.reasoning import prompt_reasoning
from dflash_server.generation.request import Reasoning
from dflash_server.generation.text import encode
from dflash_server.models.vision import expand_pads


class PromptError(ValueError):
    """The template rejected the conversation (e.g. roles out of order); shown to the client."""


@dataclass(frozen=True)
class Prompt:
    """A rendered prompt and whether it leaves a think block open for the model to close."""

    text: str
    tokens: list[int]
    reasoning: Reasoning = field(default_factory=Reasoning)
    checkpoints: tuple[int, ...] = ()  # where the next request is likely to share this one

    @property
    def opens_reasoning(self) -> bool:
        return self.reasoning.opens


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    enable_thinking: bool,
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    image_pads: tuple[int, Sequence[int]] | None = None,
) -> Prompt:
    """Apply the chat template with the generation prompt; detect an open think block.

    ``tools`` (OpenAI function tools) are rendered by the template itself, as the model was
    trained to see them. ``image_pads`` (the image token id, each image's token count): the
    one image token the template writes per image becomes that image's run of them.
    """
    kwargs = dict(template_kwargs or {})
    kwargs["enable_thinking"] = enable_thinking
    if tools:
        kwargs["tools"] = tools
    if getattr(tokenizer, "chat_template", None) is None:
        raise PromptError("this model has no chat template; use /v1/completions instead")
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **kwargs
        )
    except Exception as exc:  # jinja raises TemplateError / TypeError for malformed input
        raise PromptError(f"chat template rejected the messages: {exc}") from exc
    tokens = encode(tokenizer, text)
    if image_pads is not None:
        try:
            tokens = expand_pads(tokens, *image_pads)
        except ValueError as exc:
            raise PromptError(f"the chat template did not place the images: {exc}") from exc
    return Prompt(
        text, tokens, prompt_reasoning(tokenizer, text), chat_checkpoints(tokenizer, tokens)
    )


# Tokens that open a message in common chat templates (ChatML/Qwen, Llama 3).
MESSAGE_STARTS = ("<|im_start|>", "<|start_header_id|>")
# Completions have no messages: keep state every so many tokens.
CHECKPOINT_STRIDE = 4096


def chat_checkpoints(tokenizer: Any, tokens: list[int]) -> tuple[int, ...]:
    """Message boundaries worth keeping recurrent state at: the end of the first message (the
    system prompt and tools) and the last few, the last being the start of the generation
    prompt, which is exactly what the next turn of the conversation shares."""
    for marker in MESSAGE_STARTS:
        marker_id = _token_id(tokenizer, marker)
        if marker_id is not None:
            starts = [i for i, t in enumerate(tokens) if t == marker_id and i > 0]
            return tuple(sorted(set(starts[:1] + starts[-3:])))
    return stride_checkpoints(len(tokens))


def stride_checkpoints(length: int) -> tuple[int, ...]:
    return tuple(range(CHECKPOINT_STRIDE, length, CHECKPOINT_STRIDE))


def _token_id(tokenizer: Any, token: str) -> int | None:
    try:
        ids = tokenizer.encode(token, add_special_tokens=False)
    except Exception:
        return None
    return ids[0] if len(ids) == 1 else None


def render_completion(tokenizer: Any, prompt: str | list[int]) -> Prompt:
    """A raw prompt: text is tokenized as is; token ids pass through."""
    if isinstance(prompt, str):
        tokens = encode(tokenizer, prompt)
        return Prompt(prompt, tokens, checkpoints=stride_checkpoints(len(tokens)))
    return Prompt(
        tokenizer.decode(prompt), list(prompt), checkpoints=stride_checkpoints(len(prompt))
    )
