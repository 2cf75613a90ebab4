"""Split streamed model text into reasoning and answer at ``<think>``/``</think>`` markers.

Qwen3.5's generation prompt opens the think block itself, so output starts inside reasoning
and only the closing marker appears in it. Markers may arrive split across chunks; they never
reach either field.
"""

from __future__ import annotations

from typing import Any

from dflash_server.generation.request import Reasoning


def think_markers(tokenizer: Any) -> tuple[str, str]:
    """The model's reasoning markers (mlx-lm infers them from the vocabulary)."""
    start = getattr(tokenizer, "think_start", None) or "<think>"
    end = getattr(tokenizer, "think_end", None) or "</think>"
    return start, end


def prompt_reasoning(tokenizer: Any, prompt_text: str) -> Reasoning:
    """Whether a rendered prompt leaves a think block open, and the one token that closes it.

    Qwen3.5 ends its generation prompt with "<think>\n" when thinking is on: the output then
    begins inside reasoning. With thinking off the prompt closes the block itself.
    """
    start, end = think_markers(tokenizer)
    if prompt_text.rfind(start) <= prompt_text.rfind(end):
        return Reasoning(opens=False)
    try:  # mlx-lm raises for multi-token markers: then no token-level gating
        think_end = getattr(tokenizer, "think_end_id", None)
    except ValueError:
        think_end = None
    return Reasoning(opens=True, think_end=think_end)


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that could be the start of one of ``markers``."""
    longest = max(len(m) for m in markers)
    if "<" not in text[-longest:] and not any(m[0] in text[-longest:] for m in markers):
        return 0  # fast path: no marker can start in the tail
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if marker.startswith(text[-n:]):
                best = n
                break
    return best


class ReasoningSplitter:
    """Incremental splitter: ``feed`` each chunk, then ``finish`` once.

    ``in_reasoning`` says whether the prompt left a think block open. Outside reasoning a
    ``<think>`` (a model that thinks although asked not to) opens one, and a stray ``</think>``
    is dropped. Whitespace right after a marker is dropped, as the template puts it there.
    """

    def __init__(self, in_reasoning: bool, start: str = "<think>", end: str = "</think>") -> None:
        self.in_reasoning = in_reasoning
        self.start, self.end = start, end
        self._pending = ""
        self._strip = True  # at the start of a section

    def feed(self, text: str) -> tuple[str, str]:
        """Return (reasoning, content) text that is safe to emit now."""
        reasoning: list[str] = []
        content: list[str] = []
        buf = self._pending + text
        self._pending = ""
        while buf:
            markers = (self.end,) if self.in_reasoning else (self.start, self.end)
            hits = [(buf.find(m), m) for m in markers if m in buf]
            if hits:
                idx, marker = min(hits)
                self._emit(buf[:idx], reasoning, content)
                buf = buf[idx + len(marker) :]
                # Closing ends reasoning; opening starts it; a stray closer in content is dropped.
                self.in_reasoning = marker == self.start
                self._strip = True
                continue
            keep = _partial_suffix(buf, markers)
            self._emit(buf[: len(buf) - keep], reasoning, content)
            self._pending = buf[len(buf) - keep :]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """Flush text held back as a possible marker prefix."""
        reasoning: list[str] = []
        content: list[str] = []
        self._emit(self._pending, reasoning, content)
        self._pending = ""
        return "".join(reasoning), "".join(content)

    def _emit(self, piece: str, reasoning: list[str], content: list[str]) -> None:
        if self._strip:
            piece = piece.lstrip()
            if not piece:
                return
            self._strip = False
        (reasoning if self.in_reasoning else content).append(piece)


def split_reasoning(text: str, in_reasoning: bool) -> tuple[str, str]:
    """Whole-text version of ReasoningSplitter (for non-streamed responses and tests)."""
    splitter = ReasoningSplitter(in_reasoning)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.finish()
    return r1 + r2, c1 + c2
