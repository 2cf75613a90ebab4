"""``POST /v1/embeddings`` (docs/api.md, "Embeddings"): OpenAI's request and answer over an
embeddings model of the models file. Inputs are a string, strings, token ids or lists of token
ids (at most 2,048 inputs); vectors come back in input order, unit length (``dimensions``:
the first so many, normalised again), as floats or base64 of little-endian float32."""

from __future__ import annotations

import asyncio
import base64
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from dflash_server.api.deps import MetricsDep, ModelsDep
from dflash_server.api.errors import APIError
from dflash_server.api.model_access import find_model, wait_for
from dflash_server.engine.embeddings import EmbeddingJob
from dflash_server.engine.model_slots import EMBEDDINGS
from dflash_server.models.embedding import EmbeddingModel

router = APIRouter()
MAX_INPUTS = 2048  # OpenAI's limit on one request's inputs


class EmbeddingsRequest(BaseModel):
    """OpenAI's embeddings request (``user`` and unknown fields are accepted and unused)."""

    model_config = ConfigDict(extra="allow")
    input: Any = Field(description="a string, strings, token ids, or lists of token ids")
    model: str | None = Field(None, description="an embeddings model's id or alias")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, description="the vectors' width: their first N values")
    user: str | None = None


def _bad(message: str, param: str = "input") -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def _inputs(raw: Any) -> list[str] | list[list[int]]:
    """The request's inputs, checked: texts, or token-id lists."""
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise _bad("input must be a non-empty string or array")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        raw = [raw]  # one input given as its token ids
    if len(raw) > MAX_INPUTS:
        raise _bad(f"input holds {len(raw)} items; at most {MAX_INPUTS} are allowed")
    if all(isinstance(t, str) for t in raw):
        if any(not t for t in raw):
            raise _bad("input must not hold an empty string")
        return list(raw)
    for i, item in enumerate(raw):
        ints = isinstance(item, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in item
        )
        if not ints or not item:
            raise _bad(
                f"input[{i}] is neither a string nor a non-empty list of token ids: an input "
                "array holds strings only, or token-id lists only"
            )
    return [list(item) for item in raw]


def _tokens(model: EmbeddingModel, inputs: list[str] | list[list[int]]) -> list[list[int]]:
    """Each input's token ids, checked against the vocabulary and the context."""
    rows = [model.encode(t) if isinstance(t, str) else t for t in inputs]
    for i, row in enumerate(rows):
        if any(not 0 <= t < model.vocab_size for t in row):
            raise _bad(f"input[{i}]: token ids must be in [0, {model.vocab_size})")
        if len(row) > model.context_length:
            raise APIError(
                400,
                f"This model's maximum context length is {model.context_length} tokens, "
                f"however input[{i}] has {len(row)} tokens. Please reduce the input's length.",
                param="input",
                code="context_length_exceeded",
            )
    return rows


def _encoded(vector: np.ndarray, dimensions: int | None, fmt: str) -> list[float] | str:
    if dimensions is not None:  # Matryoshka truncation, then unit length again
        vector = vector[:dimensions]
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    vector = vector.astype("<f4")
    if fmt == "base64":
        return base64.b64encode(vector.tobytes()).decode("ascii")
    return [float(x) for x in vector]


@router.post("/v1/embeddings")
async def embeddings(
    body: EmbeddingsRequest, request: Request, models: ModelsDep, metrics: MetricsDep
) -> dict[str, Any]:
    inputs = _inputs(body.input)
    slot = find_model(models, body.model, EMBEDDINGS)
    seen = models.lease(slot)
    job: EmbeddingJob | None = None
    try:
        await wait_for(models, slot, seen, request)
        embedder = slot.embedder
        if embedder is None or embedder.model is None:
            raise APIError(503, f"model {slot.id!r} is not loaded", code="model_not_ready")
        model = embedder.model
        if body.dimensions is not None and not 1 <= body.dimensions <= model.dimensions:
            raise _bad(f"dimensions must be in [1, {model.dimensions}]", "dimensions")
        rows = await run_in_threadpool(_tokens, model, inputs)
        job = EmbeddingJob(rows)
        embedder.submit(job)
        try:
            vectors = await job.result()
        except RuntimeError as exc:
            raise APIError(500, str(exc), code="embedding_failed") from exc
    except asyncio.CancelledError:
        if job is not None:
            job.cancelled = True
        raise
    finally:
        models.release(slot)
    tokens = sum(len(r) for r in rows)
    if metrics is not None:
        metrics.embedded(slot.id, len(rows), tokens)
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": _encoded(v, body.dimensions, body.encoding_format),
        }
        for i, v in enumerate(vectors)
    ]
    return {
        "object": "list",
        "data": data,
        "model": body.model or slot.id,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
