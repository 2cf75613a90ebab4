"""Turn chat messages or a raw prompt into token ids, with the tokenizer's own chat template."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflash_server.engine.reasoning import prompt_reasoning
from dflash_server.generation.request import Reasoning
from dflash_server.generation.stream import encode


class PromptError(ValueError):
    """The template rejected the conversation (e.g. roles out of order); shown to the client."""


@dataclass(frozen=True)
class Prompt:
    """A rendered prompt and whether it leaves a think block open for the model to close."""

    text: str
    tokens: list[int]
    reasoning: Reasoning = field(default_factory=Reasoning)

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
) -> Prompt:
    """Apply the chat template with the generation prompt; detect an open think block.

    ``tools`` (OpenAI function tools) are rendered by the template itself, as the model was
    trained to see them.
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
    return Prompt(text, encode(tokenizer, text), prompt_reasoning(tokenizer, text))


def render_completion(tokenizer: Any, prompt: str | list[int]) -> Prompt:
    """A raw prompt: text is tokenized as is; token ids pass through."""
    if isinstance(prompt, str):
        return Prompt(prompt, encode(tokenizer, prompt))
    return Prompt(tokenizer.decode(prompt), list(prompt))
