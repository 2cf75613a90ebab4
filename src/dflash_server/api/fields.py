"""Top-level request fields the server does not act on: accepted and named, or a typo's 400.

A request model declares the fields the server implements; a translating protocol (Messages,
Responses) also passes on the DFlash extensions. Any other top-level field is accepted, as
local clients send extra fields freely (Open WebUI passes on every custom parameter a user
sets, LangChain and LiteLLM their own) and a 400 would break them: it is named in the
``x-dflash-ignored-fields`` response header and the log (percent-encoded where a name holds
what a header cannot, and bounded: docs/api.md, "Unknown fields"), a warning when the protocol
does not define it (a field the protocol defines, like OpenAI's ``user`` or Codex's
``prompt_cache_key``, is bookkeeping: logged at info). The exception is a near miss: an unknown
field that is an implemented one but for case and separators (``maxTokens``), or one edit away
from one of 7+ characters (``max_token``), is a typo whose intent would be lost, so it is a
400 that names the field meant. Features that would change the answer and cannot be honoured
are refused elsewhere (``types.unsupported_features``, the protocols' own checks).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from urllib.parse import quote

from fastapi import Request
from pydantic import BaseModel

from dflash_server.api.errors import APIError

IGNORED_FIELDS_HEADER = "x-dflash-ignored-fields"
OMITTED_FIELDS_HEADER = "x-dflash-ignored-fields-omitted"  # how many names did not fit
# The names' most characters in the header: proxies refuse a response whose headers pass one
# buffer (nginx: 4 KiB by default), and a body may hold thousands of names.
MAX_HEADER_CHARS = 1024
log = logging.getLogger("dflash_server")

# What each protocol defines besides the fields this server implements (from the official
# SDKs' create parameters): never taken for a typo. Other servers' grammar fields are refused
# when set (types.py) and ignored when null.
_FOREIGN = {"guided_json", "guided_regex", "guided_choice", "guided_grammar", "grammar"}
_FOREIGN |= {"structured_outputs", "json_schema"}
_OPENAI = {"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"}
_OPENAI |= {"prompt_cache_retention", "prompt_cache_options", "moderation"}
CHAT_SPEC = frozenset(
    _OPENAI | _FOREIGN | {"audio", "modalities", "prediction", "verbosity", "web_search_options"}
)
COMPLETION_SPEC = frozenset(_OPENAI | _FOREIGN)
RESPONSES_SPEC = frozenset(
    _OPENAI
    | {"background", "background_options", "conversation", "prompt", "context_management"}
    | {"max_tool_calls", "stream_options", "image", "access_programs"}
)
MESSAGES_SPEC = frozenset(
    {"container", "context_management", "mcp_servers", "service_tier", "inference_geo"}
    | {"cache_control", "speed", "diagnostics", "betas", "compaction", "fallbacks", "thread"}
    | {"user_profile_id", "workspace_id", "billing_policy", "fallback_credit_token"}
    | {"max_tokens", "stop_sequences", "stream", "temperature", "top_p", "top_k"}  # count_tokens
    | {"output_config", "metadata"}
)


def ignored_fields(
    req: BaseModel, spec: frozenset[str], request: Request, passed_on: Iterable[str] = ()
) -> dict[str, str]:
    """The response header naming ``req``'s top-level fields the server does not act on (none
    when there are none), logged; a 400 for one that looks like a typo of an implemented field.
    ``spec``: what the protocol defines besides; ``passed_on``: extra fields it translates."""
    implemented = {*type(req).model_fields, *passed_on}
    ignored = [name for name in req.model_extra or {} if name not in implemented]
    unknown = [name for name in ignored if name not in spec]
    for name in unknown:
        meant = near_miss(name, implemented)
        if meant is not None:
            raise APIError(
                400,
                f"unknown field {name!r}; did you mean {meant!r}?",
                param=name,
                code="unknown_parameter",
            )
    if not ignored:
        return {}
    listed, omitted = header_names(ignored)
    request_id = getattr(request.state, "request_id", "-")
    level, kind = (logging.WARNING, "unknown") if unknown else (logging.INFO, "unused")
    more = f" (and {omitted} more)" if omitted else ""
    log.log(level, "request %s: ignored %s fields: %s%s", request_id, kind, listed, more)
    header = {IGNORED_FIELDS_HEADER: listed}
    return header | ({OMITTED_FIELDS_HEADER: str(omitted)} if omitted else {})


def header_names(names: list[str]) -> tuple[str, int]:
    """``names`` as one header value: each percent-encoded as UTF-8 but for letters, digits and
    ``-._~`` (so a name never brings a comma, a control character or non-latin-1 text into the
    header or the log), comma-separated in order while within ``MAX_HEADER_CHARS``; and how
    many names did not fit."""
    listed: list[str] = []
    size = omitted = 0
    for name in names:
        encoded = quote(name, safe="", errors="replace")  # a lone surrogate was a 400 already
        if size + len(encoded) + bool(listed) > MAX_HEADER_CHARS:
            omitted += 1
            continue
        size += len(encoded) + bool(listed)
        listed.append(encoded)
    return ",".join(listed), omitted


def near_miss(name: str, fields: Iterable[str]) -> str | None:
    """The field ``name`` probably meant: the same but for case, '-' and '_' (``maxTokens``),
    or one edit away from a name of 7+ characters (``max_token``, ``temprature``)."""
    squashed = _squash(name)
    for field in sorted(fields):
        if _squash(field) == squashed or (len(field) >= 7 and _one_edit(name, field)):
            return field
    return None


def _squash(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "")


def _one_edit(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` differ by one inserted, deleted, replaced or swapped character."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    swapped = a[i : i + 2] == b[i : i + 2][::-1] and a[i + 2 :] == b[i + 2 :]
    return a[i + 1 :] == b[i:] or a[i:] == b[i + 1 :] or a[i + 1 :] == b[i + 1 :] or swapped
