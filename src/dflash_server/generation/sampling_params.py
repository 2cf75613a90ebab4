"""The sampling fields: one pydantic model, no MLX, so that the settings and the CLI's flags
(generated from it) load without the numerical stack."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_INT = 2**31 - 1


class SamplingParams(BaseModel):
    """The single definition of every sampling field and its bounds.

    HTTP requests (all optional), ``Settings`` defaults and the CLI flags are generated from these
    fields (``SERVED_FIELDS``); the Python API passes them by keyword.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(0.0, ge=0, le=2, description="sampling temperature (0: greedy)")
    top_p: float = Field(
        1.0, ge=0, le=1, description="keep the most likely tokens up to this mass (0: the top one)"
    )
    top_k: int = Field(
        0, ge=-1, le=MAX_INT, description="keep the k most likely tokens (0 or -1: off)"
    )
    min_p: float = Field(
        0.0, ge=0, le=1, description="drop tokens less likely than min_p times the best"
    )
    repetition_penalty: float | None = Field(
        None, gt=0, description="penalise recent tokens multiplicatively (1: off)"
    )
    presence_penalty: float | None = Field(
        None, ge=-2, le=2, description="subtract from the logits of recent tokens"
    )
    frequency_penalty: float | None = Field(
        None, ge=-2, le=2, description="subtract per occurrence in recent tokens"
    )
    penalty_context_size: int = Field(20, gt=0, description="tokens the penalties look back over")
    logit_bias: dict[int, float] | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k_off(cls, value: int) -> int:
        return max(0, value)  # -1 (vLLM's "off") and 0 mean the same

    @field_validator("temperature")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("temperature must be a finite number")
        return value

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# The fields a request may set and the server has defaults for (the rest is Python API only).
_PYTHON_ONLY = ("logit_bias", "penalty_context_size")
SERVED_FIELDS = tuple(n for n in SamplingParams.model_fields if n not in _PYTHON_ONLY)
