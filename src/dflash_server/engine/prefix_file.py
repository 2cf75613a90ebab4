"""The prefix cache's file format: a ``PromptSnapshot`` as safetensors tensors and metadata.

The metadata holds the models' fingerprint, the snapshot kind, its token ids and checkpoint
positions (so the disk tier's index is rebuilt from headers alone), and a checksum of all of
that and of every tensor (name, dtype, shape, bytes), verified before a file is restored: a
damaged snapshot would silently change answers (docs/design.md, "Prefix cache internals").
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np

from dflash_server.generation.prefix import (
    Checkpoint,
    LayerKV,
    PromptSnapshot,
    QuantKV,
    layer_arrays,
)

FORMAT = "dflash-prefix-2"  # -1: no checksum
CHECKSUM = "sha256"  # hardware-accelerated on x86 and Apple silicon: ~2 GB/s a core


class Damaged(ValueError):
    """A file of ours that cannot be trusted: it is removed."""


def read_header(path: Path) -> dict[str, str]:
    """The metadata; raises if the header is broken or the tensors overrun the file."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > 64 * 2**20:
            raise ValueError("header too large")
        header = json.loads(f.read(size))
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + size + end != path.stat().st_size:
        raise ValueError(f"{path.stat().st_size} bytes, the header describes {8 + size + end}")
    return header.get("__metadata__") or {}


def digest(meta: dict[str, str], arrays: dict[str, mx.array], threads: int = 1) -> str:
    """Checksum of the metadata (but the checksum itself) and of every tensor's name, dtype,
    shape and bytes; the tensors are hashed on ``threads`` threads (hashlib frees the GIL)."""

    def tensor(name: str) -> bytes:
        a = arrays[name]
        h = hashlib.new(CHECKSUM, json.dumps([name, str(a.dtype), a.shape]).encode())
        h.update(memoryview(a))  # type: ignore[arg-type]  # mx.array is a buffer (row-contiguous)
        return h.digest()

    names = sorted(arrays)
    with ThreadPoolExecutor(max(1, threads)) as pool:
        digests = list(pool.map(tensor, names))
    h = hashlib.new(CHECKSUM)
    h.update(
        json.dumps({k: v for k, v in meta.items() if k != "checksum"}, sort_keys=True).encode()
    )
    for d in digests:
        h.update(d)
    return f"{CHECKSUM}:{h.hexdigest()}"


def encode(
    snapshot: PromptSnapshot, kind: tuple, fingerprint: str
) -> tuple[dict[str, mx.array], dict[str, str]]:
    """A snapshot as the tensors and metadata (checksum included) of one file."""
    arrays: dict[str, mx.array] = {}
    layers = []
    for i, pair in enumerate(snapshot.kv):
        if isinstance(pair, QuantKV):
            layers.append(f"kv:{pair.bits}:{pair.group_size}")
            for part, (keys, values) in enumerate(zip(pair.keys, pair.values)):
                arrays[f"kv.{i}.keys.{part}"], arrays[f"kv.{i}.values.{part}"] = keys, values
        else:
            layers.append("recurrent" if pair is None else "kv")
            if pair is not None:
                arrays[f"kv.{i}.keys"], arrays[f"kv.{i}.values"] = pair
    for i, pair in enumerate(snapshot.draft_kv or []):
        arrays[f"draft.{i}.keys"], arrays[f"draft.{i}.values"] = pair
    layout = {}  # position -> (slots per recurrent layer, whether drafter windows are kept)
    for p, checkpoint in snapshot.checkpoints.items():
        for j, slots in enumerate(checkpoint.recurrent):
            arrays |= {f"ckpt.{p}.{j}.{k}": a for k, a in enumerate(slots) if a is not None}
        for i, pair in enumerate(checkpoint.draft or []):
            if pair is not None:
                arrays[f"dckpt.{p}.{i}.keys"], arrays[f"dckpt.{p}.{i}.values"] = pair
        layout[p] = ([len(s) for s in checkpoint.recurrent], checkpoint.draft is not None)
    arrays = {k: mx.contiguous(a) for k, a in arrays.items()}  # a copy only where sliced
    mx.eval(arrays)
    tokens = np.asarray(snapshot.tokens, dtype=np.int32)
    meta = {
        "format": FORMAT,
        "fingerprint": fingerprint,
        "kind": json.dumps(list(kind)),
        "tokens": base64.b64encode(tokens.tobytes()).decode(),
        "checkpoints": json.dumps(sorted(snapshot.checkpoints)),
        "checkpoints_layout": json.dumps(layout),
        "recurrent": "1" if snapshot.recurrent else "0",
        "layers": json.dumps(layers),
        "draft_layers": str(len(snapshot.draft_kv or [])),
    }
    meta["checksum"] = digest(meta, arrays)
    return arrays, meta


def decode(arrays: dict[str, mx.array], meta: dict[str, str]) -> PromptSnapshot:
    """A file's tensors and metadata (its checksum verified) back into a snapshot; raises
    ``Damaged`` where they do not fit together."""
    tokens = stored_tokens(meta)
    # Per target layer: "kv", "recurrent", or "kv:<bits>:<group size>" (quantized).
    layers = json.loads(meta["layers"])
    kv = [_stored_kv(arrays, i, kind) for i, kind in enumerate(layers)]
    n_draft = int(meta["draft_layers"])
    draft_kv = [_stored_pair(arrays, f"draft.{i}") for i in range(n_draft)] if n_draft else None
    checkpoints: dict[int, Checkpoint] = {}
    for p, (slots, windowed) in json.loads(meta["checkpoints_layout"]).items():
        recurrent = [
            [arrays.get(f"ckpt.{p}.{j}.{k}") for k in range(n)] for j, n in enumerate(slots)
        ]
        draft = [_pair(arrays, f"dckpt.{p}.{i}") for i in range(n_draft)] if windowed else None
        checkpoints[int(p)] = Checkpoint(recurrent, draft)
    if any(
        a.shape[-2] != len(tokens) for pair in kv if pair is not None for a in layer_arrays(pair)
    ):
        raise Damaged(f"attention KV of another length than its {len(tokens)} tokens")
    return PromptSnapshot(tuple(int(t) for t in tokens), kv, draft_kv, checkpoints)


def _as_tuple(value: object) -> object:
    """JSON lists back into the nested tuples a snapshot kind is made of."""
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list) else value


def kind_of(meta: dict[str, str]) -> tuple:
    """The snapshot kind a file's metadata names (stored as JSON) as its tuple."""
    text = meta["kind"]
    kind = _as_tuple(json.loads(text))
    if not isinstance(kind, tuple):
        raise Damaged(f"snapshot kind {text[:40]!r} is not a list")
    return kind


def stored_tokens(meta: dict[str, str]) -> np.ndarray:
    """The token ids a file's metadata names (int32)."""
    return np.frombuffer(base64.b64decode(meta["tokens"]), dtype=np.int32)


def _stored_kv(arrays: dict[str, mx.array], i: int, kind: str) -> LayerKV | None:
    """Target layer ``i``'s stored attention KV (None: a recurrent layer)."""
    if kind == "recurrent":
        return None
    if kind == "kv":
        return _stored_pair(arrays, f"kv.{i}")
    _, bits, group_size = kind.split(":")
    keys = tuple(arrays[f"kv.{i}.keys.{part}"] for part in range(3))
    values = tuple(arrays[f"kv.{i}.values.{part}"] for part in range(3))
    return QuantKV(keys, values, int(bits), int(group_size))  # type: ignore[arg-type]


def _pair(arrays: dict[str, mx.array], prefix: str) -> tuple[mx.array, mx.array] | None:
    keys = arrays.get(f"{prefix}.keys")
    return None if keys is None else (keys, arrays[f"{prefix}.values"])


def _stored_pair(arrays: dict[str, mx.array], prefix: str) -> tuple[mx.array, mx.array]:
    pair = _pair(arrays, prefix)
    if pair is None:
        raise Damaged(f"{prefix} is missing")
    return pair
