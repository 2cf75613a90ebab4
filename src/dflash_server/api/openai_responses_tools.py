"""Responses API tools: function tools, namespaces of them, and hosted tools left out.

* ``function`` tools are the chat API's function tools.
* ``namespace`` tools group function tools (Codex sends its MCP servers and sub-agent tools
  this way). The model sees each one as a plain function named ``<namespace>__<name>`` (the
  double underscore Codex itself uses for MCP tools; no separator when the namespace already
  ends in '_'), and a call to it goes back out as a ``function_call`` item with ``name`` and
  ``namespace`` apart, as OpenAI returns it and Codex routes it.
* Hosted tools (web search, file search, code interpreter, ...) run on OpenAI's side; this
  server cannot run them, so they are left out of the prompt and named in the
  ``x-dflash-ignored-tools`` response header and the log. Only a tool_choice that forces one
  of them is refused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from dflash_server.api.errors import APIError
from dflash_server.api.tool_checks import check_function, check_tool_name

HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "web_search_2025_08_26",
        "file_search",
        "code_interpreter",
        "image_generation",
        "computer",
        "computer_use",
        "computer_use_preview",
        "mcp",
        "local_shell",
        "shell",
        "apply_patch",
        "tool_search",
    }
)
IGNORED_HEADER = "x-dflash-ignored-tools"
log = logging.getLogger("dflash_server")


def flat_name(namespace: str, name: str) -> str:
    """The function name the model sees for ``name`` in ``namespace``."""
    return f"{namespace}{name}" if namespace.endswith("_") else f"{namespace}__{name}"


@dataclass
class ResponseTools:
    """A request's tools as chat function tools, and what was left out or renamed."""

    functions: list[dict[str, Any]] = field(default_factory=list)  # chat function tools
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)  # flat -> (ns, name)
    ignored: list[str] = field(default_factory=list)  # hosted tool types left out

    def split(self, flat: str) -> tuple[str, str | None]:
        """(name, namespace) of a call to ``flat`` as the client knows it."""
        found = self.namespaced.get(flat)
        return (found[1], found[0]) if found else (flat, None)

    def flat(self, name: str, namespace: str | None) -> str:
        """The prompt's name for a call from the history (``namespace`` may be None)."""
        return flat_name(namespace, name) if namespace else name


def _function(tool: dict[str, Any], where: str) -> dict[str, Any]:
    check_function(tool.get("name"), tool.get("parameters"), f"{where}.name", f"{where}.parameters")
    if tool.get("description") is not None and not isinstance(tool["description"], str):
        raise APIError(400, f"{where}.description must be a string", param=f"{where}.description")
    keys = ("name", "description", "parameters", "strict")
    return {"type": "function", "function": {k: tool[k] for k in keys if k in tool}}


def response_tools(tools: list[dict[str, Any]] | None) -> ResponseTools:
    """Translate ``tools`` (400 naming the tool for anything malformed)."""
    out = ResponseTools()
    names: set[str] = set()
    for i, tool in enumerate(tools or []):
        kind, where = tool.get("type"), f"tools.{i}"
        if not isinstance(kind, str):
            raise APIError(400, f"{where}.type must be a string", param=f"{where}.type")
        if kind in HOSTED_TOOLS:
            out.ignored.append(kind)
            continue
        if kind == "function":
            fns = [_function(tool, where)]
        elif kind == "namespace":
            ns = check_tool_name(tool.get("name"), f"{where}.name")
            inner = tool.get("tools")
            if not isinstance(inner, list):
                raise APIError(400, f"{where}.tools must be a list", param=f"{where}.tools")
            fns = []
            for j, sub in enumerate(inner):
                at = f"{where}.tools.{j}"
                if not isinstance(sub, dict) or sub.get("type") != "function":
                    raise APIError(
                        400,
                        f"{at}: only function tools are supported inside a namespace",
                        param=at,
                        code="unsupported_tool",
                    )
                fn = _function(sub, at)
                flat = check_tool_name(flat_name(ns, fn["function"]["name"]), f"{at}.name")
                out.namespaced[flat] = (ns, fn["function"]["name"])
                fn["function"]["name"] = flat
                fns.append(fn)
        else:
            raise APIError(
                400,
                f"tool type {kind!r} is not supported: function and namespace tools are "
                f"(hosted tools are left out: {', '.join(sorted(HOSTED_TOOLS))})",
                param=where,
                code="unsupported_tool",
            )
        for fn in fns:
            name = fn["function"]["name"]
            if name in names:
                raise APIError(400, f"{where}: tool name {name!r} is used twice", param=where)
            names.add(name)
        out.functions += fns
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None, tools: ResponseTools) -> Any:
    """The chat tool_choice for a Responses ``tool_choice`` (400 when it is not one, or
    forces a tool this server cannot run)."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    kind = choice.get("type") if isinstance(choice, dict) else None
    if isinstance(kind, str) and kind in HOSTED_TOOLS:
        raise APIError(
            400,
            f"tool_choice forces the hosted tool {kind!r}, which this server cannot run",
            param="tool_choice",
            code="unsupported_tool",
        )
    if isinstance(choice, dict) and kind == "function" and isinstance(choice.get("name"), str):
        name = tools.flat(choice["name"], choice.get("namespace"))
        if name not in tools.namespaced and choice.get("namespace") is None:
            # A bare name that only a namespace holds: that one.
            matches = [f for f, (_, n) in tools.namespaced.items() if n == name]
            name = matches[0] if len(matches) == 1 else name
        return {"type": "function", "function": {"name": name}}
    raise APIError(
        400,
        "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
        param="tool_choice",
        code="invalid_value",
    )


def ignored_tools_header(tools: ResponseTools) -> dict[str, str]:
    """The response header naming the hosted tools left out (logged once per request)."""
    if not tools.ignored:
        return {}
    names = ",".join(dict.fromkeys(tools.ignored))
    log.info("responses: left out hosted tools this server cannot run: %s", names)
    return {IGNORED_HEADER: names}
