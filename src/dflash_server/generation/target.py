"""The target model as DFlash drives it: forward with taps, recorded verify, exact rollback.

Attention caches are trimmed. Gated DeltaNet layers keep a recurrent state that cannot be trimmed,
so the verify pass is recorded (``models/hooks.py``) and rollback restores the state at the kept
prefix (docs/design.md, "Hybrid rollback"):

* where mlx-lm runs the recurrence as sequential ops (CPU, CUDA), the recording computes it in
  chunk form (``models/recurrence.py``: a few matmuls over the block instead of B steps; unusual
  call options fall back to stepping mlx-lm's own ``gated_delta_update`` token by token), and
  rollback computes the kept prefix's state from the same pieces with one matmul;
* where it runs a fused Metal kernel, the recording kept the recurrence inputs (normalised q, k,
  v, gates a, b) and rollback replays the kernel over the kept prefix from the pre-verify state.

The conv window is re-sliced from the recorded conv input. No second target forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, overload

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from dflash_server.generation.pauses import pause
from dflash_server.models.hooks import Recording, TargetHooks, hook_error
from dflash_server.models.mrope import Positions
from dflash_server.models.recurrence import state_at


class TargetModel:
    """Wraps an mlx-lm model for prefill/verify with taps and exact cache rollback.

    Several wrappers (e.g. for drafters with different taps) may share one model and its hooks.
    """

    def __init__(self, model: nn.Module, tap_ids: tuple[int, ...] | list[int]):
        self.model = model
        self.hooks = TargetHooks.of(model)
        if not self.hooks.checked:
            check_rollback(self.hooks)
            self.hooks.checked = True
        self.parts = self.hooks.parts
        self.tap_ids = tuple(tap_ids)
        self.hooks.tap(self.tap_ids)

    def make_cache(self) -> list[Any]:
        return make_prompt_cache(self.model)

    def place_positions(self) -> None:
        """Let forwards give their own rotary positions (images), checked once: each attention
        layer must rotate its queries and keys through its positioned RoPE."""
        if self.hooks.mrope is None:
            self.hooks.place_positions()
            check_positions(self.hooks)

    def make_rollback(self, cache: list[Any]) -> CacheRollback:
        return CacheRollback(self.hooks, cache)

    @overload
    def forward(
        self,
        tokens: mx.array,
        cache: list[Any] | None,
        logit_rows: slice,
        *,
        embeddings: mx.array | None = None,
        positions: Positions | None = None,
    ) -> tuple[mx.array, mx.array | None]: ...
    @overload
    def forward(
        self,
        tokens: mx.array,
        cache: list[Any] | None,
        logit_rows: None = None,
        *,
        embeddings: mx.array | None = None,
        positions: Positions | None = None,
    ) -> tuple[None, mx.array | None]: ...
    def forward(
        self,
        tokens: mx.array,
        cache: list[Any] | None,
        logit_rows: slice | None = None,
        *,
        embeddings: mx.array | None = None,
        positions: Positions | None = None,
    ) -> tuple[mx.array | None, mx.array | None]:
        """Run ``tokens`` ([1, T]) through the target; return (logits of ``logit_rows``, taps).

        Taps are the tapped layers' outputs concatenated on the feature axis: [1, T, L*H]
        (None without taps, i.e. plain decoding). ``embeddings`` ([B, T, H]) replace the
        tokens' own (image features at image tokens); ``positions`` replace the cache offset
        as the rotary positions (docs/design.md, "Multimodal positions").
        """
        extra = {} if embeddings is None else {"input_embeddings": embeddings}
        with self.hooks.positioned(positions):
            hidden = self.parts.backbone(tokens, cache, **extra)
        taps = self.hooks.take_taps(self.tap_ids)
        logits = None if logit_rows is None else self.parts.lm_head(hidden[:, logit_rows])
        return logits, taps


class CacheRollback:
    """Records a verify pass and rolls the target cache back to its first ``keep`` positions."""

    def __init__(self, hooks: TargetHooks, cache: list[Any]):
        self.hooks, self.cache = hooks, cache
        self.linear: list[Any] = []  # the ArraysCache of each GDN layer, in layer order
        gdn_layers = {id(g) for g in hooks.gdn}
        for layer, c in zip(hooks.parts.layers, cache):
            if c.is_trimmable():
                continue
            if id(getattr(layer, "linear_attn", None)) not in gdn_layers:
                raise ValueError(
                    f"cannot roll back the {type(c).__name__} of layer {type(layer).__name__}: "
                    "DFlash supports trimmable KV caches and Gated DeltaNet (Qwen3.5/Qwen3-Next)"
                )
            self.linear.append(c)
        self._last: Recording | None = None

    @contextlib.contextmanager
    def recording(self) -> Iterator[Recording]:
        """Record the recurrence inputs of the forward pass run inside this block."""
        with self.hooks.recording() as recording:
            self._last = recording
            yield recording

    def rollback(self, keep: int, fed: int) -> None:
        """The last forward fed ``fed`` positions; keep only the first ``keep`` of them."""
        trim = fed - keep
        if trim <= 0:
            return
        for c in self.cache:
            if c.is_trimmable():
                c.trim(trim)
        recording = self._last
        if recording is None or not (
            len(recording.updates) == len(recording.conv_inputs) == len(self.linear)
        ):
            raise RuntimeError("rollback needs the recording of the last verify pass")
        for c, gdn, (args, kwargs, states), conv_input in zip(
            self.linear, self.hooks.gdn, recording.updates, recording.conv_inputs
        ):
            q, k, v, a, b, A_log, dt_bias, state = args[:8]
            kwargs = {key: val for key, val in kwargs.items() if key != "mask"}
            if states is not None and keep > 0:
                state = state_at(states, keep)
            elif keep > 0:
                _, state = self.hooks.replay(gdn)(
                    q[:, :keep], k[:, :keep], v[:, :keep], a[:, :keep], b[:, :keep],
                    A_log, dt_bias, state, None, **kwargs,
                )  # fmt: skip
            c[1] = state
            # conv_input = [old window (K-1 rows) | fed rows]; the window after `keep` rows:
            window = conv_input.shape[1] - fed
            c[0] = mx.contiguous(conv_input[:, keep : keep + window])


def check_rollback(hooks: TargetHooks) -> None:
    """Record a two-token forward, roll it back to one token, compare with a one-token run;
    raise a HookError naming the mlx-lm version when the hooks do not hold."""
    backbone = hooks.parts.backbone
    tokens = mx.array([[1, 2]])
    recorded = make_prompt_cache(hooks.model)
    rollback = CacheRollback(hooks, recorded)
    with rollback.recording() as recording:
        backbone(tokens, recorded)
    mx.eval([c.state for c in recorded])
    pause()  # several models: the others run a round between two forwards (pauses.py)
    if len(recording.updates) != len(hooks.gdn):
        raise hook_error(
            f"{len(recording.updates)} of {len(hooks.gdn)} Gated DeltaNet layers called "
            "gated_delta_update through their module"
        )
    if len(recording.conv_inputs) != len(hooks.gdn):
        raise hook_error("Gated DeltaNet layers no longer call their conv1d module")
    rollback.rollback(keep=1, fed=2)
    reference = make_prompt_cache(hooks.model)
    backbone(tokens[:, :1], reference)
    mx.eval([c.state for c in reference])
    pause()
    for i, (a, b) in enumerate(zip(recorded, reference)):
        same = all(
            x.shape == y.shape and mx.allclose(x, y, atol=1e-4).item()
            for x, y in zip(_contents(a), _contents(b))
        )
        if not same:
            raise hook_error(f"layer {i}'s cache does not roll back exactly")


def check_positions(hooks: TargetHooks) -> None:
    """One positioned token: every attention layer must rotate its queries and keys through
    its RoPE module (else images would silently sit at the wrong positions); a HookError names
    the mlx-lm version when they do not."""
    ropes = [
        getattr(getattr(layer, "self_attn", None), "rope", None) for layer in hooks.parts.layers
    ]
    layers = sum(rope is not None for rope in ropes)
    before = hooks.rotations
    with hooks.positioned(Positions(shift=1)):
        hooks.parts.backbone(mx.array([[1]]), make_prompt_cache(hooks.model))
    if hooks.rotations - before != 2 * layers or not layers:
        raise hook_error(
            f"{hooks.rotations - before} rotations through the RoPE of {layers} attention "
            "layers, where each layer rotates its queries and keys"
        )


def _contents(cache: Any) -> list[mx.array]:
    """Comparable content of a layer cache: KV up to its offset, or the recurrent arrays."""
    if cache.is_trimmable():
        n = cache.offset
        return [cache.keys[..., :n, :], cache.values[..., :n, :], mx.array(n)]
    return [x for x in cache.cache if x is not None]
