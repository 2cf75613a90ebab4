"""Every hook DFlash puts into an mlx-lm target, in one place, checked once when it is installed.

* taps: each tapped decoder layer instance gets a subclass whose ``__call__`` also keeps its output
  (the residual stream after the layer), for the drafter's context;
* Gated DeltaNet recording, for exact rollback after a partly accepted verify (docs/design.md,
  "Hybrid rollback"): each GDN layer's conv input (the conv1d instance gets a recording
  subclass) and its recurrence (the module-level ``gated_delta_update`` that mlx-lm's layer
  calls is swapped only while a verify is being recorded, then restored).
* positions, for images (docs/design.md, "Multimodal positions"): once ``place_positions``
  ran, each attention layer's RoPE instance gets a subclass that, inside ``positioned``,
  rotates at the positions the forward gives (3-D, or the cache offset plus a shift) instead
  of at the cache offset mlx-lm passes; outside it, mlx-lm's own rotation.

mlx-lm's code and parameter trees stay untouched. ``TargetHooks.of(model)`` installs the hooks;
``generation.target.check_rollback`` then runs a two-token forward that must record what rollback
needs and roll back exactly, so an mlx-lm release that renames or restructures these parts fails
at load time with a message naming the version, never mid-request.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from dflash_server.models.mrope import Positions, rotate
from dflash_server.models.recurrence import BlockStates, state_at, with_states
from dflash_server.models.target_parts import find_target_parts

_TAPPED: dict[type, type] = {}
FAST_RECURRENCE = True  # record in chunk form (``recurrence.py``) where it applies, else step
_RECORDING_CONV: dict[type, type] = {}
_POSITIONED: dict[type, type] = {}


class HookError(RuntimeError):
    """The installed mlx-lm no longer has what the hooks rely on."""


def _mlx_lm_version() -> str:
    try:
        from importlib.metadata import version

        return version("mlx-lm")
    except Exception:  # pragma: no cover - metadata missing in odd installs
        return "unknown"


def hook_error(what: str) -> HookError:
    """A HookError naming the installed mlx-lm version and what changed."""
    return HookError(
        f"mlx-lm {_mlx_lm_version()} changed what DFlash hooks into: {what}. dflash-server is "
        "tested with mlx-lm 0.31-0.32: install one of those (pip install 'mlx-lm<0.33') or "
        "update dflash-server."
    )


@dataclass
class Recording:
    """What one recorded forward left behind: per GDN layer, its recurrence call and conv input.

    ``updates[i]`` = (args, kwargs, what gives the state after each token: the chunk form's
    ``BlockStates``, a list of states, or None where only inputs are kept).
    """

    updates: list[tuple[tuple, dict, BlockStates | list[mx.array] | None]] = field(
        default_factory=list
    )
    conv_inputs: list[mx.array] = field(default_factory=list)


def sequential_ops() -> bool:
    """True where mlx-lm's recurrence runs token by token as ops (no fused Metal kernel)."""
    return mx.default_device() != mx.gpu or not mx.metal.is_available()


def _step_by_step(original: Any, args: tuple, kwargs: dict) -> tuple[mx.array, list[mx.array]]:
    """``original`` over the tokens one at a time; returns (outputs, state after each token)."""
    q, k, v, a, b, A_log, dt_bias, state = args[:8]
    mask = args[8] if len(args) > 8 else kwargs.pop("mask", None)
    outputs, states = [], []
    for t in range(q.shape[1]):
        step = slice(t, t + 1)
        y, state = original(
            q[:, step], k[:, step], v[:, step], a[:, step], b[:, step], A_log, dt_bias, state,
            None if mask is None else mask[:, step], **kwargs,
        )  # fmt: skip
        outputs.append(y)
        states.append(state)
    return mx.concatenate(outputs, axis=1), states


def _tapped_class(cls: type) -> type:
    if cls not in _TAPPED:

        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = cls.__call__(self, *args, **kwargs)
            hooks, index = self._dflash_tap
            hooks.taps[index] = out[0] if isinstance(out, tuple) else out
            return out

        _TAPPED[cls] = type(f"Tapped{cls.__name__}", (cls,), {"__call__": __call__})
    return _TAPPED[cls]


def _recording_conv_class(cls: type) -> type:
    if cls not in _RECORDING_CONV:

        def __call__(self: Any, x: mx.array) -> mx.array:
            recording = self._dflash_hooks.active
            if recording is not None:
                recording.conv_inputs.append(x)
            return cls.__call__(self, x)

        _RECORDING_CONV[cls] = type(f"Recording{cls.__name__}", (cls,), {"__call__": __call__})
    return _RECORDING_CONV[cls]


def _positioned_class(cls: type) -> type:
    if cls not in _POSITIONED:

        def __call__(self: Any, x: mx.array, offset: Any = 0) -> mx.array:
            hooks = self._dflash_hooks
            positions = hooks.positions
            if positions is None:
                return cls.__call__(self, x, offset)
            hooks.rotations += 1
            if positions.grid is None:
                return cls.__call__(self, x, offset + positions.shift)
            return rotate(self, x, positions.grid, hooks.mrope)

        _POSITIONED[cls] = type(f"Positioned{cls.__name__}", (cls,), {"__call__": __call__})
    return _POSITIONED[cls]


def _set_private(obj: Any, name: str, value: Any) -> None:
    # object.__setattr__: keep our bookkeeping out of the module's parameter tree.
    object.__setattr__(obj, name, value)


class TargetHooks:
    """The hooks of one target model: tapped layers, GDN recorders, the recording in flight."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.parts = find_target_parts(model)
        self.taps: dict[int, mx.array] = {}  # layer index -> its latest output
        self.active: Recording | None = None
        self.checked = False  # set once rollback was checked exactly on this model
        self.positions: Positions | None = None  # the positions of the forward in flight
        self.mrope: tuple[int, ...] | None = None  # set by ``place_positions``
        self.rotations = 0  # positioned rotations so far (its self-check counts them)
        # GDN layers, and the mlx-lm modules whose gated_delta_update they call.
        self.gdn: list[nn.Module] = []
        self.originals: dict[ModuleType, Any] = {}
        for layer in self.parts.layers:
            gdn = getattr(layer, "linear_attn", None)
            if gdn is None:
                continue
            module = sys.modules[type(gdn).__module__]
            if not callable(getattr(module, "gated_delta_update", None)):
                raise hook_error(f"{module.__name__} has no gated_delta_update")
            if not isinstance(getattr(gdn, "conv1d", None), nn.Module):
                raise hook_error(f"{type(gdn).__name__} has no conv1d module")
            self.originals[module] = module.gated_delta_update
            if type(gdn.conv1d) not in _RECORDING_CONV.values():
                gdn.conv1d.__class__ = _recording_conv_class(type(gdn.conv1d))
            _set_private(gdn.conv1d, "_dflash_hooks", self)
            self.gdn.append(gdn)

    @classmethod
    def of(cls, model: nn.Module) -> TargetHooks:
        """The hooks of ``model``, installed on first use (they change its layers, so they live on
        it); ``generation.target.TargetModel`` runs their self-check once."""
        hooks = model.__dict__.get("_dflash_hooks")
        if hooks is None:
            hooks = cls(model)
            model.__dict__["_dflash_hooks"] = hooks
        return hooks

    def tap(self, layer_ids: tuple[int, ...]) -> None:
        """Make these layers keep their outputs (idempotent; several drafters may share)."""
        for i in layer_ids:
            layer = self.parts.layers[i]
            if type(layer) not in _TAPPED.values():
                layer.__class__ = _tapped_class(type(layer))
            _set_private(layer, "_dflash_tap", (self, i))

    def place_positions(self) -> None:
        """Let forwards rotate at positions of their own (images need Qwen3.5's multimodal
        positions): each attention layer's RoPE gets the positioned subclass (idempotent)."""
        if self.mrope is not None:
            return
        section = self.parts.mrope_section
        if section is None:
            raise ValueError("this target has no multimodal rotary positions (mrope_section)")
        for layer in self.parts.layers:
            rope = getattr(getattr(layer, "self_attn", None), "rope", None)
            if rope is None:
                continue
            if not isinstance(rope, nn.RoPE) or rope.traditional:
                raise hook_error(f"an attention layer's rope is a {type(rope).__name__}, not RoPE")
            if type(rope) not in _POSITIONED.values():
                rope.__class__ = _positioned_class(type(rope))
            _set_private(rope, "_dflash_hooks", self)
        self.mrope = section

    @contextlib.contextmanager
    def positioned(self, positions: Positions | None) -> Iterator[None]:
        """Rotate the forward run inside this block at ``positions`` (None: mlx-lm's)."""
        if positions is None:
            yield
            return
        if self.mrope is None:
            raise RuntimeError("place_positions() must run before a forward gives positions")
        self.positions = positions
        try:
            yield
        finally:
            self.positions = None

    def take_taps(self, layer_ids: tuple[int, ...]) -> mx.array | None:
        """The last forward's tapped outputs concatenated on features ([1, T, L*H]), then cleared."""
        taps = mx.concatenate([self.taps[i] for i in layer_ids], axis=-1) if layer_ids else None
        self.taps.clear()
        return taps

    @contextlib.contextmanager
    def recording(self) -> Iterator[Recording]:
        """Record the GDN conv inputs and recurrences of the forward run inside this block."""
        recording = Recording()
        if not self.gdn:
            yield recording
            return
        self.active = recording
        for module, original in self.originals.items():
            setattr(module, "gated_delta_update", self._recorder(original))  # noqa: B010
        try:
            yield recording
        finally:
            for module, original in self.originals.items():
                setattr(module, "gated_delta_update", original)  # noqa: B010
            self.active = None

    def _recorder(self, original: Any) -> Any:
        recording = self.active
        assert recording is not None

        def gated_delta_update(*args: Any, **kwargs: Any) -> Any:
            if sequential_ops():
                fast = with_states(args, kwargs) if FAST_RECURRENCE else None
                y, states = (
                    fast if fast is not None else _step_by_step(original, args, dict(kwargs))
                )
                recording.updates.append((args, kwargs, states))
                return y, state_at(states, args[0].shape[1])
            recording.updates.append((args, kwargs, None))
            return original(*args, **kwargs)

        return gated_delta_update

    def replay(self, gdn: nn.Module) -> Any:
        """mlx-lm's own recurrence for this GDN layer (to replay a kept prefix)."""
        return self.originals[sys.modules[type(gdn).__module__]]
