"""Prefix cache disk tier: a file read back after a restart is restored only when its checksum
holds; a damaged, truncated, reshaped, checksum-less or other models' file is never used (the
request prefills cold, token-identical), a warning names it, and damaged files are removed."""

from __future__ import annotations

import json
import logging
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from dflash_server.chat.prompts import render_chat
from dflash_server.engine.prefix_cache import PrefixCache
from dflash_server.engine.prefix_disk import PrefixDisk
from dflash_server.generation.pair import ModelPair
from dflash_server.generation.prefix import PromptSnapshot
from dflash_server.generation.request import BlockPolicy, GenerationRequest
from dflash_server.generation.stream import generate
from dflash_server.testing import random_drafter
from server_fixtures import make_app, run_server

BIG = 1 << 30
CHAT = [
    {"role": "system", "content": "You are a helpful assistant. " * 8},
    {"role": "user", "content": "What is the capital of France?"},
]


def run(model, draft, tokenizer, prompt, cache) -> tuple[list[int], int]:
    """Greedy tokens of one request and its cached_tokens."""
    request = GenerationRequest(
        tuple(prompt.tokens), 12, checkpoints=prompt.checkpoints, block=BlockPolicy(4)
    )
    pair = ModelPair.of(model, tokenizer, draft)
    out = list(generate(pair, request, prefill_step_size=16, prefix=cache))
    return [t for r in out for t in r.tokens], out[-1].stats.cached_tokens


def split(path: Path) -> tuple[dict[str, Any], bytes]:
    """A safetensors file as (header, tensor bytes)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def join(path: Path, header: dict[str, Any], body: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def zero_middle(path: Path) -> None:
    """The middle half of the tensor bytes zeroed; the header intact."""
    header, body = split(path)
    q = len(body) // 4
    join(path, header, body[:q] + bytes(2 * q) + body[3 * q :])


def zero_header(path: Path) -> None:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    path.write_bytes(bytes(8 + n) + data[8 + n :])


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size * 3 // 4])


def reshape(path: Path) -> None:
    """A valid header giving a tensor another shape of the same size (only the checksum sees it)."""
    header, body = split(path)
    name = next(k for k, t in header.items() if k.startswith("ckpt.") and len(set(t["shape"])) > 2)
    header[name]["shape"] = header[name]["shape"][::-1]
    join(path, header, body)


def wrong_size(path: Path) -> None:
    """A valid header whose shape does not fit the tensor's bytes."""
    header, body = split(path)
    name = next(k for k in header if k.startswith("kv."))
    header[name]["shape"][-1] *= 2
    join(path, header, body)


def old_format(path: Path) -> None:
    """A file as the previous version wrote it: no checksum."""
    header, body = split(path)
    meta = header["__metadata__"]
    meta["format"] = "dflash-prefix-1"
    del meta["checksum"]
    join(path, header, body)


DAMAGE: dict[str, Callable[[Path], None]] = {
    "zeroed middle": zero_middle,
    "zeroed header": zero_header,
    "truncated": truncate,
    "reshaped": reshape,
    "wrong size": wrong_size,
    "no checksum": old_format,
}


@pytest.fixture
def models(tiny_hybrid) -> tuple[Any, Any, Any, Any]:
    model, tokenizer = tiny_hybrid
    draft = random_drafter(model, block_size=4)
    prompt = render_chat(tokenizer, CHAT, enable_thinking=True)
    return model, draft, tokenizer, prompt


def persist(models, folder: Path, fingerprint: str = "models-a") -> tuple[list[int], Path]:
    """One request through a cache with a disk tier, shut down: (its tokens, the file)."""
    model, draft, tokenizer, prompt = models
    cache = PrefixCache(BIG, PrefixDisk(folder, BIG, fingerprint))
    tokens, cached = run(model, draft, tokenizer, prompt, cache)
    cache.close()
    assert cached == 0
    (path,) = folder.glob("*.safetensors")
    return tokens, path


def restarted(folder: Path, fingerprint: str = "models-a") -> PrefixCache:
    return PrefixCache(BIG, PrefixDisk(folder, BIG, fingerprint))


def test_an_undamaged_entry_hits_after_a_restart(models, tmp_path: Path) -> None:
    model, draft, tokenizer, prompt = models
    cold, _ = persist(models, tmp_path)
    cache = restarted(tmp_path)
    warm, cached = run(model, draft, tokenizer, prompt, cache)
    assert warm == cold and cached == len(prompt.tokens) - 1
    assert cache.disk is not None and cache.disk.stats()["reads"] == 1
    cache.close()


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_entry_is_removed_and_the_request_prefills_cold(
    models, tmp_path: Path, caplog, damage: str
) -> None:
    model, draft, tokenizer, prompt = models
    cold, path = persist(models, tmp_path)
    DAMAGE[damage](path)
    with caplog.at_level(logging.WARNING, logger="dflash_server"):
        cache = restarted(tmp_path)
        tokens, cached = run(model, draft, tokenizer, prompt, cache)
    assert tokens == cold and cached == 0
    assert f"{path.name} cannot be verified" in caplog.text
    assert not path.exists()
    assert cache.disk is not None and cache.disk.stats()["reads"] == 0
    assert cache.disk.stats()["rejected"] == 1
    cache.close()  # the cold request's own entry goes to disk again, intact
    again, cached = run(model, draft, tokenizer, prompt, restarted(tmp_path))
    assert again == cold and cached == len(prompt.tokens) - 1


def test_damage_after_the_restart_is_caught_on_read(models, tmp_path: Path, caplog) -> None:
    """The header still indexes; the tensor bytes are checked when the entry is read."""
    model, draft, tokenizer, prompt = models
    cold, path = persist(models, tmp_path)
    cache = restarted(tmp_path)
    assert cache.disk is not None and cache.disk.stats()["entries"] == 1
    zero_middle(path)
    with caplog.at_level(logging.WARNING, logger="dflash_server"):
        tokens, cached = run(model, draft, tokenizer, prompt, cache)
    assert tokens == cold and cached == 0
    assert f"{path.name} cannot be verified (checksum mismatch)" in caplog.text
    assert not path.exists() and cache.disk.stats()["entries"] == 0
    cache.close()


def test_an_entry_of_other_models_is_not_used_and_kept(models, tmp_path: Path, caplog) -> None:
    model, draft, tokenizer, prompt = models
    cold, path = persist(models, tmp_path, fingerprint="models-b")
    with caplog.at_level(logging.WARNING, logger="dflash_server"):
        cache = restarted(tmp_path, fingerprint="models-a")
        tokens, cached = run(model, draft, tokenizer, prompt, cache)
    assert tokens == cold and cached == 0
    assert f"{path.name} belongs to other models" in caplog.text
    assert path.exists()  # still good for the models that wrote it
    _, cached = run(model, draft, tokenizer, prompt, restarted(tmp_path, fingerprint="models-b"))
    assert cached == len(prompt.tokens) - 1


@pytest.mark.slow
def test_a_zeroed_file_over_http_answers_as_cold(
    tiny_hybrid_path: Path, draft4_path: Path, tmp_path: Path
) -> None:
    """The reported case: long system prompt, server restarted on a zeroed disk entry."""
    folder = tmp_path / "cache"
    system = {"role": "system", "content": "Answer in one short sentence. " * 200}
    body = {"messages": [system, CHAT[1]], "temperature": 0, "max_tokens": 8, "logprobs": True}

    def ask() -> tuple[list[str], int]:
        """The answer's tokens (as the API spells them) and its cached_tokens."""
        app = make_app(tiny_hybrid_path, draft4_path, prefix_cache_dir=str(folder))
        with run_server(app) as srv:
            r = httpx.post(f"{srv.base_url}/v1/chat/completions", json=body, timeout=120).json()
        tokens = [t["token"] for t in r["choices"][0]["logprobs"]["content"]]
        return tokens, r["usage"]["prompt_tokens_details"]["cached_tokens"]

    cold, cached = ask()
    assert cached == 0 and len(cold) == 8
    files = list(folder.glob("*.safetensors"))
    assert files
    for path in files:
        zero_middle(path)
    assert ask() == (cold, 0)
    assert not any(p.exists() for p in files)
    assert ask()[1] > 0  # the cold request's entry was written again, intact


def test_a_partial_write_left_by_a_killed_process_is_deleted_at_start(
    models, tmp_path: Path, caplog
) -> None:
    """A process killed mid-write leaves its file in ``.partial/`` (never renamed into the
    folder): the next start deletes it and keeps the complete entries."""
    model, draft, tokenizer, prompt = models
    cold, path = persist(models, tmp_path)
    torn = tmp_path / ".partial" / "0123456789abcdef0123456789abcdef.safetensors"
    torn.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="dflash_server"):
        cache = restarted(tmp_path)
    assert "removed 1 partial write(s)" in caplog.text and not torn.exists()
    tokens, cached = run(model, draft, tokenizer, prompt, cache)
    assert tokens == cold and cached == len(prompt.tokens) - 1
    cache.close()


def test_a_full_folder_stops_writes_with_one_warning(
    models, tmp_path: Path, caplog, monkeypatch
) -> None:
    """MLX's own failure on a full disk (half a file written, then RuntimeError): one warning,
    the torn file removed, no more writes; the RAM tier still serves and answers are unchanged."""
    import mlx.core as mx

    save = mx.save_safetensors

    def full(path: str, arrays: dict, metadata: dict) -> None:
        save(path, arrays, metadata=metadata)
        Path(path).write_bytes(Path(path).read_bytes()[:1000])
        raise RuntimeError("[write] Unable to write 3145829 bytes to file.")

    monkeypatch.setattr(mx, "save_safetensors", full)
    model, draft, tokenizer, prompt = models
    cold, _ = run(model, draft, tokenizer, prompt, PrefixCache(BIG))
    disk = PrefixDisk(tmp_path, BIG, "models-a")
    cache = PrefixCache(1, disk)  # every entry goes straight to the disk tier
    with caplog.at_level(logging.WARNING, logger="dflash_server"):
        for _ in range(3):
            tokens, _ = run(model, draft, tokenizer, prompt, cache)
            disk.flush()
            assert tokens == cold
    assert caplog.text.count("cannot write to") == 1 and not disk.writable
    assert not list(tmp_path.rglob("*.safetensors")) and disk.stats()["writes"] == 0
    ram = PrefixCache(BIG, disk)
    run(model, draft, tokenizer, prompt, ram)
    tokens, cached = run(model, draft, tokenizer, prompt, ram)
    assert tokens == cold and cached == len(prompt.tokens) - 1  # the RAM tier hits
    ram.close()


def test_a_folder_that_cannot_be_made_leaves_the_ram_tier(models, tmp_path: Path, caplog) -> None:
    (tmp_path / "file").write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="dflash_server"):
        disk = PrefixDisk(tmp_path / "file" / "cache", BIG, "models-a")
    assert "cannot write to" in caplog.text and not disk.writable
    model, draft, tokenizer, prompt = models
    cache = PrefixCache(BIG, disk)
    cold, _ = run(model, draft, tokenizer, prompt, cache)
    tokens, cached = run(model, draft, tokenizer, prompt, cache)
    assert tokens == cold and cached == len(prompt.tokens) - 1
    cache.close()


@pytest.mark.parametrize("room", [2.0, 0.5])  # snapshots' worth of queue
def test_a_slow_disk_makes_saves_wait_and_none_is_dropped(
    tmp_path: Path, monkeypatch, room: float
) -> None:
    """Snapshots waiting for the writer are held in memory: past ``max_pending`` bytes (one may
    always wait, however large) ``save`` waits for the writer instead of growing or dropping."""
    import mlx.core as mx

    gate, write = threading.Event(), PrefixDisk._write
    monkeypatch.setattr(PrefixDisk, "_write", lambda self, *a: gate.wait() and write(self, *a))
    keys = mx.zeros((1, 2, 8, 4))
    mx.eval(keys)  # as the worker's snapshots are: the writer thread only reads them
    snaps = [PromptSnapshot(tuple(range(i, i + 8)), [(keys, keys)], None) for i in range(3)]
    size = snaps[0].nbytes
    disk = PrefixDisk(tmp_path, BIG, "m", max_pending=int(room * size))
    saver = threading.Thread(target=lambda: [disk.save(("k",), s) for s in snaps])
    saver.start()
    queued = max(1, int(room)) * size
    deadline = time.monotonic() + 10
    while disk.pending < queued and time.monotonic() < deadline:
        time.sleep(0.01)
    saver.join(0.3)
    assert saver.is_alive() and disk.stats()["pending_bytes"] == queued  # the rest waits
    gate.set()
    saver.join(10)
    disk.flush()
    assert not saver.is_alive() and disk.pending == 0 and disk.stats()["writes"] == 3
    disk.close()


def test_a_stalled_disk_stops_the_writes_instead_of_the_worker(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    """A write that never finishes (a hung disk): a save waiting for room gives up after
    ``STALLED_S`` with one warning and the tier stops writing, as after a failed write."""
    import mlx.core as mx

    from dflash_server.engine import prefix_disk

    gate, write = threading.Event(), PrefixDisk._write
    monkeypatch.setattr(PrefixDisk, "_write", lambda self, *a: gate.wait() and write(self, *a))
    monkeypatch.setattr(prefix_disk, "STALLED_S", 0.2)
    keys = mx.zeros((1, 2, 8, 4))
    mx.eval(keys)
    snaps = [PromptSnapshot(tuple(range(i, i + 8)), [(keys, keys)], None) for i in range(2)]
    disk = PrefixDisk(tmp_path, BIG, "m", max_pending=snaps[0].nbytes)
    with caplog.at_level(logging.WARNING, logger="dflash_server"):
        for s in snaps:
            disk.save(("k",), s)  # the second waits 0.2 s, then returns
    assert not disk.writable and caplog.text.count("no write finished in 0.2 s") == 1
    gate.set()
    disk.flush()
    # The write in flight ends when the disk comes back; the one that waited was never queued.
    assert disk.pending == 0 and disk.stats()["writes"] == 1
    disk.close()
