"""Per-token log-probabilities in OpenAI's shapes (chat ``content`` entries, legacy completions).

The values come from the core (the target's processed distribution at each emitted position);
this module only names the tokens. Byte-level BPE tokens can be parts of a UTF-8 character, so
each entry also carries the token's exact bytes, as OpenAI does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

MAX_TOP_LOGPROBS = 20


def hf_tokenizer(tokenizer: Any) -> Any:
    """The Hugging Face tokenizer behind mlx-lm's wrapper (which itself has a Rust one)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable-character table, reversed (used by byte-level BPE vocabs)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenTexts:
    """Token id -> (display string, bytes), cached; one per tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.hf = hf_tokenizer(tokenizer)
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        hit = self.cache.get(token)
        if hit is None:
            hit = self.cache[token] = self._lookup(token)
        return hit

    def _lookup(self, token: int) -> tuple[str, list[int]]:
        piece = self.hf.convert_ids_to_tokens(token)
        decoder = _byte_decoder()
        if isinstance(piece, str) and piece and all(c in decoder for c in piece):
            raw = bytes(decoder[c] for c in piece)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:  # part of a character: show the bytes
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            # Special tokens are stored verbatim, not byte-mapped; decode says which it is.
            if text != piece and self.hf.decode([token]) == piece:
                text, raw = piece, piece.encode()
            return text, list(raw)
        text = self.hf.decode([token]) if piece is not None else ""
        return text, list(text.encode())


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token: its string, bytes, log-probability and best alternatives."""

    token: str
    bytes: list[int]
    logprob: float
    top: list[tuple[str, list[int], float]]


def token_logprobs(
    texts: TokenTexts,
    tokens: Sequence[int],
    logprobs: Sequence[float] | None,
    top: Sequence[Sequence[tuple[int, float]]] | None,
) -> list[TokenLogprob]:
    """Name the core's per-token values (``GenerationResponse.logprobs/top_logprobs``)."""
    if logprobs is None:
        return []
    out = []
    for i, (token, value) in enumerate(zip(tokens, logprobs)):
        alts = top[i] if top is not None and i < len(top) else []
        # Tokens a grammar forbids (-inf) are no alternatives; OpenAI never lists them either.
        named = [(*texts(t), float(v)) for t, v in alts if v > -math.inf]
        out.append(TokenLogprob(*texts(token), float(value), named))
    return out


def _clean(value: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number (masked tokens have probability 0).
    return value if value > -9999.0 else -9999.0


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """``choices[i].logprobs`` of a chat completion (or of one stream chunk)."""
    return {
        "content": [
            {
                "token": e.token,
                "logprob": _clean(e.logprob),
                "bytes": e.bytes,
                "top_logprobs": [
                    {"token": t, "logprob": _clean(v), "bytes": b} for t, b, v in e.top
                ],
            }
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(entries: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """``choices[i].logprobs`` of a legacy completion; ``offset``: characters already sent."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [_clean(e.logprob) for e in entries],
        "top_logprobs": [{t: _clean(v) for t, _, v in e.top} for e in entries],
        "text_offset": offsets,
    }
