"""Per-request speculation counters: the ``dflash`` object of a response, and the log line."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dflash_server.adaptive.policy import SOURCES, Source


@dataclass
class SpeculativeStats:
    """Counters of one request. ``tau`` is committed tokens per cycle (plain steps included);
    ``block_size_histogram[B]`` counts drafter cycles of ``B`` positions (1: plain steps, no
    drafter), ``acceptance_histogram`` their accepted drafts; ``sources`` counts cycles,
    committed tokens and the widest cycle by source (drafter, suffix copies, plain steps)."""

    block_size: int  # the widest block this request may use
    adaptive: bool = False  # block_size "auto": the controller picks each cycle's width
    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    acceptance_histogram: list[int] = field(default_factory=list)  # index = accepted drafts
    block_size_histogram: list[int] = field(default_factory=list)  # index = block size
    plain_tokens: int = 0  # tokens committed by plain steps
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache
    prefill_s: float = 0.0  # seconds until the first token
    sources: dict[str, dict[str, int]] = field(
        default_factory=lambda: {s: {"cycles": 0, "tokens": 0, "widest": 0} for s in SOURCES}
    )
    timings: dict[str, float] | None = None  # seconds per phase, only when profiling
    batch_histogram: dict[int, int] = field(default_factory=dict)  # rows in a pass -> passes
    estimator: Callable[[], dict[str, Any] | None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.acceptance_histogram:
            self.acceptance_histogram = [0] * max(self.block_size, 1)
        if not self.block_size_histogram:
            self.block_size_histogram = [0] * (max(self.block_size, 1) + 1)

    @property
    def tau(self) -> float:
        return (self.accepted + self.cycles) / self.cycles if self.cycles else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def plain_share(self) -> float:
        """The share of committed tokens that plain steps produced."""
        tokens = self.accepted + self.cycles
        return self.plain_tokens / tokens if tokens else 0.0

    def record(self, size: int, accepted: int, source: Source = "drafter") -> None:
        """One cycle of ``size`` positions (``size - 1`` drafts) kept ``accepted`` drafts."""
        self.cycles += 1
        self.drafted += size - 1
        self.accepted += accepted
        if size == 1:
            source = "plain"
            self.plain_tokens += 1
        counts = self.sources[source]
        counts["cycles"] += 1
        counts["tokens"] += accepted + 1
        counts["widest"] = max(counts["widest"], size)
        if source != "suffix":  # suffix copies may be wider than the drafter's block
            self.acceptance_histogram[accepted] += 1
            self.block_size_histogram[size] += 1

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "block_size": self.block_size,
            "block_policy": "auto" if self.adaptive else "fixed",
            "cycles": self.cycles,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tau": round(self.tau, 4),
            "acceptance_histogram": list(self.acceptance_histogram),
            "block_size_histogram": list(self.block_size_histogram),
            "plain_share": round(self.plain_share, 4),
            "sources": {s: dict(c) for s, c in self.sources.items()},
            "cached_tokens": self.cached_tokens,
            "prefill_s": round(self.prefill_s, 4),
        }
        if self.batch_histogram:
            out["batch_histogram"] = dict(sorted(self.batch_histogram.items()))
        estimate = self.estimator() if self.estimator is not None else None
        if estimate is not None:
            out["controller"] = estimate
        if self.timings is not None:
            out["timings"] = {k: round(v, 6) for k, v in self.timings.items()}
        return out

    def batches(self) -> str:
        """The batch sizes the request ran in (rows x passes), for the log line."""
        if not self.batch_histogram:
            return ""
        sizes = ", ".join(f"{n}x{c}" for n, c in sorted(self.batch_histogram.items()))
        return f", batch rows {sizes}"

    def summary(self) -> str:
        """The speculation part of the per-request log line."""
        copied = self.sources["suffix"]
        suffix = f", suffix {copied['tokens']} tokens in {copied['cycles']} cycles"
        if self.block_size <= 1:
            return "plain decoding" + (suffix if copied["cycles"] else "") + self.batches()
        used = ", ".join(f"{b}x{n}" for b, n in enumerate(self.block_size_histogram) if n and b > 0)
        policy = "auto" if self.adaptive else "fixed"
        text = f"tau {self.tau:.2f}, blocks ({policy}) {used or '-'}, plain {self.plain_share:.0%}"
        text += suffix if copied["cycles"] else ""
        estimate = self.estimator() if self.estimator is not None else None
        if estimate:
            text += (
                f", controller: B={estimate['block_size']} "
                f"E[tau]={estimate['expected_tau']:.2f} x{estimate['expected_speedup']:.2f}"
            )
        return text + self.batches()
