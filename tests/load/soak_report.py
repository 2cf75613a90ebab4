"""The soak's report (tests/load/soak.py): what came back, summed up per server and per kind of
request, the verdict, and the Markdown of it all."""

from __future__ import annotations

import json
import statistics
from typing import Any

from soak_memory import BUDGETS, MB
from soak_requests import PROTOCOLS, Spec
from soak_traffic import Outcome

LEAK_SLACK = 32 * MB  # RSS growth no cache explains (allocator and interpreter noise) allowed
JUDGE_MINUTES = 5  # a shorter run (the test's) need not judge memory nor reach every kind


def _pct(values: list[float], q: int) -> float | None:
    values = sorted(values)
    if len(values) < 2:
        return round(values[0], 3) if values else None
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1], 3)


def _checked(outcomes: list[Outcome], refs: dict[tuple[str, int], str]) -> list[Outcome]:
    """The answers a solo run decides: greedy, whole, no error."""
    return [
        o for o in outcomes
        if (o.spec.server, o.spec.n) in refs and o.status == 200 and o.finished
        and not o.disconnected and o.error is None
    ]  # fmt: skip


def summarize(
    outcomes: list[Outcome], refs: dict[tuple[str, int], str], specs: list[Spec]
) -> dict[str, Any]:
    """Requests by status, server, protocol and kind (each kind of ``specs``, the mixes, has a
    row, sent or not); greedy answers against their solo runs; latency percentiles."""
    by_status: dict[str, int] = {}
    transport: dict[str, int] = {}
    for o in outcomes:
        key = str(o.status) if o.status else "no answer"
        by_status[key] = by_status.get(key, 0) + 1
        if o.transport:
            phase = f"{o.spec.server}: {o.phase}"
            transport[phase] = transport.get(phase, 0) + 1
    checked = _checked(outcomes, refs)
    mismatched = [o for o in checked if o.answer != refs[(o.spec.server, o.spec.n)]]
    unfinished = [
        o for o in outcomes
        if o.status == 200 and not o.finished and not o.disconnected and o.phase != "kill -9"
    ]  # fmt: skip
    done = [o for o in outcomes if o.status == 200 and o.finished]
    latency = {"e2e_p50_s": _pct([o.e2e for o in done], 50)}
    latency["e2e_p99_s"] = _pct([o.e2e for o in done], 99)
    ttft = [o.ttft for o in outcomes if o.ttft is not None]
    latency |= {"ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99)}
    for protocol in PROTOCOLS:
        e2e = [o.e2e for o in done if o.spec.protocol == protocol]
        latency[f"{protocol}_e2e_p50_s"] = _pct(e2e, 50)
        latency[f"{protocol}_e2e_p99_s"] = _pct(e2e, 99)
    by_kind: dict[str, dict[str, Any]] = {
        f"{s.server} {s.kind}": {"sent": 0, "ok": 0} for s in specs
    }
    for o in outcomes:
        row = by_kind[f"{o.spec.server} {o.spec.kind}"]
        row["sent"] += 1
        row["ok"] += o.status == 200
    for name, row in by_kind.items():
        mine = [o for o in checked if f"{o.spec.server} {o.spec.kind}" == name]
        row["checked"] = len(mine)
        row["mismatches"] = sum(o in mismatched for o in mine)
        row["e2e_p50_s"] = _pct(
            [o.e2e for o in done if f"{o.spec.server} {o.spec.kind}" == name], 50
        )
    return {
        "requests": {
            "total": len(outcomes),
            "by_status": dict(sorted(by_status.items())),
            "transport_errors_by_phase": transport,
            "errors_in_200": sum(o.status == 200 and o.error is not None for o in outcomes),
            "disconnected": sum(o.disconnected for o in outcomes),
            "streamed": sum(o.spec.stream for o in outcomes),
            "by_server": _count(o.spec.server for o in outcomes),
            "by_protocol": _count(o.spec.protocol for o in outcomes),
            "greedy_checked": len(checked),
            "greedy_mismatch": [
                (o.spec.server, o.spec.n, o.spec.kind, o.phase) for o in mismatched
            ],
            "unfinished": [(o.spec.server, o.spec.n, o.phase) for o in unfinished],
        },
        "by_kind": dict(sorted(by_kind.items())),
        "latency": latency,
    }


def _count(keys: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for k in keys:
        out[k] = out.get(k, 0) + 1
    return dict(sorted(out.items()))


def verdict(report: dict) -> tuple[bool, list[str]]:
    failures = []
    req = report["requests"]
    long_run = report["minutes"] >= JUDGE_MINUTES
    if any(k.startswith("5") for k in req["by_status"]):
        failures.append(f"5xx answers: {req['by_status']}")
    if req["greedy_mismatch"]:
        failures.append(f"greedy answers differ from their solo runs: {req['greedy_mismatch']}")
    if req["unfinished"]:
        failures.append(f"streams without their last event: {req['unfinished']}")
    if not req["greedy_checked"]:
        failures.append("no greedy answer was checked")
    for name, health in report["health_at_end"].items():
        if health.get("status") != "ready":
            failures.append(f"{name}: health at the end: {health}")
    if long_run:  # the long run must have checked each kind on each server
        unchecked = [k for k, row in report["by_kind"].items() if not row["checked"]]
        if unchecked:
            failures.append(f"kinds never checked against their solo run: {unchecked}")
    copied = sum(c["suffix"] for c in report["committed"].values())
    if not copied:
        failures.append(f"no suffix copy was committed: {report['committed']}")
    for server, memory in report["memory"].items():
        runs = memory["analysis"]
        # A short run on a slow machine may not last long enough to judge growth (its caches'
        # budgets are still checked below); the long run must.
        if not any(run["judged"] for run in runs.values()) and long_run:
            failures.append(f"{server}: no server run lasted long enough to judge its memory")
        for name, run in runs.items():
            if run["judged"] and run["unexplained_max_growth_mb"] * MB > LEAK_SLACK:
                growth = run["unexplained_max_growth_mb"]
                failures.append(f"{name}: RSS grew {growth} MB beyond caches")
            for cache, budget in BUDGETS.items():
                if run[f"{cache}_max_mb"] * MB > budget * 1.01:
                    failures.append(
                        f"{name}: {cache} above its budget ({run[f'{cache}_max_mb']} MB)"
                    )
    for name, fault in report["faults"].items():
        if fault.get("ok") is False:
            failures.append(f"{name}: {fault}")
    kill = report["faults"].get("kill -9 mid-write")
    if kill and kill["partial_after_start"]:
        failures.append("the start after kill -9 left partial files")
    if kill and long_run and not kill["left_in_partial"]:  # the start's clean-up went untried
        failures.append(f"kill -9 left no partial disk-tier write: {kill}")
    for name in ("read-only folder", "full folder"):
        if name in report["faults"] and report["faults"][name]["warnings"] != 1:
            failures.append(f"{name}: {report['faults'][name]['warnings']} warnings, not one")
    return not failures, failures


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows] + [""]


def markdown(report: dict, command: str) -> str:
    req, lat = report["requests"], report["latency"]
    lines = [f"# Soak: {report['minutes']} min", "", f"`{command}`", ""]
    lines += [f"Verdict: **{'pass' if report['ok'] else 'FAIL'}** {report['failures'] or ''}", ""]
    lines += [f"Main server's disk tier: {report['disk']}; solo runs {report['solo_runs_s']} s, "
              f"then traffic for {report['wall_s']} s.", ""]  # fmt: skip
    lines += _table(
        ["server", "serves", "flags", "first start s", "restarts s", "requests", "clients",
         "suffix tokens", "suffix share"],
        [[name, s["serves"], f"`{' '.join(s['flags'])}`", s["first_start_s"], s["restarts_s"],
          req["by_server"].get(name, 0), s["clients"], report["committed"][name]["suffix"],
          report["committed"][name]["suffix_share"]]
         for name, s in report["servers"].items()],
    )  # fmt: skip
    for name, s in report["servers"].items():
        lines += [f"- {name}: " + "; ".join(f"`{ln}`" for ln in s.get("startup", []))]
    lines += [""]
    lines += _table(
        ["requests", "by status", "transport errors (phase)", "streamed", "disconnected",
         "greedy checked", "mismatches", "unfinished"],
        [[req["total"], req["by_status"], req["transport_errors_by_phase"], req["streamed"],
          req["disconnected"], req["greedy_checked"], len(req["greedy_mismatch"]),
          len(req["unfinished"])]],
    )  # fmt: skip
    lines += ["Requests by server and kind (protocol/feature):", ""]
    lines += _table(
        ["server kind", "sent", "200", "greedy checked", "mismatches", "e2e p50 s"],
        [[k, r["sent"], r["ok"], r["checked"], r["mismatches"], r["e2e_p50_s"]]
         for k, r in report["by_kind"].items()],
    )  # fmt: skip
    lines += _table(
        ["tokens committed by source", *report["committed"]["main"]],
        [[name, *c.values()] for name, c in report["committed"].items()],
    )
    lines += _table(["latency", "s"], [[k, v] for k, v in lat.items()])
    lines += _table(
        ["fault", "what happened"], [[k, f"`{json.dumps(v)}`"] for k, v in report["faults"].items()]
    )
    runs = {k: v for m in report["memory"].values() for k, v in m["analysis"].items()}
    keys = list(dict.fromkeys(k for run in runs.values() for k in run))
    lines += _table(
        ["server run", *keys], [[n, *(r.get(k, "") for k in keys)] for n, r in runs.items()]
    )
    cols = ["t_s", "segment", "rss_mb", "mlx_active_mb", "mlx_cache_mb", "prefix_ram_mb"]
    cols += ["prefix_disk_mb", "suffix_mb", "disk_writable", "suffix_tokens"]
    for server, memory in report["memory"].items():
        lines += [f"Memory of the {server} server every {report['sample_s']} s (MB):", ""]
        lines += _table(cols, [[f"{s.get(c, 0):.1f}" for c in cols] for s in memory["samples"]])
    return "\n".join(lines)
