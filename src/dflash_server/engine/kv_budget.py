"""The KV memory budget: requests are admitted while their caches fit in it.

See docs/operations.md, "KV memory budget". Each admitted request reserves what its caches may
hold at prompt + max new tokens (``generation/kv_memory.py``); a waiting request is admitted
once its reservation fits beside the running ones, and one that could not fit even alone is
refused at submission. Batched rows share one K/V buffer as wide as the longest row, so there
the attention part is charged at the longest reservation for every row.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Hashable
from pathlib import Path

import mlx.core as mx

from dflash_server.engine.loader import LoadedModels
from dflash_server.generation.kv_memory import KVGeometry, attention_bytes, kv_bytes, kv_geometry
from dflash_server.generation.kv_quant import KVQuant
from dflash_server.generation.request import GenerationRequest

log = logging.getLogger("dflash_server")
# The default budget's share of the memory left once the weights and the prefix cache's RAM
# tier are taken: the rest covers activations, batch holes and the copies a growing buffer makes.
DEFAULT_SHARE = 0.75


class KVBudgetExceeded(Exception):
    """A request whose caches could not fit in the KV budget even alone."""

    def __init__(self, needed: int, budget: int, retry_after: int) -> None:
        super().__init__(
            f"this request needs {gib(needed)} of KV memory (prompt + max_tokens) but the "
            f"server's KV budget is {gib(budget)}: shorten the prompt or lower max_tokens, or "
            "start the server with a larger --max-kv-memory"
        )
        self.needed, self.budget, self.retry_after = needed, budget, retry_after


_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_UNITS |= {f"{u}ib": n for u, n in list(_UNITS.items()) if u not in ("", "b")}
_UNITS |= {f"{u}b": 1000 ** (i + 1) for i, u in enumerate("kmgt")}


def parse_size(value: object) -> int | None:
    """``--max-kv-memory``: bytes, or a size (``8GB`` = 8 x 10^9, ``8GiB`` and ``8G`` = 8 x 2^30,
    ``512MiB``); 0, ``none`` or ``off``: no budget; None or ``auto``: the default."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    text = str(value).strip().lower().replace(" ", "")
    if text in ("", "auto"):
        return None
    if text in ("none", "off"):
        return 0
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]*)", text)
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(
            f"max_kv_memory must be a size such as 8GB, 512MiB or a number of bytes, or 'none' "
            f"(no budget), got {value!r}"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def gib(n: int) -> str:
    if n >= 2**26:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**24 else f"{n / 2**10:,.0f} KiB"


def machine_memory() -> int:
    """Memory MLX may use: Metal's recommended working set, else the machine's RAM."""
    info = mx.device_info()
    for key in ("max_recommended_working_set_size", "memory_size"):
        value = info.get(key)
        if isinstance(value, int) and value > 0:
            return value
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - exotic platforms
        return 16 * 1024**3


def default_budget(weights: int, prefix_cache: int, memory: int | None = None) -> int:
    """``DEFAULT_SHARE`` of the memory the weights and the prefix cache's RAM tier leave."""
    memory = machine_memory() if memory is None else memory
    return max(0, int(DEFAULT_SHARE * (memory - weights - prefix_cache)))


class KVLedger:
    """The running requests' reservations against ``budget`` bytes (not thread-safe: the
    engine holds its lock around every call)."""

    def __init__(
        self,
        geometry: KVGeometry,
        budget: int,
        *,
        padded: bool,
        kv: KVQuant | None = None,
    ) -> None:
        self.geometry, self.budget, self.padded, self.kv = geometry, budget, padded, kv
        self.held: dict[Hashable, int] = {}  # each running request's positions

    def _full_precision_part(self, tokens: int) -> int:
        """What the first ``kv.start`` positions add while still in full precision (they are
        quantized with the rest once a cache holds ``start``: counted whole, so the estimate
        stays monotonic and covers the moment both copies exist)."""
        if self.kv is None:
            return 0
        g, n = self.geometry, min(tokens, self.kv.start)
        quantized = attention_bytes(g, n, kv_bits=self.kv.bits, group_size=self.kv.group_size)
        return attention_bytes(g, n) - quantized

    def _alone(self, tokens: int) -> int:
        bits, group = (None, None) if self.kv is None else (self.kv.bits, self.kv.group_size)
        quantized = kv_bytes(self.geometry, tokens, kv_bits=bits, group_size=group)
        return quantized + self._full_precision_part(tokens)

    def _attention(self, tokens: int) -> int:
        bits, group = (None, None) if self.kv is None else (self.kv.bits, self.kv.group_size)
        quantized = attention_bytes(self.geometry, tokens, kv_bits=bits, group_size=group)
        return quantized + self._full_precision_part(tokens)

    def need(self, tokens: list[int]) -> int:
        """Bytes that requests of these positions hold together."""
        total = sum(self._alone(t) for t in tokens)
        if self.padded and len(tokens) > 1:  # every row as wide as the longest
            widest = self._attention(max(tokens))
            total += sum(widest - self._attention(t) for t in tokens)
        return total

    @property
    def in_use(self) -> int:
        return self.need(list(self.held.values()))

    def alone(self, tokens: int) -> int:
        return self.need([tokens])

    def fits(self, tokens: int) -> bool:
        """Whether a request of ``tokens`` positions fits beside the running ones."""
        return self.need([*self.held.values(), tokens]) <= self.budget

    def room(self, prompt: int) -> int:
        """The most new tokens a request of ``prompt`` tokens may reserve alone (0: none)."""
        if self.alone(prompt + 1) > self.budget:
            return 0
        low, high = 1, 1
        while self.alone(prompt + 2 * high) <= self.budget and high < 2**40:
            high *= 2
        high *= 2
        while low < high:  # the largest n with alone(prompt + n) within the budget
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self.alone(prompt + mid) <= self.budget else (low, mid - 1)
        return low

    def admit(self, key: Hashable, tokens: int, busy: bool) -> bool:
        """Reserve ``tokens`` positions for ``key`` if they fit beside the running requests, or
        nothing runs (``busy`` False: alone it fits, or it was refused at submission)."""
        if busy and not self.fits(tokens):
            return False
        self.held[key] = tokens
        return True

    def release(self, key: Hashable) -> None:
        self.held.pop(key, None)


def positions(request: GenerationRequest) -> int:
    """The positions a request reserves: its prompt and every token it may generate."""
    return len(request.prompt) + request.max_tokens


def build_ledger(
    models: LoadedModels,
    max_kv_memory: int | None,
    prefix_cache: int,
    *,
    padded: bool,
    kv: KVQuant | None = None,
    default_cap: int | None = None,
) -> KVLedger | None:
    """The loaded pair's ledger (None: no budget). ``max_kv_memory``: bytes, 0 for none, None
    for the default (``default_budget`` of the memory in use now: the weights, after loading;
    with ``default_cap``, one of several models: one request at the context length, at most
    the cap, docs/operations.md "Several models")."""
    if max_kv_memory == 0:
        log.info("KV memory budget: none (--max-kv-memory 0)")
        return None
    s = models.summary
    block = max(s.block_size or 1, s.suffix_tokens + 1)
    geometry = kv_geometry(models.pair.model, models.pair.draft, block)
    if geometry is None:
        log.warning("KV memory budget: none (the target's cache layout is not one it can size)")
        return None
    if max_kv_memory is None and default_cap is not None:
        whole = KVLedger(geometry, 0, padded=padded, kv=kv).alone(s.context_length)
        budget, how = min(whole, default_cap), "one request at the context length"
    elif max_kv_memory is None:
        weights = mx.get_active_memory()
        budget, how = default_budget(weights, prefix_cache), "default"
    else:
        budget, how = max_kv_memory, "--max-kv-memory"
    ledger = KVLedger(geometry, budget, padded=padded, kv=kv)
    room = ledger.room(0)
    log.info(
        "KV memory budget: %s (%s); one request alone may hold %d positions", gib(budget), how, room
    )
    if room == 0:
        log.warning(
            "KV memory budget %s holds no request at all (one alone needs %s): every request "
            "will get 503; raise --max-kv-memory",
            gib(budget),
            gib(ledger.alone(1)),
        )
    return ledger
