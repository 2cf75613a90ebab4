"""Write openai_subset.json: the schemas the conformance tests check, from OpenAI's OpenAPI spec.

Source: github.com/openai/openai-openapi (MIT, see LICENSE-openai-openapi), ``openapi.json``.
Usage: ``python tests/openapi/extract.py path/to/openapi.json [commit]``. Keeps the named schemas and
everything they reference; drops descriptions and examples (they are most of the size) and writes ``nullable`` as a null
type, which JSON Schema validators understand.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOTS = (
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionResponse",
    "ListModelsResponse",
    "Model",
    "ErrorResponse",
    "Response",
    "ResponseStreamEvent",
)
DROP = {"description", "example", "examples", "x-oaiMeta", "x-oaiTypeLabel", "x-oaiExpandable"}


def _strip(node: Any, names: bool = False) -> Any:
    """``node`` without documentation keys (``names``: a mapping of property names, kept)."""
    if isinstance(node, list):
        return [_strip(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if not names and key in DROP:
            continue
        out[key] = _strip(value, names=key in ("properties", "patternProperties") and not names)
    return out if names else _nullable(out)


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAPI 3.0's ``nullable: true`` (still used in places) as JSON Schema's null type."""
    if not schema.pop("nullable", False):
        return schema
    if isinstance(schema.get("type"), str) and "$ref" not in schema:
        if "enum" in schema:
            schema["enum"] = [*schema["enum"], None]
        return {**schema, "type": [schema["type"], "null"]}
    return {"anyOf": [schema, {"type": "null"}]}


def extract(spec: dict[str, Any], commit: str = "") -> dict[str, Any]:
    schemas = spec["components"]["schemas"]
    keep: dict[str, Any] = {}
    todo = list(ROOTS)
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep[name] = _strip(schemas[name])
        text = json.dumps(schemas[name])
        for part in text.split('"#/components/schemas/')[1:]:
            todo.append(part.split('"', 1)[0])
    version = spec.get("info", {}).get("version")
    source = f"openai-openapi {version} {commit}".strip()
    return {"source": source, "components": {"schemas": keep}}


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(__file__).with_name("openai_subset.json")
    commit = sys.argv[2] if len(sys.argv) > 2 else ""
    out.write_text(json.dumps(extract(spec, commit), separators=(",", ":"), sort_keys=True) + "\n")
    print(f"{out}: {out.stat().st_size} bytes")
