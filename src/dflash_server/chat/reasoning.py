"""Split streamed model text into reasoning and answer at ``<think>``/``</think>`` markers.

Qwen3.5's generation prompt opens the think block itself, so output starts inside reasoning
and only the closing marker appears in it. Markers may arrive split across chunks; they never
reach either field. With thinking off they are not parsed at all: plain text of the answer.
"""

from __future__ import annotations

from typing import Any, Literal

from dflash_server.generation.request import Reasoning

Segment = tuple[Literal["reasoning", "content"], str]  # text of one kind, in output order


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
    """Incremental splitter: ``feed`` each chunk, then ``finish`` once; both return the text as
    segments in output order.

    ``in_reasoning`` says whether the prompt left a think block open. Outside reasoning a
    ``<think>`` (a template that lets the model open it, or reasoning resumed mid-answer) opens
    one, and a stray ``</think>`` is dropped. Whitespace right after a marker is dropped, as the template puts it there.
    ``thinking`` False (the request turned thinking off): no marker is parsed, the whole output
    is content, markers included, so a client that asked for no reasoning never gets any.
    """

    def __init__(
        self,
        in_reasoning: bool,
        start: str = "<think>",
        end: str = "</think>",
        thinking: bool = True,
    ) -> None:
        self.in_reasoning = in_reasoning and thinking
        self.start, self.end = start, end
        self.thinking = thinking
        self._pending = ""
        self._strip = True  # at the start of a section

    def _markers(self) -> tuple[str, ...]:
        if not self.thinking:
            return ()
        return (self.end,) if self.in_reasoning else (self.start, self.end)

    def feed(self, text: str) -> list[Segment]:
        """The segments that are safe to emit now."""
        out: list[Segment] = []
        buf = self._pending + text
        self._pending = ""
        while buf:
            markers = self._markers()
            hits = [(buf.find(m), m) for m in markers if m in buf]
            if hits:
                idx, marker = min(hits)
                self._emit(buf[:idx], out)
                buf = buf[idx + len(marker) :]
                # Closing ends reasoning; opening starts it; a stray closer in content is dropped.
                self.in_reasoning = marker == self.start
                self._strip = True
                continue
            keep = _partial_suffix(buf, markers) if markers else 0
            self._emit(buf[: len(buf) - keep], out)
            self._pending = buf[len(buf) - keep :]
            break
        return out

    def finish(self) -> list[Segment]:
        """Flush text held back as a possible marker prefix."""
        out: list[Segment] = []
        self._emit(self._pending, out)
        self._pending = ""
        return out

    def _emit(self, piece: str, out: list[Segment]) -> None:
        if self._strip:
            piece = piece.lstrip()
            if not piece:
                return
            self._strip = False
        out.append(("reasoning" if self.in_reasoning else "content", piece))


def joined(segments: list[Segment]) -> tuple[str, str]:
    """(reasoning, content): the segments' text of each kind."""
    reasoning = "".join(text for kind, text in segments if kind == "reasoning")
    return reasoning, "".join(text for kind, text in segments if kind == "content")


def split_reasoning(text: str, in_reasoning: bool) -> tuple[str, str]:
    """Whole-text version of ReasoningSplitter (for non-streamed responses and tests)."""
    splitter = ReasoningSplitter(in_reasoning)
    return joined(splitter.feed(text) + splitter.finish())
