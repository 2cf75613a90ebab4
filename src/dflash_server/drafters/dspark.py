"""DSpark drafters (DeepSeek's DeepSpec): a DFlash backbone plus a Markov head and a confidence head.

The backbone is DFlash's (``dflash.py``): one pass over ``[anchor, mask, ...]`` with the
committed positions' tapped features injected as keys and values, bidirectional in the block.
Two differences in what comes out of it (docs/design.md, "Drafter families"):

* Every block position predicts the token after it, the anchor's included ("sample from
  anchor"): a block of ``P`` positions proposes ``P`` tokens, so it is verified ``P + 1`` wide
  (the checkpoint's ``block_size`` counts proposals).
* A *Markov head* makes each position's distribution depend on the token drafted before it:
  ``logits_i = base_i + W2 (W1 [token at i-1])`` (``W1: [V, r]``, ``W2: [r, V]``, rank 256; the
  ``gated`` and ``rnn`` kinds gate that term or carry a state along the block), the anchor
  before the first, so the block is drawn left to right; the q of each draft is that
  conditional law, which sampled acceptance needs.
* A *confidence head*, ``sigmoid(proj([h_i ; W1[token at i-1]]))``, predicts each draft's
  acceptance; with a threshold a block ends before its first draft below it (DeepSpec's
  evaluator; its default threshold, 0, keeps blocks whole).

Its embedding and LM head are its own when the checkpoint carries them (DeepSpec's copies of the
target's), else the target's (SpecForge exports may omit them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from dflash_server.drafters.config import DFlashConfig, dflash_kwargs
from dflash_server.drafters.dflash import DFlashDraftModel, TargetHead
from dflash_server.drafters.protocol import Drafted, DraftRow, Family
from dflash_server.drafters.stepwise import Walk
from dflash_server.models.loading import load_arrays, load_checkpoint

MARKOV_KINDS = ("vanilla", "gated", "rnn")


@dataclass
class DSparkConfig(DFlashConfig):
    """DFlash's fields (``block_size``: the verify width, proposals + 1) and the DSpark heads'."""

    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = True
    sample_from_anchor: bool = True
    confidence_threshold: float = 0.0  # end a block before its first draft less confident
    own_embedding: bool = False  # the checkpoint carries embed_tokens (else the target's)
    own_head: bool = False  # ... and lm_head

    def __post_init__(self) -> None:
        super().__post_init__()
        problems = []
        if self.markov_head_type not in MARKOV_KINDS:
            problems.append(f"markov_head_type {self.markov_head_type!r} (one of {MARKOV_KINDS})")
        if self.markov_rank < 0:
            problems.append(f"markov_rank {self.markov_rank} (must be >= 0)")
        if (
            self.enable_confidence_head
            and self.confidence_head_with_markov
            and not self.markov_rank
        ):
            problems.append("a confidence head with Markov features but no Markov head")
        if not 0.0 <= self.confidence_threshold <= 1.0:
            problems.append(f"confidence_threshold {self.confidence_threshold} (0..1)")
        if problems:
            raise ValueError("DSpark drafter config: unsupported " + "; ".join(problems))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], weights: Sequence[str] = ()) -> DSparkConfig:
        """Either packaging: DeepSpec's (``Qwen3DSparkModel``, keys at the top level) or
        SpecForge's (``dflash_config.projector_type: "dspark"``); ``weights``: the tensor
        names, which say whether it carries its own embedding and head."""
        dflash = cfg.get("dflash_config") or {}

        def key(name: str, default: Any) -> Any:
            return dflash.get(name, cfg.get(name, default))

        if cfg.get("attention_bias"):
            raise ValueError("DSpark drafter config: attention_bias is not supported")
        proposals = key("block_size", None)
        if proposals is None:
            raise ValueError("DSpark drafter config.json is missing required key: block_size")
        # The checkpoint's block counts proposals, unless it says the anchor is one of them.
        width = int(proposals) + (0 if key("dspark_bonus_anchor", False) else 1)
        fields = dflash_kwargs(cfg)
        fields["block_size"] = width
        fields["is_causal"] = bool(key("causal", key("is_causal", False)))
        names = set(weights)
        return cls(
            **fields,
            markov_rank=int(key("markov_rank", 256)),
            markov_head_type=str(key("markov_head_type", "vanilla")).lower(),
            enable_confidence_head=bool(key("enable_confidence_head", False)),
            confidence_head_with_markov=bool(key("confidence_head_with_markov", True)),
            sample_from_anchor=bool(key("sample_from_anchor", True)),
            confidence_threshold=float(key("confidence_threshold", 0.0)),
            own_embedding="embed_tokens.weight" in names,
            own_head="lm_head.weight" in names,
        )


class MarkovHead(nn.Module):
    """The sequential head: a bias on each position's logits from the token drafted before it,
    ``W2 (g * W1 [previous])``. ``vanilla``: g = 1; ``gated``: g = sigmoid(gate([h_i ; W1[prev]]));
    ``rnn``: a GRU-like state carried along the block (DeepSpec's ``markov_head.py``)."""

    def __init__(self, kind: str, vocab_size: int, rank: int, hidden: int):
        super().__init__()
        self.kind = kind
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def step(
        self, previous: mx.array, hidden: mx.array, state: mx.array | None
    ) -> tuple[mx.array, mx.array | None]:
        """The bias ([R, V]) for one position of R rows (``previous``: [R] tokens, ``hidden``:
        [R, H] backbone states), and the state carried to the next position (rnn only)."""
        embedded = self.markov_w1(previous)
        if self.kind == "gated":
            gate = mx.sigmoid(self.gate_proj(mx.concatenate([hidden, embedded], axis=-1)))
            return self.markov_w2(gate.astype(embedded.dtype) * embedded), None
        if self.kind == "rnn":
            state = mx.zeros_like(embedded) if state is None else state
            joint = self.joint_proj(mx.concatenate([state, embedded, hidden], axis=-1))
            gate, candidate, output = mx.split(joint, 3, axis=-1)
            gate = mx.sigmoid(gate)
            state = gate * state + (1.0 - gate) * mx.tanh(candidate)
            return self.markov_w2(mx.tanh(output)), state
        return self.markov_w2(embedded), None


class ConfidenceHead(nn.Module):
    """Predicted acceptance of each draft, ``sigmoid(proj(features))``."""

    def __init__(self, features: int):
        super().__init__()
        self.proj = nn.Linear(features, 1, bias=True)

    def __call__(self, features: mx.array) -> mx.array:
        return mx.sigmoid(self.proj(features)[..., 0].astype(mx.float32))


class DSparkDraftModel(DFlashDraftModel):
    """A DSpark drafter: DFlash's backbone and context, its own heads (module docstring)."""

    config: DSparkConfig
    markov_head: MarkovHead | None
    confidence_head: ConfidenceHead | None

    def __init__(self, config: DSparkConfig):
        super().__init__(config, family="DSpark")
        vocab, hidden = config.vocab_size or 0, config.hidden_size
        if config.own_embedding:
            self.embed_tokens = nn.Embedding(vocab, hidden)
        if config.own_head:
            self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.markov_head = None
        if config.markov_rank:
            self.markov_head = MarkovHead(
                config.markov_head_type, vocab, config.markov_rank, hidden
            )
        self.confidence_head = None
        if config.enable_confidence_head:
            rank = config.markov_rank if config.confidence_head_with_markov else 0
            self.confidence_head = ConfidenceHead(hidden + rank)

    def bind(self, target: nn.Module) -> DSparkDraftModel:
        """The target's parts checked as DFlash's are; its own embedding or head, where the
        checkpoint has them, in place of the target's."""
        super().bind(target)
        head = self.target_head()
        config = self.config
        own_embed = self.embed_tokens if config.own_embedding else head.embed_tokens
        own_head = self.lm_head if config.own_head else head.lm_head
        self.head = TargetHead(own_embed, own_head, head.multiplier, head.cap)
        return self

    def propose(self, rows: Sequence[DraftRow]) -> list[Drafted]:
        """Every row's backbone in one pass, then the drafts drawn left to right, all rows at
        each position together (each draft's q conditioned on the one before); a row's block
        is cut where the confidence head says so when a threshold is set."""
        # With "sample from anchor" every position predicts the token after it: one fewer.
        anchored = self.config.sample_from_anchor
        blocks = (
            [replace_block(row, row.block[:, : row.width - 1]) for row in rows]
            if anchored
            else rows
        )
        states = self.block_states(blocks)
        n_max = max(row.width for row in rows) - 1
        hidden = states[:, :n_max] if anchored else states[:, 1 : n_max + 1]
        base = self.target_head().logits(hidden)
        walk, confidence, state = Walk(rows), [], None
        for i in range(walk.steps):
            logits, previous = base[:, i], walk.last
            if self.markov_head is not None:
                bias, state = self.markov_head.step(previous, hidden[:, i], state)
                logits = logits + bias
            if self.confidence_head is not None:
                confidence.append(self._confidence(hidden[:, i], previous))
            walk.draw(logits)
        if confidence and self.config.confidence_threshold > 0:
            return self._cut(walk.drafted(), mx.stack(confidence, axis=1))
        return walk.drafted()

    def _confidence(self, hidden: mx.array, previous: mx.array) -> mx.array:
        assert self.confidence_head is not None
        features = hidden
        if self.config.confidence_head_with_markov and self.markov_head is not None:
            embedded = self.markov_head.markov_w1(previous)
            features = mx.concatenate([hidden, embedded], axis=-1)
        return self.confidence_head(features)

    def _cut(self, out: list[Drafted], confidence: mx.array) -> list[Drafted]:
        """Each row's drafts before its first one whose confidence falls below the threshold
        (none at all: a plain step), as DeepSpec's evaluator cuts; a host sync."""
        below = np.array(confidence < self.config.confidence_threshold)
        cut = []
        for (tokens, log_q), flags in zip(out, below):
            n = tokens.shape[0]
            keep = int(np.argmax(flags[:n])) if flags[:n].any() else n
            cut.append((tokens[:keep], None if log_q is None else log_q[:keep]))
        return cut


def replace_block(row: DraftRow, block: mx.array) -> DraftRow:
    return DraftRow(block, row.cache, row.sampler, row.history)


def _weights(path: Path) -> dict[str, mx.array]:
    """The folder's tensors, named as the model names them (a ``model.`` prefix dropped, the
    rotary buffers some exports carry left out)."""
    out: dict[str, mx.array] = {}
    for f in sorted(path.glob("*.safetensors")):
        for key, value in load_arrays(f).items():
            if "rotary_emb" not in key:
                out[key.removeprefix("model.")] = value
    if not out:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return out


def _load(path: Path, raw: dict[str, Any], target: nn.Module | None) -> DSparkDraftModel:
    weights = _weights(path)
    model = DSparkDraftModel(DSparkConfig.from_dict(raw, list(weights)))
    load_checkpoint(model, path, raw, source=f"{path} (DSpark layout)", weights=weights)
    return model if target is None else model.bind(target)


def _claims(raw: dict[str, Any]) -> bool:
    """DeepSpec's ``Qwen3DSparkModel`` (older exports: ``DSparkDraftModel``), SpecForge's
    ``projector_type: "dspark"``, or a DFlash-named config that carries a Markov head."""
    dflash = raw.get("dflash_config") or {}
    architecture = str((raw.get("architectures") or [""])[0])
    return (
        "DSpark" in architecture
        or dflash.get("projector_type") == "dspark"
        or "markov_rank" in raw
        or "markov_rank" in dflash
    )


FAMILY = Family(
    "DSpark", _claims, _load, "Qwen3DSparkModel or dflash_config.projector_type 'dspark' (DSpark)"
)
