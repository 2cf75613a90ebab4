"""Offline builders of tiny random-weight models, for tests and benchmarks.

The machines this project is developed and tested on have no Hugging Face Hub access, and real
Qwen3.5 checkpoints are gigabytes. These helpers write, in milliseconds to seconds, model folders
that ``mlx_lm.load`` reads exactly like a downloaded checkpoint: a byte-level BPE tokenizer trained
on a small inline corpus with Qwen3.5's pre-tokenizer and chat template, plus random float32
weights for the architectures the server targets (hybrid Gated DeltaNet ``qwen3_5``, its MoE
variant, plain attention ``qwen3`` and ``llama``). Random weights say nothing about quality, but
every code path (prefill, hybrid caches, rollback, sampling, the chat template, tool and thinking
markers) runs for real.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

# The replaying test double (testing/replay.py) and the tokenizer builders (testing/tokenizer.py),
# imported from here as they always were.
from dflash_server.testing.replay import ReplayDrafter as ReplayDrafter
from dflash_server.testing.tokenizer import _CORPUS as _CORPUS
from dflash_server.testing.tokenizer import PRETOKENIZE_REGEX as PRETOKENIZE_REGEX
from dflash_server.testing.tokenizer import SPECIAL_TOKENS as SPECIAL_TOKENS
from dflash_server.testing.tokenizer import build_tokenizer as build_tokenizer
from dflash_server.testing.tokenizer import mask_token_id as mask_token_id
from dflash_server.testing.tokenizer import tokenizer_size as tokenizer_size

if TYPE_CHECKING:
    from dflash_server.drafters.dflash import DFlashDraftModel
    from dflash_server.drafters.dflash2 import DFlash2DraftModel

ARCHES = ("qwen3_5", "qwen3_5_moe", "qwen3", "llama")


def _text_config(
    arch: str, hidden: int, layers: int, inter: int, vocab: int, tie: bool
) -> dict[str, Any]:
    heads, kv_heads = (4, 2) if hidden < 512 else (max(4, hidden // 64), max(2, hidden // 256))
    cfg: dict[str, Any] = {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": 16 if hidden < 512 else 64,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": tie,
        "hidden_act": "silu",
    }
    if arch in ("qwen3", "llama"):
        cfg.update(rope_theta=1_000_000.0 if arch == "qwen3" else 10_000.0)
        return cfg
    lin_dim = 16 if hidden < 512 else 64
    cfg.update(
        model_type=f"{arch}_text",
        full_attention_interval=4,
        linear_num_value_heads=4 if hidden < 512 else hidden // 64,
        linear_num_key_heads=2 if hidden < 512 else hidden // 128,
        linear_key_head_dim=lin_dim,
        linear_value_head_dim=lin_dim,
        linear_conv_kernel_dim=4,
        layer_types=[
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)
        ],
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
        },
    )
    if arch == "qwen3_5_moe":
        cfg.update(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=inter,
            shared_expert_intermediate_size=inter,
            decoder_sparse_step=1,
            norm_topk_prob=True,
        )
    return cfg


def build_target(
    path: Path,
    *,
    arch: str = "qwen3_5",
    hidden_size: int = 64,
    num_hidden_layers: int = 4,
    intermediate_size: int | None = None,
    vocab_size: int | None = None,
    tie_word_embeddings: bool = False,
    nested_text_config: bool = True,
    seed: int = 0,
    quantize_bits: int | None = None,
    mtp: bool = False,
    special: Sequence[str] = SPECIAL_TOKENS,
    text_overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a random float32 mlx-lm model folder (config, weights, tokenizer); return ``path``.

    ``vocab_size`` (embedding rows) defaults to the tokenizer size rounded up to a multiple of 64
    with at least 16 spare rows; ``mask_token_id(path)`` is the first spare row. A larger
    override (e.g. 32k for a ~100M benchmark model) leaves the tokenizer small. ``quantize_bits``
    quantizes (affine, group 64) the layers whose input width allows it, like ``mlx_lm.convert``.
    ``mtp`` (qwen3_5 only) adds a random MTP head, ``mtp.*`` tensors in the published layout
    (``mtp_num_hidden_layers: 1`` in the text config), quantized like the rest. ``special``: the
    tokenizer's control tokens; ``text_overrides``: config fields to change.
    """
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.utils import _get_classes, save_config, save_model

    if arch not in ARCHES:
        raise ValueError(f"arch must be one of {ARCHES}, got {arch!r}")
    path = Path(path)
    build_tokenizer(path, special)
    n_tok = tokenizer_size(path)
    vocab = vocab_size or -(-(n_tok + 16) // 64) * 64
    if vocab <= n_tok:
        raise ValueError(f"vocab_size {vocab} leaves no free row past {n_tok} named tokens")
    inter = intermediate_size or 3 * hidden_size
    text = _text_config(arch, hidden_size, num_hidden_layers, inter, vocab, tie_word_embeddings)
    text.update(text_overrides or {})
    eos = json.loads((path / "tokenizer.json").read_text())["added_tokens"]
    eos_id = next(t["id"] for t in eos if t["content"] == "<|im_end|>")
    if arch in ("qwen3_5", "qwen3_5_moe") and nested_text_config:
        config: dict[str, Any] = {
            "model_type": arch,
            "architectures": [f"Qwen3_5{'Moe' * (arch == 'qwen3_5_moe')}ForConditionalGeneration"],
            "text_config": text,
            "tie_word_embeddings": tie_word_embeddings,
        }
    else:
        config = {**text, "model_type": arch}
    config["eos_token_id"] = eos_id

    mx.random.seed(seed)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(copy.deepcopy(config)))
    model.set_dtype(mx.float32)
    # Random layers wash out the input token; larger embeddings keep it visible, so greedy decoding
    # wanders like a random bigram model instead of repeating one token. A tied head scores the
    # input token against itself: smaller embeddings and a negative final-norm gain break that.
    # Special and spare ids (the mask id included) get zero (untied) or tiny (tied) head rows, so
    # greedy decoding never picks them: no random EOS, tool call or think marker (sampling may).
    lm = getattr(model, "language_model", model)
    emb, norm = lm.model.embed_tokens, lm.model.norm
    gain = mx.random.normal(norm.weight.shape, dtype=mx.float32)
    norm.weight = -mx.abs(gain) if tie_word_embeddings else gain
    std = 0.15 if tie_word_embeddings else 1.0
    emb.weight = mx.random.normal(emb.weight.shape, dtype=mx.float32) * std
    n_bpe = n_tok - len(special)
    if tie_word_embeddings:
        emb.weight[n_bpe:] *= 0.05
    else:
        lm.lm_head.weight[n_bpe:] = 0.0
    if quantize_bits is not None:
        config["quantization"] = {"group_size": 64, "bits": quantize_bits, "mode": "affine"}
        custom = getattr(model, "quant_predicate", None)

        def predicate(p: str, m: nn.Module) -> bool | dict[str, Any]:
            if not hasattr(m, "to_quantized") or m.weight.shape[-1] % 64:
                return False
            res = custom(p, m) if custom is not None else True
            if isinstance(res, dict):
                config["quantization"][p] = res
            return res

        nn.quantize(model, 64, quantize_bits, mode="affine", class_predicate=predicate)
    mx.eval(model.parameters())
    save_model(path, model)
    if mtp:
        text["mtp_num_hidden_layers"] = 1
        _save_mtp_head(path, text, config.get("quantization"))
    save_config(config, path / "config.json")
    return path


def _save_mtp_head(path: Path, text: dict[str, Any], quantization: dict[str, Any] | None) -> None:
    """A random MTP head for the target in ``path``, as ``mtp.*`` tensors of its own shard
    (mlx-lm drops them when it loads the target, as it does a real checkpoint's)."""
    import mlx.core as mx
    import mlx.nn as nn

    from dflash_server.drafters.mtp import MTPConfig, MTPDrafter
    from dflash_server.models.loading import flat_arrays

    head = MTPDrafter(MTPConfig(text))
    head.set_dtype(mx.float32)
    for norm in (head.pre_fc_norm_embedding, head.pre_fc_norm_hidden):
        norm.weight = 1.0 + 0.1 * mx.random.normal(norm.weight.shape)
    if quantization is not None:
        bits = quantization["bits"]
        nn.quantize(head, 64, bits, class_predicate=lambda p, m: hasattr(m, "to_quantized")
                    and m.weight.shape[-1] % 64 == 0)  # fmt: skip
    arrays = {f"mtp.{k}": v for k, v in flat_arrays(head.parameters())}
    shard = "model-mtp.safetensors"
    mx.save_safetensors(str(path / shard), arrays, metadata={"format": "mlx"})
    index = path / "model.safetensors.index.json"
    if index.exists():  # as a real checkpoint's index maps its mtp.* tensors
        content = json.loads(index.read_text())
        content["weight_map"].update(dict.fromkeys(arrays, shard))
        index.write_text(json.dumps(content, indent=2))


def _tiny_drafter_fields(model: Any, block_size: int, num_layers: int) -> dict[str, Any]:
    """Config fields of a tiny drafter that fits ``model``: taps spread over it, mask = last row."""
    from dflash_server.models.target_parts import find_target_parts

    parts = find_target_parts(model)
    n, H = parts.num_layers, parts.hidden_size
    return {
        "hidden_size": H,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 2 * H,
        "vocab_size": parts.vocab_size,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e7,
        "max_position_embeddings": 32768,
        "block_size": block_size,
        "target_layer_ids": tuple(sorted({min(1, n - 1), n // 2, n - 1})),
        "num_target_layers": n,
        "mask_token_id": parts.vocab_size - 1,
    }


def _published_drafter_fields(model: Any, block_size: int, num_layers: int) -> dict[str, Any]:
    """Config fields of the published drafters' shape (heads of 64, 4 q-heads per kv-head, MLP
    3x wide, taps spread over the target as the reference trainer picks them), for timing."""
    from dflash_server.drafters.config import default_target_layer_ids
    from dflash_server.models.target_parts import find_target_parts

    parts = find_target_parts(model)
    n, H = parts.num_layers, parts.hidden_size
    heads = max(1, H // 64)
    taps = sorted({min(n - 1, t) for t in default_target_layer_ids(n, 5)})
    return {
        **_tiny_drafter_fields(model, block_size, num_layers),
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 4),
        "head_dim": 64,
        "intermediate_size": 3 * H,
        "target_layer_ids": tuple(taps),
    }


def random_drafter(
    model: Any,
    *,
    block_size: int = 16,
    num_layers: int | None = None,
    seed: int = 0,
    sliding_window: int | None = None,
    shape: str = "tiny",
    mask_id: int | None = None,
) -> DFlashDraftModel:
    """A random-weight DFlash drafter sized to ``model`` and bound to it (accepts ~nothing).

    ``shape="tiny"`` (2 layers by default, small heads) is for tests; ``"published"`` (5 layers
    by default) has the published drafters' proportions, so benchmarks pay a realistic draft
    cost. With ``sliding_window`` its layers alternate sliding/full attention, sliding first;
    ``mask_id`` defaults to the last embedding row."""
    import mlx.core as mx

    from dflash_server.drafters.config import DFlashConfig
    from dflash_server.drafters.dflash import DFlashDraftModel

    if shape not in ("tiny", "published"):
        raise ValueError(f"random_drafter: shape must be 'tiny' or 'published', not {shape!r}")
    num_layers = num_layers or (5 if shape == "published" else 2)
    fields = (_published_drafter_fields if shape == "published" else _tiny_drafter_fields)(
        model, block_size, num_layers
    )
    if mask_id is not None:
        fields["mask_token_id"] = mask_id
    mx.random.seed(seed)
    config = DFlashConfig(
        **fields,
        layer_types=tuple(
            "sliding_attention" if sliding_window and i % 2 == 0 else "full_attention"
            for i in range(num_layers)
        ),
        sliding_window=sliding_window,
    )
    draft = DFlashDraftModel(config)
    mx.eval(draft.parameters())
    return draft.bind(model)


def random_dflash2_drafter(
    model: Any,
    *,
    block_size: int = 8,
    num_layers: int = 2,
    sliding_window: int | None = 2048,
    top_k: int = 8,
    rank: int = 16,
    seed: int = 0,
) -> DFlash2DraftModel:
    """A random DFlash2 drafter sized to ``model`` and bound to it (published layout, tiny sizes).

    Layers slide like the published ones (``sliding_window=None``: full attention), the block is
    bidirectional (``is_causal: false``); the conv kernels start near identity (tap 0 = 1 plus
    noise) and the codebooks are small random matrices, so every DFlash2 part shapes the output.
    """
    import mlx.core as mx

    from dflash_server.drafters.dflash2 import DFlash2Config, DFlash2DraftModel

    mx.random.seed(seed)
    kind = "full_attention" if sliding_window is None else "sliding_attention"
    config = DFlash2Config(
        **_tiny_drafter_fields(model, block_size, num_layers),
        layer_types=(kind,) * num_layers,
        sliding_window=sliding_window,
        is_causal=False,
        conv_kernel_size=2,
        conv_group_size=16,
        selector_rank=rank,
        selector_top_k=top_k,
    )
    draft = DFlash2DraftModel(config)
    for layer in draft.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            base = 0.1 * mx.random.normal(conv.base_kernel.shape)
            conv.base_kernel = base + (mx.arange(conv.kernel_size) == 0)[None, :, None]
            conv.kernel_projection.weight = 0.05 * conv.kernel_projection.weight
    selector = draft.candidate_selector
    shape = selector.predecessor_codebook.shape
    selector.predecessor_codebook = mx.random.normal(shape)
    selector.successor_codebook = mx.random.normal(shape)
    mx.eval(draft.parameters())
    return draft.bind(model)
