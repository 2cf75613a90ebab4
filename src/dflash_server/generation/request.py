"""One generation request, built once at the boundary (HTTP or Python API) and read by the core."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from dflash_server.generation.sampling import SamplingParams, TokenConstraint

if TYPE_CHECKING:
    import mlx.core as mx


class ConstraintSpec(Protocol):
    """What a request carries to restrict its tokens; built into a stateful matcher per run."""

    def build(self, tokenizer: Any) -> TokenConstraint: ...


@dataclass(frozen=True)
class Prebuilt:
    """A constraint object the caller made itself (Python API): used as is, once."""

    constraint: TokenConstraint

    def build(self, tokenizer: Any) -> TokenConstraint:
        return self.constraint


@dataclass(frozen=True)
class Reasoning:
    """Whether the prompt leaves a think block open, and the token that closes it (if one)."""

    opens: bool = False
    think_end: int | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """Everything one generation needs besides the models; frozen, passed unchanged down.

    ``block_size`` is the number of positions verified per cycle: 1 is plain decoding (no
    drafter pass), otherwise 2..the drafter's trained block (see ``block_size_for``). With
    ``adaptive`` (``block_size: "auto"``) it is the widest block: a controller picks 1..it each
    cycle from the observed acceptance and the measured cycle costs.
    """

    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    block_size: int = 1
    adaptive: bool = False
    logprobs: int | None = None  # alternatives per token; None: no logprobs
    constraint: ConstraintSpec | None = None
    reasoning: Reasoning = field(default_factory=Reasoning)
    # Prompt positions a prefix cache should keep recurrent state at (message boundaries).
    checkpoints: tuple[int, ...] = ()
    # An mlx-lm style sampler (logprobs -> tokens), Python API only: replaces the sampling rule.
    sampler: Callable[[mx.array], mx.array] | None = None
    # Leave control tokens out of the text (the server's default; see stream.hidden_tokens).
    skip_special_tokens: bool = False

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("prompt is empty: give at least one token")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    @property
    def speculative(self) -> bool:
        """Whether the drafter runs at all."""
        return self.block_size > 1


def block_size_for(draft: Any | None, requested: int | None, *, clamp: bool = False) -> int:
    """The verify width for ``requested`` with this drafter: 1 without one, its trained block
    when None. Out of range raises ValueError naming the range, or is clamped into it."""
    if draft is None:
        return 1
    trained = int(draft.config.block_size)
    if requested is None:
        return trained
    if clamp:
        return max(2, min(int(requested), trained))
    if not 2 <= requested <= trained:
        raise ValueError(f"block_size must be in [2, {trained}] for this drafter, got {requested}")
    return int(requested)


BlockSize = int | Literal["auto"]
AUTO = "auto"


def block_policy(
    draft: Any | None, requested: BlockSize | None, *, clamp: bool = False
) -> tuple[int, bool]:
    """``(block_size, adaptive)`` for a requested block size: "auto" is the drafter's trained
    block, adapted per cycle; a number (or None, the trained block) is fixed. Without a drafter
    always ``(1, False)``. A bad number raises or is clamped as in ``block_size_for``."""
    if draft is None:
        return 1, False
    if requested == AUTO:
        return block_size_for(draft, None), True
    if isinstance(requested, str):
        raise ValueError(f"block_size must be a number or 'auto', got {requested!r}")
    return block_size_for(draft, requested, clamp=clamp), False
