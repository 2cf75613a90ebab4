"""Training data for ``dflash-serve train``: text in, token windows and tapped hidden states out.

Hidden states come from one of two sources with the same interface:

* ``OnTheFly`` runs the frozen target on each batch. No disk, any data size, but every step pays a
  target forward (usually the dominant cost: the target is many times the drafter's size).
* ``DiskCache`` runs the target once over all windows and stores taps (float16) plus the target's
  greedy labels in shards. Steps then cost only the drafter, which pays off over several epochs,
  at ``T * L * H * 2`` bytes per window (5 taps of a 4096-wide target: 40 KiB per token).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from dflash_server.generation.target import TargetModel
from dflash_server.models.loading import load_arrays

_SKIP_DIRS = {".git", "__pycache__", ".venv", "node_modules", ".tox"}


def _jsonl_texts(path: Path, tokenizer: Any) -> Iterable[list[int]]:
    """One document per line: ``{"messages": [...]}`` (chat template), ``{"text": ...}``,
    ``{"prompt", "completion"}``, or a bare JSON string."""
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
        if isinstance(row, str):
            yield tokenizer.encode(row)
        elif isinstance(row, dict) and isinstance(row.get("messages"), list):
            yield list(tokenizer.apply_chat_template(row["messages"], tokenize=True))
        elif isinstance(row, dict) and isinstance(row.get("text"), str):
            yield tokenizer.encode(row["text"])
        elif isinstance(row, dict) and "prompt" in row and "completion" in row:
            yield tokenizer.encode(str(row["prompt"]) + str(row["completion"]))
        else:
            raise ValueError(
                f'{path}:{n}: expected {{"messages": [...]}}, {{"text": "..."}}, '
                '{"prompt": ..., "completion": ...} or a JSON string'
            )


def _text_files(folder: Path) -> list[Path]:
    files = []
    for f in sorted(folder.rglob("*")):
        if f.is_file() and not _SKIP_DIRS & set(f.relative_to(folder).parts[:-1]):
            files.append(f)
    return files


def load_documents(
    data: str | Path, tokenizer: Any, max_files: int | None = None
) -> list[list[int]]:
    """Token ids per document from a JSONL file, a text file, or a folder of text files.

    Binary or non-UTF-8 files in a folder are skipped; JSONL files in a folder are parsed as JSONL.
    """
    path = Path(data).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"--data {path} does not exist")
    files = _text_files(path) if path.is_dir() else [path]
    docs: list[list[int]] = []
    for f in files[:max_files]:
        if f.suffix == ".jsonl":
            docs.extend(d for d in _jsonl_texts(f, tokenizer) if d)
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip() and "\x00" not in text:
            docs.append(tokenizer.encode(text))
    return docs


def make_windows(docs: Sequence[list[int]], seq_len: int, separator: int | None) -> np.ndarray:
    """Pack documents (separated by ``separator``, e.g. EOS) into ``[N, seq_len]`` windows.

    Packing avoids padding: every position trains, and a window crossing a document boundary
    still shows the target exactly what it saw (its taps come from the same packed sequence).
    """
    stream: list[int] = []
    for d in docs:
        stream.extend(d)
        if separator is not None:
            stream.append(separator)
    n = len(stream) // seq_len
    return np.asarray(stream[: n * seq_len], dtype=np.int32).reshape(n, seq_len)


def target_forward(
    target: TargetModel, tokens: mx.array, labels: bool, final: bool = False
) -> tuple[mx.array, ...]:
    """Taps ``[N, T, L*H]``, (if ``labels``) the target's greedy labels ``[N, T]`` and (if
    ``final``) its final-normed hidden states ``[N, T, H]``, from one target pass.

    ``labels[:, p]`` = argmax of the target's logits at row p-1, i.e. what greedy decoding would
    put at position p; position 0 has no prediction and keeps its data token. ``final`` is what
    DSpark's and EAGLE-3's losses turn into target probabilities (only at the rows they read:
    ``T x V`` logits per window would not fit a cache).
    """
    # TargetModel.forward's two halves, so the final hidden state can be kept as well.
    hidden = target.parts.backbone(tokens, None)
    taps = target.hooks.take_taps(target.tap_ids)
    assert taps is not None, "the target is tapped for the drafter"
    out = [mx.stop_gradient(taps)]
    if labels:
        pred = mx.argmax(target.parts.lm_head(hidden[:, :-1]), axis=-1).astype(tokens.dtype)
        out.append(mx.concatenate([tokens[:, :1], pred], axis=1))
    if final:
        out.append(mx.stop_gradient(hidden))
    return tuple(out)


Batch = tuple[mx.array, mx.array, mx.array, mx.array | None]


class HiddenSource(Protocol):
    def batch(self, rows: np.ndarray) -> Batch:
        """(tokens, labels, taps, final hidden states or None) of the training windows ``rows``."""
        ...


class OnTheFly:
    """Runs the frozen target on every batch; labels from the target or from the data;
    ``final``: keep its final hidden states too."""

    def __init__(
        self, target: TargetModel, windows: np.ndarray, target_labels: bool, final: bool = False
    ):
        self.target, self.windows, self.target_labels = target, windows, target_labels
        self.final = final

    def batch(self, rows: np.ndarray) -> Batch:
        tokens = mx.array(self.windows[rows])
        out = list(target_forward(self.target, tokens, self.target_labels, self.final))
        taps = out.pop(0)
        labels = out.pop(0) if self.target_labels else tokens
        return tokens, labels, taps, out.pop(0) if self.final else None


class DiskCache:
    """Taps and target labels of every window (and with ``final`` its final hidden states),
    computed once, stored as float16 shards."""

    def __init__(
        self,
        folder: Path,
        windows: np.ndarray,
        target_labels: bool,
        shard: int = 32,
        final: bool = False,
    ):
        self.folder, self.windows, self.target_labels = folder, windows, target_labels
        self.shard, self.final = shard, final
        self._loaded: tuple[int, dict[str, mx.array]] | None = None

    @staticmethod
    def fingerprint(
        windows: np.ndarray, target_id: str, tap_ids: Sequence[int], final: bool = False
    ) -> str:
        h = hashlib.sha256(windows.tobytes())
        key: list[Any] = [target_id, list(tap_ids), list(windows.shape)]
        h.update(json.dumps([*key, "final"] if final else key).encode())
        return h.hexdigest()[:16]

    def build(self, target: TargetModel, target_id: str, progress: Any = None) -> bool:
        """Fill the cache unless a matching one exists; return True if it was (re)built."""
        meta_file = self.folder / "meta.json"
        key = self.fingerprint(self.windows, target_id, target.tap_ids, self.final)
        if meta_file.exists() and json.loads(meta_file.read_text()).get("fingerprint") == key:
            return False
        self.folder.mkdir(parents=True, exist_ok=True)
        meta_file.unlink(missing_ok=True)  # an interrupted build must not look complete
        for i, start in enumerate(range(0, len(self.windows), self.shard)):
            tokens = mx.array(self.windows[start : start + self.shard])
            parts: dict[str, list[mx.array]] = {"taps": [], "labels": [], "final": []}
            for j in range(tokens.shape[0]):  # one window at a time bounds the target's memory
                t, lab, *fin = target_forward(target, tokens[j : j + 1], True, self.final)
                parts["taps"].append(t.astype(mx.float16))
                parts["labels"].append(lab)
                parts["final"].extend(f.astype(mx.float16) for f in fin)
                mx.eval(t, lab, *fin)
            arrays = {k: mx.concatenate(v) for k, v in parts.items() if v}
            arrays["tokens"] = tokens
            mx.save_safetensors(str(self.folder / f"shard-{i:05d}.safetensors"), arrays)
            if progress is not None:
                progress(tokens.shape[0])
        meta = {"fingerprint": key, "windows": len(self.windows), "shard": self.shard}
        meta_file.write_text(json.dumps(meta))
        return True

    def shard_rows(self, rng: np.random.Generator, batch: int) -> np.ndarray:
        """Rows of one random shard, so a step reads a single file."""
        n_shards = -(-len(self.windows) // self.shard)
        s = int(rng.integers(n_shards))
        size = min(self.shard, len(self.windows) - s * self.shard)
        return s * self.shard + rng.choice(size, size=batch, replace=size < batch)

    def batch(self, rows: np.ndarray) -> Batch:
        s = int(rows[0]) // self.shard
        if self._loaded is None or self._loaded[0] != s:
            self._loaded = (s, load_arrays(self.folder / f"shard-{s:05d}.safetensors"))
        data = self._loaded[1]
        local = mx.array(rows - s * self.shard)
        tokens = data["tokens"][local]
        labels = data["labels"][local] if self.target_labels else tokens
        final = data["final"][local] if self.final else None
        return tokens, labels, data["taps"][local], final


def estimate_cache_bytes(windows: np.ndarray, num_taps: int, hidden: int) -> int:
    """float16 taps (plus one more ``hidden``-wide row per token when the final state is kept:
    pass ``num_taps + 1``)."""
    return int(windows.size) * num_taps * hidden * 2
