"""Exact rollback of target caches after a partially accepted block.

See docs/design.md, 'Hybrid rollback'.

Attention caches are trimmed. Gated DeltaNet layers keep a recurrent state that cannot be trimmed,
so the verify pass is recorded (``models/hooks.py``) and rollback restores the state at the kept
prefix:

* where mlx-lm runs the recurrence as sequential ops (CPU, CUDA), the recording computes it in
  chunk form (``models/recurrence.py``: a few matmuls over the block instead of B steps; unusual
  call options fall back to stepping mlx-lm's own ``gated_delta_update`` token by token), and
  rollback computes the kept prefix's state from the same pieces with one matmul. On CPU a
  recorded verify is then cheaper than mlx-lm's own unrecorded one, and no prefix is replayed;
* where it runs a fused Metal kernel, the recording kept the recurrence inputs (normalised q, k,
  v, gates a, b) and rollback replays the kernel over the kept prefix from the pre-verify state.

The conv window is re-sliced from the recorded conv input. No second target forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from dflash_server.models.recurrence import state_at

if TYPE_CHECKING:
    from dflash_server.models.hooks import Recording, TargetHooks


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
