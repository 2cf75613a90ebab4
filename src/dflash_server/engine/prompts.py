"""Turn chat messages or a raw prompt into token ids, with the tokenizer's own chat template."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class PromptError(ValueError):
    """The template rejected the conversation (e.g. roles out of order); shown to the client."""


@dataclass(frozen=True)
class Prompt:
    """A rendered prompt and whether it leaves a think block open for the model to close."""

    text: str
    tokens: list[int]
    opens_reasoning: bool = False


def think_markers(tokenizer: Any) -> tuple[str, str]:
    """The model's reasoning markers (mlx-lm infers them from the vocabulary)."""
    start = getattr(tokenizer, "think_start", None) or "<think>"
    end = getattr(tokenizer, "think_end", None) or "</think>"
    return start, end


def encode(tokenizer: Any, text: str) -> list[int]:
    """Tokenize like mlx-lm's generate does, so HTTP and Python API see the same ids."""
    bos = getattr(tokenizer, "bos_token", None)
    return list(tokenizer.encode(text, add_special_tokens=bos is None or not text.startswith(bos)))


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
    start, end = think_markers(tokenizer)
    # Qwen3.5 ends its generation prompt with "<think>\n" when thinking is on: the output then
    # begins inside reasoning. With thinking off the prompt closes the block itself.
    opens = text.rfind(start) > text.rfind(end)
    return Prompt(text, encode(tokenizer, text), opens)


def render_completion(tokenizer: Any, prompt: str | list[int]) -> Prompt:
    """A raw prompt: text is tokenized as is; token ids pass through."""
    if isinstance(prompt, str):
        return Prompt(prompt, encode(tokenizer, prompt))
    return Prompt(tokenizer.decode(prompt), list(prompt))
