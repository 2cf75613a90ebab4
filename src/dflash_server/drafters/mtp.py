"""The target's own multi-token-prediction head (Qwen3.5/3.6 ``mtp.*``) as a drafter.

One decoder layer trained with the target. At each position i it reads the target's final
(normed) hidden state h_i and the token after it, x_{i+1}::

    m_i = fc([norm_e(embed(x_{i+1})) ; norm_h(h_i)])       (2H -> H)
    o_i = norm(layer(m_i))                                 (full attention over m_0 .. m_i)
    q(x_{i+2}) = softmax(lm_head(o_i))

It drafts k tokens one after another: the first from (h_{n-1}, the anchor x_n), each next one
from its own previous output o and the draft it just proposed. Its context is the layer's K/V
over committed positions only, plus the newest committed position's hidden state, which waits
for the token after it; whatever drafting adds is dropped at once, so it never rolls back. The embedding, final norm and LM head are the target's (``bind``); the layer is
mlx-lm's own Qwen3.5 decoder layer (docs/design.md, "Drafter families").
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.qwen3_5 import DecoderLayer, TextModelArgs

from dflash_server.drafters.protocol import ContextLayer, Drafted, DraftRow, Family
from dflash_server.drafters.stepwise import (
    Walk,
    batch_of,
    kv_context_layers,
    row_cache,
)
from dflash_server.models.loading import load_arrays, load_checkpoint, resolve_model_path
from dflash_server.models.target_parts import find_target_parts

DEFAULT_BLOCK = 8  # the widest cycle it may verify (1 + drafts); "auto" picks 1..this


@dataclass
class MTPConfig:
    """What the decoder reads of a drafter's config, and the head's own layer arguments."""

    text: dict[str, Any]  # the target's text config (the head's layer mirrors its layers)
    block_size: int = DEFAULT_BLOCK
    mask_token_id: int = 0  # block positions after the anchor are never read by MTP

    @property
    def hidden_size(self) -> int:
        return int(self.text["hidden_size"])

    @property
    def num_hidden_layers(self) -> int:
        return int(self.text.get("mtp_num_hidden_layers", 1))

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        """The tap it reads: the target's last layer (normed with the target's final norm)."""
        return (int(self.text["num_hidden_layers"]) - 1,)

    def layer_args(self) -> TextModelArgs:
        args = TextModelArgs.from_dict(copy.deepcopy(self.text))
        return args


class MTPDrafter(nn.Module):
    """The MTP head, loaded from the target's checkpoint (``FAMILY``)."""

    family = "MTP"
    window = None  # one layer over the whole context: no window to bound

    def __init__(self, config: MTPConfig):
        super().__init__()
        self.config = config
        args = config.layer_args()
        hidden = args.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden, eps=args.rms_norm_eps)
        # A full-attention layer of the target's kind (layer index: the first attention one).
        full = args.full_attention_interval - 1
        self.layers = [DecoderLayer(args, full) for _ in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(hidden, eps=args.rms_norm_eps)
        self._target: tuple[Any, Any, Any] | None = None  # (embed, final norm, lm_head)

    def bind(self, target: nn.Module) -> MTPDrafter:
        """Borrow the target's embedding, final norm and LM head; refuse a target it does not
        fit (the head is trained with one target: same sizes)."""
        parts = find_target_parts(target)
        args = self.config.layer_args()
        if (parts.hidden_size, parts.num_layers) != (args.hidden_size, args.num_hidden_layers):
            raise ValueError(
                f"MTP head for a {args.num_hidden_layers}-layer, {args.hidden_size}-wide target "
                f"does not fit this {parts.num_layers}-layer, {parts.hidden_size}-wide one: use "
                "the head of this target's own checkpoint (--draft mtp)"
            )
        self._target = (parts.embed_tokens, parts.backbone.norm, parts.lm_head)
        return self

    def set_window(self, window: int | None) -> int | None:
        return None  # one layer over the context: no window to bound

    def context_window(self) -> tuple[int, int] | None:
        return None  # it reads every committed position

    def skip_context(self, n: int, cache: list[Any]) -> None:
        raise ValueError("the MTP head reads every position: no context can be skipped")

    def context_layers(self, activation_bytes: int) -> tuple[ContextLayer, ...]:
        """The layer's K/V over every committed position (its pending hidden state is one
        position, not counted)."""
        return kv_context_layers(self.layers, activation_bytes)

    def make_cache(self) -> list[Any]:
        return row_cache(len(self.layers))

    def append_context(self, target_hidden: mx.array, cache: list[Any], tokens: mx.array) -> None:
        """Pair each new committed position with the token after it (the next position's
        token; the newest waits in ``PendingHidden`` for the next call or the anchor)."""
        embed, final_norm, _ = self.borrowed()
        hidden = final_norm(target_hidden)
        pending = cache[-1]
        if pending.hidden is not None:  # its next token is the first one fed here
            hidden = mx.concatenate([pending.hidden, hidden], axis=1)
            nxt = tokens
        else:  # the prompt's first position: nothing before it
            nxt = tokens[1:]
        if nxt.shape[0] > 0:
            self._layers(embed(nxt[None]), hidden[:, : nxt.shape[0]], cache[:-1])
        pending.hidden = hidden[:, -1:]
        pending.offset += target_hidden.shape[1]

    def propose(self, rows: Sequence[DraftRow]) -> list[Drafted]:
        """Each row's ``width - 1`` drafts after its anchor (``block[0, 0]``) and the log q of
        each (None when greedy): one head pass per draft step for all rows, each row's own K/V
        read as one padded batch (``stepwise.py``); a lone row reads its own cache."""
        embed, _, lm_head = self.borrowed()
        if any(row.cache[-1].hidden is None for row in rows):
            raise RuntimeError("the MTP head has no context (its prefill fed none)")
        if len(rows) == 1:
            layers = rows[0].cache[:-1]
        else:
            layers = [batch_of([row.cache[i] for row in rows]) for i in range(len(self.layers))]
        walk = Walk(rows)
        # Every pass here adds K/V that is dropped below: the anchor's own entry joins the
        # context with the next append_context, so drafting never changes a row's cache.
        hidden = mx.concatenate([row.cache[-1].hidden for row in rows])
        out = self._layers(embed(walk.last[:, None]), hidden, layers)
        for j in range(walk.steps):
            walk.draw(lm_head(out)[:, 0])
            if j < walk.steps - 1:
                out = self._layers(embed(walk.last[:, None]), out, layers)
        if len(rows) == 1:
            for c in layers:
                c.trim(walk.steps)
        return walk.drafted()

    def _layers(self, emb: mx.array, hidden: mx.array, caches: list[Any]) -> mx.array:
        """The head over positions whose token embeddings and hidden states are given
        ([1, T, H] each); appends their K/V; returns the normed outputs."""
        m = self.fc(
            mx.concatenate(
                [self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], axis=-1
            )
        )
        mask = create_attention_mask(m, caches[0])  # as the target's own layers get it
        for layer, c in zip(self.layers, caches):
            m = layer(m, mask, c)
        return self.norm(m)

    def borrowed(self) -> tuple[Any, Any, Any]:
        """The target's embedding, final norm and LM head (set by ``bind``)."""
        if self._target is None:
            raise RuntimeError("MTPDrafter.bind(target) must be called before drafting")
        return self._target


# -- loading: from the target's own checkpoint, or a split export ---------------------------


def mtp_weights(path: Path) -> dict[str, mx.array]:
    """The ``mtp.*`` tensors of a checkpoint folder (the target's, or a split export), named as
    the head names them (``fc.weight``, ``layers.0.self_attn.q_proj.weight``, ...)."""
    files = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.exists():  # only the shards that hold the head, when the index names them
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        names = {v for k, v in weight_map.items() if "mtp." in k}
        files = [f for f in files if f.name in names] or files
    out: dict[str, mx.array] = {}
    for f in files:
        for key, value in load_arrays(f).items():
            if key.startswith("mtp.") or ".mtp." in key:
                out[key.split("mtp.", 1)[1]] = value
    return out


def has_mtp(path: Path) -> bool:
    """Whether a target checkpoint folder carries its MTP head."""
    raw = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    text = raw.get("text_config", raw)
    return bool(text.get("mtp_num_hidden_layers")) and bool(mtp_weights(path))


def load_mtp(path_or_repo: str | Path, target: nn.Module) -> MTPDrafter:
    """Load the MTP head from a checkpoint folder that holds ``mtp.*`` tensors: the target's
    own (``--draft mtp``) or a split export, quantized or not; bound to ``target``."""
    path = resolve_model_path(path_or_repo, ["*.safetensors", "*.json"])
    return _load(path, json.loads((path / "config.json").read_text()), target)


def _load(path: Path, raw: dict[str, Any], target: nn.Module | None) -> MTPDrafter:
    if target is None:
        raise ValueError("the MTP head loads with its target (its layers are the target's kind)")
    text = dict(raw.get("text_config", raw))
    if not text.get("mtp_num_hidden_layers"):
        raise ValueError(
            f"{path} has no MTP head (config.json: no mtp_num_hidden_layers); pass a DFlash "
            "drafter, the original checkpoint that carries mtp.* tensors, or no --draft"
        )
    weights = mtp_weights(path)
    if not weights:
        raise ValueError(
            f"no mtp.* tensors in {path}: MLX conversions usually drop them; use the original "
            "checkpoint, or a split MTP export (dflash-serve convert keeps the head)"
        )
    config = MTPConfig(text, block_size=int(raw.get("block_size", DEFAULT_BLOCK)))
    if _unsanitized(path):  # the original layout stores zero-centred norms (weight + 1)
        weights = {k: v + 1.0 if k.endswith("norm.weight") and v.ndim == 1 else v
                   for k, v in weights.items()}  # fmt: skip
    model = MTPDrafter(config)
    weights = _sanitize_layers(weights, target, config)
    load_checkpoint(model, path, raw, source=f"{path} (MTP head)", weights=weights)
    return model.bind(target)


# A split export (``model_type: qwen3_5_mtp``); ``--draft mtp`` names the target's own folder.
FAMILY = Family(
    "MTP",
    lambda raw: str(raw.get("model_type", "")).endswith("_mtp"),
    _load,
    "a split MTP head (model_type *_mtp), or --draft mtp",
)


def _unsanitized(path: Path) -> bool:
    """Whether the folder is in the original (Hugging Face) layout, as mlx-lm tells: a Gated
    DeltaNet conv1d weight not yet moved to MLX's layout."""
    for f in sorted(path.glob("*.safetensors")):
        for key, value in load_arrays(f).items():
            if key.endswith("conv1d.weight"):
                return value.shape[-1] != 1
    return False


def _sanitize_layers(
    weights: dict[str, mx.array], target: nn.Module, config: MTPConfig
) -> dict[str, mx.array]:
    """The head's decoder layers as mlx-lm sanitizes the target's (e.g. stacked MoE experts):
    each is renamed as a full-attention target layer, sanitized by the target, renamed back."""
    sanitize = getattr(target, "sanitize", None)
    if sanitize is None:
        return weights
    interval = config.layer_args().full_attention_interval
    own = {f"model.language_model.layers.{interval * (i + 1) - 1}.": f"layers.{i}."
           for i in range(config.num_hidden_layers)}  # fmt: skip
    renamed = {}
    for key, value in weights.items():
        for theirs, mine in own.items():
            if key.startswith(mine):
                key = theirs + key[len(mine) :]
        renamed[key] = value
    out = {}
    for key, value in sanitize(renamed).items():
        for theirs, mine in own.items():
            # Qwen3.5's sanitize moves them under language_model.model.; a plain attention
            # target's (a head trained for it with train --mtp) leaves the names as they were.
            for name in (theirs.replace("model.language_model.", "language_model.model."), theirs):
                if key.startswith(name):
                    key = mine + key[len(name) :]
                    break
        out[key.removeprefix("language_model.model.").removeprefix("language_model.")] = value
    return out
