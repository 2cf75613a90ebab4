"""One generation request, built once at the boundary (HTTP or Python API) and read by the core."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from dflash_server.drafters.protocol import Drafter
from dflash_server.generation.protocols import ConstraintSpec, TokenConstraint
from dflash_server.generation.sampling import SamplingParams, fresh_entropy
from dflash_server.models.vision import ImageInput

if TYPE_CHECKING:
    import mlx.core as mx


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
class BlockPolicy:
    """How many positions each cycle verifies: ``width`` (1: plain decoding, no drafter pass,
    else 2..the drafter's trained block); with ``auto``, ``width`` is the widest, and a
    controller picks 1..width each cycle from the observed acceptance and measured costs.
    ``suffix`` > 0 lets that controller also verify up to so many tokens copied from the
    context (suffix drafts; with ``auto`` or plain decoding only: it needs the costs)."""

    width: int = 1
    auto: bool = False
    suffix: int = 0

    def __post_init__(self) -> None:
        if self.width < 1:
            raise ValueError(f"block_size must be >= 1, got {self.width}")
        if self.suffix < 0:
            raise ValueError(f"suffix tokens must be >= 0, got {self.suffix}")

    @property
    def copies(self) -> bool:
        """Whether suffix drafts run (they need the controller: "auto", or plain decoding)."""
        return self.suffix > 0 and (self.auto or self.width == 1)


PLAIN = BlockPolicy(1)


@dataclass(frozen=True)
class GenerationRequest:
    """Everything one generation needs besides the models; frozen, passed unchanged down."""

    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    block: BlockPolicy = PLAIN
    logprobs: int | None = None  # alternatives per token; None: no logprobs
    constraint: ConstraintSpec | None = None
    reasoning: Reasoning = field(default_factory=Reasoning)
    # Prompt positions a prefix cache should keep recurrent state at (message boundaries).
    checkpoints: tuple[int, ...] = ()
    # An mlx-lm style sampler (logprobs -> tokens), Python API only: replaces the sampling rule.
    sampler: Callable[[mx.array], mx.array] | None = None
    # Leave control tokens out of the text (the server's default; see text.hidden_tokens).
    skip_special_tokens: bool = False
    # The prompt's images, in order; each fills its run of image tokens in ``prompt``.
    images: tuple[ImageInput, ...] = ()
    # Seeds the draws of a request without ``seed``, drawn once, here: every rank that runs the
    # request draws alike (engine/lockstep.py). Unlike a seed it pins no widths.
    entropy: int = field(default_factory=fresh_entropy, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("prompt is empty: give at least one token")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")

    @property
    def speculative(self) -> bool:
        """Whether the drafter runs at all."""
        return self.block.width > 1


def trained_block(draft: Drafter | None) -> int | None:
    """The block ``draft`` was trained on (its widest verify); None without a drafter."""
    return None if draft is None else int(draft.config.block_size)


def block_size_for(trained: int | None, requested: int | None, *, clamp: bool = False) -> int:
    """The verify width for ``requested`` with a drafter trained on ``trained``-wide blocks
    (None: no drafter, width 1); its trained block when None. Out of range raises ValueError
    naming the range, or is clamped into it."""
    if trained is None:
        return 1
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
    trained: int | None, requested: BlockSize | None, *, clamp: bool = False
) -> BlockPolicy:
    """The policy for a requested block size with a drafter trained on ``trained``-wide blocks
    (None: no drafter, always plain decoding): "auto" adapts per cycle up to the trained block;
    a number (or None, the trained block) is fixed. A bad number raises or is clamped as in
    ``block_size_for``."""
    if trained is None:
        return PLAIN
    if requested == AUTO:
        return BlockPolicy(trained, auto=True)
    if isinstance(requested, str):
        raise ValueError(f"block_size must be a number or 'auto', got {requested!r}")
    return BlockPolicy(block_size_for(trained, requested, clamp=clamp))
