"""Token ids <-> text for generation: prompt encoding, and commits -> text with stop strings
(text-level termination; token-level termination is the decoder's)."""

from __future__ import annotations

import contextlib
import re
import weakref
from collections.abc import Sequence
from typing import cast

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

from dflash_server.generation.speculative import Commit


def encode(tokenizer: TokenizerWrapper, prompt: str | Sequence[int] | mx.array) -> list[int]:
    """Token ids of a prompt, tokenized like mlx-lm's generate (BOS added unless present)."""
    if isinstance(prompt, str):
        bos = getattr(tokenizer, "bos_token", None)
        add_special = bos is None or not prompt.startswith(bos)
        return list(tokenizer.encode(prompt, add_special_tokens=add_special))
    ids = cast("list[int]", prompt.tolist()) if isinstance(prompt, mx.array) else list(prompt)
    return [int(t) for t in ids]


class StopMatcher:
    """Holds back text that could still become a stop string; never emits past one."""

    def __init__(self, stop: Sequence[str]):
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Add text; return (text safe to emit, the stop string hit first, if any)."""
        self.pending += text
        hits = [(at, s) for s in self.stop if (at := self.pending.find(s)) >= 0]
        if hits:
            at, stop = min(hits)
            out, self.pending = self.pending[:at], ""
            return out, stop
        cut = max(0, len(self.pending) - self.hold)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, None

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


# Markup the server parses out of answers (chat/reasoning.py, chat/tool_calls.py): kept.
PARSED_MARKERS = frozenset({"<think>", "</think>", "<tool_call>", "</tool_call>"})
_TAG = re.compile(r"<[^<>\s]+>")  # a control token's shape: <|im_start|>, <tool_response>
_HIDDEN: weakref.WeakKeyDictionary[object, frozenset[int]] = weakref.WeakKeyDictionary()


def hidden_tokens(tokenizer: TokenizerWrapper) -> frozenset[int]:
    """Ids whose text answers leave out, as vLLM's ``skip_special_tokens``: the tokenizer's
    added tokens that are special or shaped like a tag, but the markers the server parses."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    cached = _HIDDEN.get(hf)
    if cached is None:
        keep = set(PARSED_MARKERS)
        for name in ("think_start", "think_end", "tool_call_start", "tool_call_end"):
            with contextlib.suppress(AttributeError, ValueError):
                keep.add(getattr(tokenizer, name) or "")
        added = getattr(hf, "added_tokens_decoder", None) or {}
        cached = frozenset(
            int(i)
            for i, t in added.items()
            if (t.special or _TAG.fullmatch(t.content)) and t.content not in keep
        )
        _HIDDEN[hf] = cached
    return cached


class TextStream:
    """Token commits -> text: the detokenizer plus stop strings (text-level termination).

    ``hidden``: token ids left out of the text (see ``hidden_tokens``); they still count as
    tokens, with an empty piece.
    """

    def __init__(
        self, tokenizer: TokenizerWrapper, stop: Sequence[str], hidden: frozenset[int] = frozenset()
    ) -> None:
        self.detokenizer = tokenizer.detokenizer
        self.detokenizer.reset()
        self.stops = StopMatcher(stop)
        self.hidden = hidden
        self.hit: str | None = None  # the stop string that ended the text
        self.pieces: list[str] = []  # each token's own text in the last ``feed`` (detokenized)

    def feed(self, commit: Commit) -> tuple[str, int, str | None]:
        """(text safe to emit, tokens it covers, finish reason or None)."""
        text, finish, self.pieces = "", commit.finish, []
        for n, token in enumerate(commit.tokens, 1):
            if token in self.hidden:
                self.pieces.append("")
                continue
            self.detokenizer.add_token(token)
            self.pieces.append(self.detokenizer.last_segment)
            segment, self.hit = self.stops.feed(self.pieces[-1])
            text += segment
            if self.hit is not None:
                return text, n, "stop"
        if finish is not None:  # flush held-back bytes and text
            self.detokenizer.finalize()
            held = self.detokenizer.last_segment  # reading it consumes it
            if self.pieces:  # bytes held back by the detokenizer belong to the last token
                self.pieces[-1] += held
            tail, self.hit = self.stops.feed(held)
            text += tail if self.hit is not None else tail + self.stops.flush()
            finish = "stop" if self.hit is not None else finish
        return text, len(commit.tokens), finish
