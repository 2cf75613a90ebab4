"""Structured output with llguidance: JSON schemas and tool-call envelopes as token masks.

``GrammarConstraint`` implements the core's ``TokenConstraint``: for each verify block it asks
llguidance for the masks along the drafted path (llguidance advances over the drafts and rolls
itself back), and only committed tokens advance it for good. So grammar-constrained decoding stays
speculative and exactly follows the target's masked distribution.

While a reasoning block is open (Qwen3.5 with thinking on), the grammar waits: reasoning is free
text, and the grammar starts after the think-end token, as the answer is what must parse. Only
the end tokens are refused while reasoning, so the answer cannot end before the grammar had its
turn (the thinking budget, see budget.py, closes reasoning that would never end).
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from dflash_server.chat.logprobs import hf_tokenizer

try:  # optional at import time so the rest of the server works without it
    import llguidance
except ImportError:  # pragma: no cover - llguidance is a declared dependency
    llguidance = None  # type: ignore[assignment]

# Whitespace between JSON tokens: flexible, but bounded, so a model cannot loop on newlines
# forever (a known failure of unbounded JSON whitespace with small or quantized models).
JSON_WHITESPACE = r"(?: {0,2}|\r?\n[ \t]{0,32})"
_LEADING_WS = r"/[ \t\r\n]{0,8}/"


class StructuredOutputError(ValueError):
    """A schema or format the grammar engine cannot enforce; the message names the feature."""


def _require() -> Any:
    if llguidance is None:
        raise StructuredOutputError("structured output needs the 'llguidance' package")
    return llguidance


# ----- tokenizers ----------------------------------------------------------------------------

_LL_TOKENIZERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def ll_tokenizer(tokenizer: Any) -> Any:
    """llguidance's view of ``tokenizer`` (built once per tokenizer: ~1 s for a 250k vocab)."""
    llg = _require()
    import llguidance.hf

    hf = hf_tokenizer(tokenizer)
    with _LOCK:
        cached = _LL_TOKENIZERS.get(hf)
        if cached is None:
            eos = sorted(getattr(tokenizer, "eos_token_ids", None) or {hf.eos_token_id})
            try:
                cached = llguidance.hf.from_tokenizer(hf, eos_token=eos)
            except ValueError as exc:  # slow (non-Rust) tokenizers
                raise StructuredOutputError(f"structured output: {exc}") from exc
            _LL_TOKENIZERS[hf] = cached
    assert isinstance(cached, llg.LLTokenizer)
    return cached


# ----- grammars ------------------------------------------------------------------------------


def _json_grammar(schema: dict[str, Any]) -> str:
    """Lark: optional leading whitespace, then one JSON value matching ``schema``."""
    schema = dict(schema)
    options = dict(schema.get("x-guidance") or {})
    options.setdefault("whitespace_pattern", JSON_WHITESPACE)
    schema["x-guidance"] = options
    return f"start: {_LEADING_WS} %json {json.dumps(schema)}"


def response_format_grammar(response_format: dict[str, Any] | None) -> str | None:
    """Grammar for an OpenAI ``response_format`` (None for plain text)."""
    if not response_format:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return _json_grammar({"type": "object"})
    if kind != "json_schema":
        raise StructuredOutputError(
            f"response_format type {kind!r} is not supported; use text, json_object or json_schema"
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise StructuredOutputError("response_format.json_schema must be an object")
    schema = spec.get("schema", {"type": "object"})  # OpenAI: no schema means any object
    if not isinstance(schema, dict):
        raise StructuredOutputError("response_format.json_schema.schema must be an object")
    return _json_grammar(schema)


def _marker(ll: Any, tokenizer: Any, text: str) -> str:
    """A lark item for a markup string: by id if it is one special token, else as text."""
    ids = hf_tokenizer(tokenizer).encode(text, add_special_tokens=False)
    if len(ids) == 1 and ll.is_special_token(ids[0]):
        return f"<[{ids[0]}]>"
    return json.dumps(text)


def _value(schema: Any) -> str:
    """Lark for one parameter value as the XML format writes it (strings raw, others JSON)."""
    if not isinstance(schema, dict):
        schema = {}
    if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
        return "(" + " | ".join(json.dumps(v) for v in schema["enum"]) + ")"
    if schema.get("type") == "string":
        # One line without '<': the lexer cannot tell text from the closing tag otherwise.
        limit = schema.get("maxLength")
        return "/[^<\\n]" + ("*" if limit is None else f"{{0,{int(limit)}}}") + "/"
    if not schema.get("type") and not any(k in schema for k in ("anyOf", "oneOf", "enum")):
        schema = {"type": ["number", "boolean", "object", "array", "null"]}
    return "%json " + json.dumps({**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}})


_PARAM_END = "\n</parameter>\n"


def _call_rule(name: str, parameters: Any) -> str:
    """Lark for one complete call: known parameters in schema order, the required ones always."""
    params = parameters if isinstance(parameters, dict) else {}
    required = set(params.get("required") or [])
    items = []
    for key, sub in (params.get("properties") or {}).items():
        opening = json.dumps(f"<parameter={key}>\n")
        item = f"({opening} {_value(sub)} {json.dumps(_PARAM_END)})"
        items.append(item if key in required else item + "?")
    head, tail = json.dumps(f"\n<function={name}>\n"), json.dumps("</function>\n")
    return " ".join([head, *items, tail])


def tool_call_grammar(
    tokenizer: Any, tools: Sequence[dict[str, Any]], names: Sequence[str], parallel: bool = True
) -> str:
    """Lark forcing the answer to be Qwen3.5 tool calls to ``names`` (tool_choice).

    Each call is complete and its values have their schema's type; strings are kept to one
    line without '<' (a limit of forcing, not of the parser).
    """
    from dflash_server.chat.tool_calls import tool_schemas

    ll = ll_tokenizer(tokenizer)
    open_, close = _marker(ll, tokenizer, "<tool_call>"), _marker(ll, tokenizer, "</tool_call>")
    schemas = tool_schemas(tools)
    calls = " | ".join(f"({_call_rule(n, schemas.get(n))})" for n in names)
    more = f' ("\\n" {open_} call {close})*' if parallel else ""
    return f"start: {_LEADING_WS} {open_} call {close}{more}\ncall: {calls}\n"


def check_grammar(tokenizer: Any, grammar: str) -> None:
    """Raise StructuredOutputError with llguidance's message if it cannot compile ``grammar``."""
    llg = _require()
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(
        llg.LLMatcher.grammar_from_lark(grammar), ll_tokenizer(tokenizer)
    )
    if is_error:
        detail = "; ".join(m.strip() for m in messages) or "invalid grammar"
        raise StructuredOutputError(f"schema not supported by the grammar engine: {detail}")


# ----- the constraint ------------------------------------------------------------------------


class GrammarConstraint:
    """``TokenConstraint`` over an llguidance matcher; see the module docstring.

    ``think_end``: the think-end token id when the prompt leaves reasoning open; the grammar
    applies from the token after it (every token but the end tokens is allowed before).
    """

    def __init__(self, tokenizer: Any, grammar: str, think_end: int | None = None):
        llg = _require()
        self.ll = ll_tokenizer(tokenizer)
        self.matcher = llg.LLMatcher(self.ll, llg.LLMatcher.grammar_from_lark(grammar))
        if self.matcher.is_error():
            raise StructuredOutputError(self.matcher.get_error())
        self.executor = llg.LLExecutor(1)  # one request at a time: no worker threads needed
        self.width = self.ll.vocab_size
        self.words = (self.width + 31) // 32
        self.think_end = think_end
        self.reasoning = think_end is not None
        self.rows = 0  # masks computed, for the benchmark's cost per row
        self.ends = sorted(t for t in self.ll.eos_tokens if 0 <= t < self.width)
        self._reasoning_row: mx.array | None = None  # built on the worker thread (MLX streams)

    def allowed(self, drafts: Sequence[int]) -> mx.array | None:
        drafts = list(drafts)
        n = len(drafts) + 1
        # -1 = all bits set: rows after a rejected draft allow all, and so do the rows before the
        # grammar starts, but for the end tokens (cleared below).
        buf = np.full((n, self.words), -1, dtype=np.int32)
        start = 0
        if self.reasoning:
            if self.think_end not in drafts:
                return self._while_reasoning(n)  # reasoning along the whole path
            start = drafts.index(self.think_end) + 1
            reasoning_rows = buf[:start].view(np.uint32)
            for end in self.ends:  # the rows up to the think-end token: no end token
                reasoning_rows[:, end // 32] &= np.uint32(~(1 << (end % 32)) & 0xFFFFFFFF)
        path = drafts[start:]
        # Ids past the tokenizer (spare embedding rows) are never allowed; llguidance would
        # treat them as an error, so the path stops there (later rows are unused anyway).
        bad = [i for i, t in enumerate(path) if not 0 <= t < self.width]
        path = path[: bad[0]] if bad else path
        # Masks for row `start` and each draft after it; llguidance advances along the path
        # while the drafts are allowed, then rolls back, leaving the committed state as it was.
        if path:
            self.executor.unsafe_compute_mask_ptr_with_draft_token(
                [(self.matcher, start, path)], buf.ctypes.data, self.words * 4, n
            )
        else:
            self.matcher.unsafe_compute_mask_ptr(buf[start:].ctypes.data, self.words * 4)
        self.rows += n - start
        words = mx.array(buf.view(np.uint32))
        # Arrays are made here, not at import: MLX streams belong to the thread that runs this.
        bits = (words[:, :, None] >> mx.arange(32, dtype=mx.uint32)) & 1
        return bits.reshape(n, -1)[:, : self.width].astype(mx.bool_)

    def _while_reasoning(self, n: int) -> mx.array:
        """``n`` rows of free reasoning: every token but the end tokens."""
        if self._reasoning_row is None:
            ids = mx.arange(self.width)
            row = mx.ones((self.width,), dtype=mx.bool_)
            for end in self.ends:
                row = row & (ids != end)
            self._reasoning_row = row
        return mx.broadcast_to(self._reasoning_row[None], (n, self.width))

    def commit(self, tokens: Sequence[int]) -> None:
        tokens = list(tokens)
        if self.reasoning:
            if self.think_end not in tokens:
                return
            tokens = tokens[tokens.index(self.think_end) + 1 :]
            self.reasoning = False
        done = self.matcher.try_consume_tokens(tokens) if tokens else 0
        # A finished grammar stops itself; only the EOS that ends generation may follow.
        rest = set(tokens[done:]) - set(self.ll.eos_tokens)
        if rest or self.matcher.is_error():
            # Only reachable if the masks were not applied: a bug, not a model error.
            raise RuntimeError(f"grammar rejected committed tokens: {self.matcher.get_error()}")


@dataclass(frozen=True)
class Grammar:
    """A request's grammar (lark text); built into a matcher on the worker, where MLX runs.

    With ``think_end`` set the prompt left reasoning open: the grammar starts after that token.
    """

    text: str
    think_end: int | None = None

    def build(self, tokenizer: Any) -> GrammarConstraint:
        return GrammarConstraint(tokenizer, self.text, self.think_end)
