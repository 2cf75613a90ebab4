"""``/metrics`` by model: with several models, each model's state, memory and load history, and
each loaded chat model's queue, KV budget and prefix cache, labelled by model (docs/operations.md,
"Several models"); with one or several, each loaded chat model's ``dflash_model_info``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from dflash_server.engine.model_slots import LOADED
from dflash_server.engine.models import ModelSet

STATES = ("loaded", "loading", "unloaded")


class ModelGauges(Collector):
    """Read when scraped."""

    def __init__(self, models: ModelSet) -> None:
        self.models = models

    def collect(self) -> Iterator[Any]:
        slots = self.models.slots
        state = GaugeMetricFamily(
            "dflash_model_state", "1 for each model's current state", labels=["model", "state"]
        )
        for slot in slots:
            for name in STATES:
                state.add_metric([slot.id, name], float(slot.state == name))
        yield state
        yield _per_model(
            GaugeMetricFamily, "dflash_model_memory_bytes",
            "what a model takes of the models' memory budget (measured once loaded)",
            {s.id: s.expected for s in slots if s.state != "unloaded"},
        )  # fmt: skip
        yield _per_model(
            GaugeMetricFamily, "dflash_model_requests", "requests waiting for or running on a model",
            {s.id: s.requests for s in slots},
        )  # fmt: skip
        yield _per_model(
            CounterMetricFamily, "dflash_model_loads", "successful loads of a model",
            {s.id: s.loads for s in slots},
        )  # fmt: skip
        yield _per_model(
            GaugeMetricFamily, "dflash_model_load_seconds", "a model's last load's time",
            {s.id: s.load_seconds for s in slots if s.load_seconds is not None},
        )  # fmt: skip
        memory = self.models.memory()
        yield GaugeMetricFamily(
            "dflash_model_memory_budget_bytes", "the loaded models' memory budget (0: none)",
            memory["budget_bytes"],
        )  # fmt: skip
        engines = {s.id: s.engine for s in slots if s.state == LOADED and s.engine is not None}
        yield _per_model(
            GaugeMetricFamily, "dflash_active_requests", "requests generating now",
            {m: e.active for m, e in engines.items()},
        )  # fmt: skip
        yield _per_model(
            GaugeMetricFamily, "dflash_active_rows", "requests running as rows of the batch",
            {m: e.active_rows for m, e in engines.items()},
        )  # fmt: skip
        kv = {m: e.kv_memory for m, e in engines.items() if e.kv_memory is not None}
        yield _per_model(
            GaugeMetricFamily, "dflash_kv_memory_bytes",
            "KV cache memory the running requests reserve",
            {m: v["in_use_bytes"] for m, v in kv.items() if v is not None},
        )  # fmt: skip
        yield _per_model(
            GaugeMetricFamily, "dflash_kv_memory_budget_bytes", "the KV memory budget",
            {m: v["budget_bytes"] for m, v in kv.items() if v is not None},
        )  # fmt: skip
        caches = {m: e.prefix_cache.stats() for m, e in engines.items() if e.prefix_cache}
        for name in ("entries", "bytes", "hits", "misses"):
            kind = CounterMetricFamily if name in ("hits", "misses") else GaugeMetricFamily
            values = {m: st[name] for m, st in caches.items() if name in st}
            yield _per_model(kind, f"dflash_prefix_cache_{name}", f"prefix cache {name}", values)


def _per_model(family: Any, name: str, doc: str, values: dict[str, Any]) -> Any:
    metric = family(name, doc, labels=["model"])
    for model, value in values.items():
        metric.add_metric([model], float(value))
    return metric


class ModelInfo(Collector):
    """``dflash_model_info``: 1 for each loaded chat model, labelled with what it serves (the
    one-model server's and several models' alike; read when scraped)."""

    def __init__(self, models: ModelSet) -> None:
        self.models = models

    def collect(self) -> Iterator[Any]:
        info = GaugeMetricFamily(
            "dflash_model_info",
            "1 for each loaded chat model: its target, drafter and drafter family",
            labels=["model", "target", "draft", "draft_family"],
        )
        for slot in self.models.slots:
            engine = slot.engine
            served = engine.served if engine is not None else None  # None until loaded
            if served is not None and slot.state == LOADED:
                s = served.summary  # no drafter (plain decoding): draft "", family "none"
                info.add_metric([slot.id, s.target, s.draft or "", s.draft_family or "none"], 1)
        yield info
