"""Tool definitions checked at the boundary, the same way on all three APIs.

A tool's name is written into the prompt (``<function=NAME>``) and into the grammar that
forces a call, and its parameters become that grammar: a name with markup characters or a
parameters value that is not a JSON Schema must be a 400 naming the field, never a failure
deep in the template, the grammar compiler or the generation.
"""

from __future__ import annotations

import re
from typing import Any

import jsonschema
from jsonschema.exceptions import SchemaError

from dflash_server.api.errors import APIError

# The characters both OpenAI and Anthropic allow in tool names, plus '.' (namespaced tools);
# 128 is Anthropic's limit (OpenAI's is 64). Anything else could break the call markup.
TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def check_tool_name(name: Any, param: str) -> str:
    """``name`` if the template and the call parser can carry it, else a 400."""
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise APIError(
            400,
            f"{param}: invalid tool name {str(name)[:80]!r}: use 1-128 characters of "
            "A-Z, a-z, 0-9, '_', '.' and '-'",
            param=param,
            code="invalid_value",
        )
    return name


def check_parameters(schema: Any, param: str, *, object_only: bool = True) -> None:
    """400 unless ``schema`` is a JSON Schema (checked against its meta-schema); with
    ``object_only``, the schema of a call's arguments: an object, parameter names writable."""
    if schema is None:
        return
    if not isinstance(schema, dict):
        raise APIError(
            400,
            f"{param} must be a JSON Schema object, got {type(schema).__name__}",
            param=param,
            code="invalid_value",
        )
    if not isinstance(schema.get("$schema", ""), str):
        raise APIError(400, f"{param}.$schema must be a string", param=f"{param}.$schema")
    validator = jsonschema.validators.validator_for(schema, jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except RecursionError as exc:
        raise APIError(
            400, f"{param} is nested too deeply", param=param, code="invalid_schema"
        ) from exc
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise APIError(
            400,
            f"{param} is not a valid JSON Schema: {exc.message}"
            + (f" (at {where})" if where else ""),
            param=param,
            code="invalid_schema",
        ) from exc
    if not object_only:
        return
    if schema.get("type", "object") != "object":
        raise APIError(
            400,
            f"{param} must have type 'object' (the arguments of a call), "
            f"got {schema.get('type')!r}",
            param=param,
            code="invalid_schema",
        )
    for key in schema.get("properties") or {}:
        if any(c in key for c in "<>\n") or not key:
            raise APIError(
                400,
                f"{param}.properties: parameter name {key[:80]!r} cannot be written in a call "
                "(no '<', '>' or line breaks)",
                param=f"{param}.properties",
                code="invalid_schema",
            )


def check_function(name: Any, parameters: Any, name_param: str, params_param: str) -> None:
    """A function tool's name and parameters, each named in the 400 by its own field."""
    check_tool_name(name, name_param)
    check_parameters(parameters, params_param)
