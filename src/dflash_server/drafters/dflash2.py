"""DFlash2 drafters: DFlash plus dynamic convolutions and a Markov candidate selector.

Same context path as DFlash (``hidden_norm(fc(taps))`` injected as keys/values, a context-only
cache), with two additions (z-lab's DFlash2, e.g. Qwen3.8-27B-DFlash2, Muse-Glimmer-30B-DFlash2):

* every sublayer (attention, MLP) is wrapped in a causal grouped *dynamic convolution* over block
  positions: ``prepare`` convolves the normed input with ``base_kernel[0]`` plus per-position
  coefficients projected from that input, ``finish`` convolves the sublayer output with
  ``base_kernel[1]`` plus the second half of those coefficients;
* a *candidate selector* replaces argmax over the logits: the top-k tokens of each block row are
  re-scored by ``<predecessor[prev] * hidden_projection(h), successor[candidate]>`` and walked
  left to right from the anchor token, still inside the one drafter pass.

Parameter names are the published checkpoints' (81 tensors for 5 layers). The two codebooks are
plain ``[V, r]`` matrices named without ``.weight``, exactly as stored; the loader maps the
``.weight`` spelling some MLX exports use back onto them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from dflash_server.drafters.config import DFlashConfig, dflash2_kwargs
from dflash_server.drafters.dflash import Context, DFlashDecoderLayer, DFlashDraftModel
from dflash_server.drafters.protocol import Drafted, DraftRow, DraftSampler, Family
from dflash_server.models.loading import load_checkpoint

# Kept in higher precision by ``quant_predicate``: the conv projections set multiplicative
# per-position kernels, the selector's scores add to logits; together ~5 % of a layer's weights.
HIGH_PRECISION = ("attention_conv", "mlp_conv", "candidate_selector")


@dataclass
class DFlash2Config(DFlashConfig):
    """DFlash's fields plus the DFlash2 keys of ``dflash_config`` (published: 2, 16, 256, 16)."""

    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        problems = []
        if self.conv_kernel_size < 1:
            problems.append(f"conv_kernel_size must be >= 1, got {self.conv_kernel_size}")
        if self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
            problems.append(
                f"conv_group_size {self.conv_group_size} must divide hidden_size {self.hidden_size}"
            )
        if self.selector_rank < 1:
            problems.append(f"selector_rank must be >= 1, got {self.selector_rank}")
        if not 1 <= self.selector_top_k <= (self.vocab_size or self.selector_top_k):
            problems.append(f"selector_top_k must be in [1, vocab_size], got {self.selector_top_k}")
        if problems:
            raise ValueError("DFlash2 drafter config: " + "; ".join(problems))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> DFlash2Config:
        """Parse a DFlash2 ``config.json``; a missing key raises a ValueError naming it."""
        return cls(**dflash2_kwargs(cfg))

    def to_dict(self) -> dict[str, Any]:
        """The published DFlash2 layout: block, conv, selector and logit keys in dflash_config."""
        out = super().to_dict()
        out["architectures"] = ["DFlash2DraftModel"]
        dflash = out.pop("dflash_config")
        dflash["block_size"] = out.pop("block_size")
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            dflash[key] = out.pop(key)
        for key in ("output_multiplier", "final_logit_softcapping", "input_embedding_scale"):
            if key in out:
                dflash[key] = out.pop(key)
        return {**out, "dflash_config": dflash}


class GroupedDynamicConv(nn.Module):
    """Causal grouped dynamic convolution over block positions.

    Output at t is ``sum_o (base_kernel[side, o] + coef[t, o, group]) * x[t - o]``: one learned
    kernel per channel, plus one coefficient per position, tap and group of ``group_size``
    channels; taps before the block start see zeros (the block never convolves its context).
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = mx.zeros((2, kernel_size, hidden_size))  # side 0: prepare, 1: finish
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def _convolve(self, x: mx.array, coef: mx.array, side: int) -> mx.array:
        B, L, H = x.shape
        blocks = x.reshape(B, L, self.groups, self.group_size)
        out = mx.zeros_like(blocks)
        for o in range(min(self.kernel_size, L)):
            shifted = blocks if o == 0 else mx.pad(blocks[:, :-o], [(0, 0), (o, 0), (0, 0), (0, 0)])
            base = self.base_kernel[side, o].reshape(self.groups, self.group_size)
            out = out + (base.astype(x.dtype) + coef[:, :, o, :, None]) * shifted
        return out.reshape(B, L, H)

    def prepare(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """Convolve the normed sublayer input; return it and the coefficients ``finish`` needs."""
        B, L, _ = x.shape
        coef = self.kernel_projection(x).reshape(B, L, 2, self.kernel_size, self.groups)
        return self._convolve(x, coef[:, :, 0], 0), coef[:, :, 1]

    def finish(self, x: mx.array, coef: mx.array) -> mx.array:
        return self._convolve(x, coef, 1)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    def __init__(self, config: DFlash2Config, layer_idx: int, causal: bool = False):
        super().__init__(config, layer_idx, causal)
        args = (config.hidden_size, config.conv_kernel_size, config.conv_group_size)
        self.attention_conv = GroupedDynamicConv(*args)
        self.mlp_conv = GroupedDynamicConv(*args)

    def __call__(self, x: mx.array, context: Context) -> mx.array:
        h, coef = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(h, context), coef)
        h, coef = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), coef)


class CandidateSelector(nn.Module):
    """Top-k candidates per block row, re-scored by a first-order Markov term, walked left to right.

    Score of candidate c after the chosen token p at row i:
    ``logit_i(c) + <predecessor_codebook[p] * hidden_projection(h_i), successor_codebook[c]>``.
    """

    def __init__(self, config: DFlash2Config):
        super().__init__()
        V, r = config.vocab_size or 0, config.selector_rank
        self.top_k = config.selector_top_k
        self.predecessor_codebook = mx.zeros((V, r))
        self.successor_codebook = mx.zeros((V, r))
        self.hidden_projection = nn.Linear(config.hidden_size, r, bias=False)

    def propose(
        self, hidden: mx.array, logits: mx.array, anchor: mx.array, sampler: DraftSampler
    ) -> Drafted:
        """Drafts for rows 1..N (``hidden [N, H]``, processed ``logits [N, V]``) from ``anchor``.

        Greedy: the best-scoring candidate per row. Sampling: each row draws from
        ``sampler.logprobs`` over its candidates' scores; ``log_q [N, V]`` is that law (-inf
        outside the candidates), as rejection sampling needs.
        """
        N, K = logits.shape[0], min(self.top_k, logits.shape[-1])
        candidates = mx.argpartition(-logits, K - 1, axis=-1)[:, :K]
        unary = mx.take_along_axis(logits, candidates, axis=-1).astype(mx.float32)
        projected = self.hidden_projection(hidden).astype(mx.float32)  # [N, r]
        successors = self.successor_codebook[candidates].astype(mx.float32)  # [N, K, r]
        # All Markov terms in two batched ops, so the walk is only gathers and argmax/draws:
        # row 0 from the anchor, then [N-1, K, K] from each candidate of row i-1 to row i's.
        first = unary[0] + successors[0] @ (self.predecessor_codebook[anchor] * projected[0])
        before = self.predecessor_codebook[candidates[:-1]].astype(mx.float32)
        edges = (before * projected[1:, None]) @ successors[1:].transpose(0, 2, 1)
        greedy = sampler.deterministic
        keys = mx.random.split(sampler.next_key(), N) if not greedy else mx.array([])
        scores, picks, rows = first, list[mx.array](), list[mx.array]()
        for i in range(N):
            if i > 0:
                scores = unary[i] + mx.take(edges[i - 1], picks[-1], axis=0)
            if greedy:
                picks.append(mx.argmax(scores))
            else:
                rows.append(sampler.logprobs(scores[None])[0])
                picks.append(mx.random.categorical(rows[-1], key=keys[i]))
        chosen = mx.stack(picks)[:, None]
        drafts = mx.take_along_axis(candidates, chosen, axis=-1)[:, 0]
        if greedy:
            return drafts, None
        log_q = mx.full(logits.shape, -mx.inf, dtype=mx.float32)
        return drafts, mx.put_along_axis(log_q, candidates, mx.stack(rows), axis=-1)


class DFlash2DraftModel(DFlashDraftModel):
    """A DFlash2 drafter; ``propose`` runs the layers and the selector in one lazy graph, the
    layers of every row in one pass (the convolutions never look past a row's own block)."""

    layer_class = DFlash2DecoderLayer

    def __init__(self, config: DFlash2Config):
        super().__init__(config, family="DFlash2")
        self.candidate_selector = CandidateSelector(config)

    def layer_is_causal(self, i: int) -> bool:
        """``is_causal`` when the config has it, else the DFlash2 reference's rule: a sliding
        layer is causal in the block, a full one bidirectional (published configs say false)."""
        if self.config.is_causal is not None:
            return self.config.is_causal
        return self.config.layer_types[i] == "sliding_attention"

    def quant_predicate(self, path: str, module: nn.Module) -> bool:
        """mlx-lm's hook (``quantize_model`` reads it): leave the conv and selector parts alone."""
        return not any(part in path.split(".") for part in HIGH_PRECISION)

    def bind(self, target: nn.Module) -> DFlash2DraftModel:
        super().bind(target)
        rows = self.candidate_selector.predecessor_codebook.shape[0]
        if rows < self.candidate_selector.top_k:
            raise ValueError(f"DFlash2 codebooks have {rows} rows, fewer than selector_top_k")
        return self

    def propose(self, rows: Sequence[DraftRow]) -> list[Drafted]:
        """The drafter contract (``DFlashDraftModel.propose``) through the selector."""
        states = self.block_states(rows)
        logits = self.target_head().logits(states[:, 1:])
        out = []
        for i, row in enumerate(rows):
            n = row.width - 1
            row_logits = logits[i, :n]
            if row.history is not None and row.sampler.processors:
                # Penalties, as the target's rows get them.
                row_logits = row.sampler.process(row_logits, row.history)
            anchor = row.block[0, 0]
            out.append(self.candidate_selector.propose(states[i, 1 : n + 1], row_logits, anchor,
                                                       row.sampler))  # fmt: skip
        return out


def _remap(raw: dict[str, Any]) -> Any:
    def remap(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Codebooks are stored bare (``candidate_selector.predecessor_codebook``), as the model
        names them; MLX exports built on an Embedding spell them ``.weight``, possibly packed."""
        out = dict(weights)
        for name in ("predecessor_codebook", "successor_codebook"):
            key = f"candidate_selector.{name}"
            if f"{key}.weight" not in out:
                continue
            if key in out:
                raise ValueError(f"drafter weights hold both {key} and {key}.weight")
            weight = out.pop(f"{key}.weight")
            if f"{key}.scales" in out:  # kept in higher precision here: unpack once at load
                scales, biases = out.pop(f"{key}.scales"), out.pop(f"{key}.biases", None)
                if biases is None or scales.dtype == mx.uint8:
                    raise ValueError(f"{key}: only affine-quantized codebooks can be loaded")
                rank = int(raw["dflash_config"]["selector_rank"])
                group, bits = rank // scales.shape[-1], weight.shape[-1] * 32 // rank
                weight = mx.dequantize(weight, scales, biases, group, bits)
            out[key] = weight
        return out

    return remap


def _load(path: Path, raw: dict[str, Any], target: nn.Module | None) -> DFlash2DraftModel:
    model = DFlash2DraftModel(DFlash2Config.from_dict(raw))
    load_checkpoint(model, path, raw, _remap(raw), source=f"{path} (DFlash2 layout)")
    return model if target is None else model.bind(target)


FAMILY = Family(
    "DFlash2",
    lambda raw: (raw.get("architectures") or [None])[0] == "DFlash2DraftModel",
    _load,
    "DFlash2DraftModel",
)
