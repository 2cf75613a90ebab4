"""A soak under faults: mixed traffic against ``dflash-serve`` on the tiny fixture models.

    .venv/bin/python tests/load/soak.py --minutes 60          # the full run
    .venv/bin/python tests/load/soak.py --minutes 2 --no-faults

1-16 concurrent clients (their number changes every 15 s) send the mix of tests/load/
soak_traffic.py: chat completions, Messages and Responses, streamed and not, tools and schemas,
second turns sharing cached prefixes, client disconnects. The prefix cache's disk tier is on, on a
small tmpfs. Faults, at fixed fractions of the run: a slowloris client (one byte a second), 500
connections opened at once, ``kill -9`` while a disk-tier file is being written (then a start
that must skip and delete it), the disk tier's folder remounted read-only, a graceful restart in
the middle, the folder filled to the last byte. Every 10 s: RSS, MLX memory and the caches' own
sizes from /metrics. The report (JSON and Markdown, in ``--out``): requests by status (no 5xx),
greedy answers against their solo runs, p50/p99 latency, what happened at each fault, memory.
tests/test_soak.py runs a short one.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak_faults import (
    DiskFolder,
    Server,
    fill,
    kill_during_write,
    many_connections,
    slowloris,
    write_pressure,
)
from soak_memory import BUDGETS, MB, memory_analysis, memory_sample
from soak_traffic import SPECS, Outcome, Traffic, send, spec

TMPFS_MB = 8  # the disk tier's file system: room for its budget, then filled by the last fault
SAMPLE_S = 10.0
LEAK_SLACK = 32 * MB  # RSS growth no cache explains (allocator and interpreter noise) allowed


def server_args(target: Path, draft: Path, disk: Path, calibration: Path, timeout: float) -> list:
    return [
        "--target", str(target), "--draft", str(draft), "--served-model-name", "tiny",
        "--max-active", "4", "--max-queue", "512", "--context-length", "2048",
        "--stream-interval", "0", "--shutdown-timeout", "20",
        "--prefix-cache-bytes", str(BUDGETS["prefix_ram"]), "--prefix-cache-dir", str(disk),
        "--prefix-cache-disk-bytes", str(BUDGETS["prefix_disk"]),
        "--suffix-cache-bytes", str(BUDGETS["suffix"]),
        "--request-read-timeout", str(timeout), "--calibration-cache", str(calibration),
    ]  # fmt: skip


async def solo_references(base: str) -> dict[int, str]:
    """Each greedy request of the mix run alone: the answer every later run must equal."""
    refs = {}
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        for n in range(SPECS):
            s = spec(n)
            if s.greedy and not s.disconnect:
                out = await send(http, s, "solo")
                assert out.status == 200 and out.finished, (s, out)
                refs[n] = out.answer
    return refs


async def soak(
    minutes: float,
    out: Path,
    most: int,
    read_timeout: float,
    faults: bool,
    warmup_s: float = 60,
    sample_s: float = SAMPLE_S,
) -> dict:
    from dflash_server.testing import build_target
    from server_fixtures import build_draft, free_port

    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="dflash-soak-"))
    target = build_target(tmp / "target", arch="qwen3_5")
    draft = build_draft(tmp / "draft", target)
    disk = DiskFolder(tmp / "disk", TMPFS_MB)
    args = server_args(target, draft, disk.path, tmp / "calibration", read_timeout)
    server = Server(args, free_port(), out / "server.log")
    report: dict[str, Any] = {"minutes": minutes, "faults": {}, "restarts_s": []}
    report["disk"] = f"tmpfs {TMPFS_MB} MB" if disk.tmpfs else f"plain folder ({disk.why_not})"
    try:
        report["first_start_s"] = round(server.start(), 1)
        refs = await solo_references(server.base)
        traffic = Traffic(server.base, most=most)
        samples: list[dict[str, float]] = []
        t0 = time.monotonic()
        duration = minutes * 60

        async def sampler() -> None:
            while not traffic._stop:
                s = await memory_sample(server.base, server.starts, time.monotonic() - t0)
                if s is not None:
                    samples.append(s)
                await asyncio.sleep(sample_s)

        async def at(fraction: float) -> None:
            await asyncio.sleep(max(0.0, t0 + fraction * duration - time.monotonic()))

        async def restart(how: str) -> None:
            traffic.phase = how
            if how == "graceful restart":
                await traffic.quiesce()
                server.stop(signal.SIGTERM)
            else:
                traffic.paused.set()  # kill -9: requests in flight just fail
            report["restarts_s"].append(round(await asyncio.to_thread(server.start), 1))
            traffic.paused.clear()
            traffic.phase = "steady"

        tasks = [asyncio.create_task(traffic.run()), asyncio.create_task(sampler())]
        f = report["faults"]
        if faults:
            await at(0.10)
            loris = asyncio.create_task(slowloris(server.base, read_timeout))
            await at(0.20)
            traffic.phase = "500 connections"
            f["500 connections"] = await many_connections(server.base, 500)
            traffic.phase = "steady"
            f["slowloris"] = await loris
            await at(0.30)
            traffic.phase = "kill -9"
            f["kill -9 mid-write"] = await kill_during_write(server, disk.path)
            await restart("kill -9")
            log = server.log_since_start()
            f["kill -9 mid-write"]["next_start"] = [
                ln for ln in log.splitlines() if "partial" in ln
            ]
            left = list((disk.path / ".partial").glob("*"))
            f["kill -9 mid-write"]["partial_after_start"] = len(left)
            if disk.tmpfs:
                await at(0.45)
                disk.remount("ro")
                traffic.phase = "read-only folder"
                f["read-only folder"] = await write_pressure(server, "read-only")
                await at(0.55)
                now = await memory_sample(server.base, server.starts, time.monotonic() - t0)
                f["read-only folder"]["writable_gauge"] = now and now["disk_writable"]
                f["read-only folder"]["warnings"] = server.log_since_start().count(
                    "cannot write to"
                )
                disk.remount("rw")
            await at(0.55)
            await restart("graceful restart")
            f["graceful restart"] = {"took_s": report["restarts_s"][-1]}
            if disk.tmpfs:
                await at(0.70)
                _, size = fill(disk.path)  # gone with the tmpfs
                traffic.phase = "full folder"
                f["full folder"] = {"filler_mb": round(size / MB, 2)}
                f["full folder"] |= await write_pressure(server, "full")
        await at(1.0)
        traffic.stop()
        await asyncio.gather(*tasks)
        if "full folder" in f:
            log = server.log_since_start()
            f["full folder"]["warnings"] = log.count("cannot write to")
            now = await memory_sample(server.base, server.starts, time.monotonic() - t0)
            f["full folder"]["writable_gauge"] = now and now["disk_writable"]
        async with httpx.AsyncClient(timeout=10) as http:
            health = (await http.get(f"{server.base}/health")).json()
        report["health_at_end"] = {
            k: health.get(k) for k in ("status", "queue_depth", "prefix_cache")
        }
        report["wall_s"] = round(time.monotonic() - t0, 1)
    finally:  # whatever happened, no server left running and no mount left behind
        server.close()
        disk.close()
    report |= summarize(traffic.outcomes, refs, samples, warmup_s)
    report["ok"], report["failures"] = verdict(report)
    return report


def _pct(values: list[float], q: int) -> float | None:
    if len(values) < 2:
        return values[0] if values else None
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1], 3)


def summarize(
    outcomes: list[Outcome], refs: dict[int, str], samples: list[dict], warmup_s: float
) -> dict:
    by_status: dict[str, int] = {}
    transport: dict[str, int] = {}
    for o in outcomes:
        key = str(o.status) if o.status else "no answer"
        by_status[key] = by_status.get(key, 0) + 1
        if o.transport:
            transport[o.phase] = transport.get(o.phase, 0) + 1
    checked = [o for o in outcomes if o.spec.n in refs and o.status == 200 and o.finished]
    checked = [o for o in checked if not o.disconnected and o.error is None]
    mismatched = [o for o in checked if o.answer != refs[o.spec.n]]
    unfinished = [
        o for o in outcomes
        if o.status == 200 and not o.finished and not o.disconnected and o.phase != "kill -9"
    ]  # fmt: skip
    done = [o for o in outcomes if o.status == 200 and o.finished]
    latency = {"e2e_p50_s": _pct(sorted(o.e2e for o in done), 50)}
    latency["e2e_p99_s"] = _pct(sorted(o.e2e for o in done), 99)
    ttft = sorted(o.ttft for o in outcomes if o.ttft is not None)
    latency |= {"ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99)}
    for protocol in ("chat", "messages", "responses"):
        e2e = sorted(o.e2e for o in done if o.spec.protocol == protocol)
        latency[f"{protocol}_e2e_p50_s"], latency[f"{protocol}_e2e_p99_s"] = (
            _pct(e2e, 50), _pct(e2e, 99),
        )  # fmt: skip
    return {
        "requests": {
            "total": len(outcomes),
            "by_status": dict(sorted(by_status.items())),
            "transport_errors_by_phase": transport,
            "errors_in_200": sum(o.status == 200 and o.error is not None for o in outcomes),
            "disconnected": sum(o.disconnected for o in outcomes),
            "streamed": sum(o.spec.stream for o in outcomes),
            "by_protocol": {
                p: sum(o.spec.protocol == p for o in outcomes)
                for p in ("chat", "messages", "responses")
            },
            "greedy_checked": len(checked),
            "greedy_mismatch": [(o.spec.n, o.phase) for o in mismatched],
            "unfinished": [(o.spec.n, o.phase) for o in unfinished],
        },
        "latency": latency,
        "memory": {"samples": samples, "analysis": memory_analysis(samples, warmup_s)},
    }


def verdict(report: dict) -> tuple[bool, list[str]]:
    failures = []
    req = report["requests"]
    if any(k.startswith("5") for k in req["by_status"]):
        failures.append(f"5xx answers: {req['by_status']}")
    if req["greedy_mismatch"]:
        failures.append(f"greedy answers differ from their solo runs: {req['greedy_mismatch']}")
    if req["unfinished"]:
        failures.append(f"streams without their last event: {req['unfinished']}")
    if not req["greedy_checked"]:
        failures.append("no greedy answer was checked")
    if report["health_at_end"]["status"] != "ready":
        failures.append(f"health at the end: {report['health_at_end']}")
    runs = report["memory"]["analysis"]
    # A short run on a slow machine may not last long enough to judge growth (its caches'
    # budgets are still checked below); the long run must.
    if not any(run["judged"] for run in runs.values()) and report["minutes"] >= 5:
        failures.append("no server run lasted long enough to judge its memory")
    for name, run in runs.items():
        if run["judged"] and run["unexplained_max_growth_mb"] * MB > LEAK_SLACK:
            failures.append(f"{name}: RSS grew {run['unexplained_max_growth_mb']} MB beyond caches")
        for cache, budget in BUDGETS.items():
            if run[f"{cache}_max_mb"] * MB > budget * 1.01:
                failures.append(f"{name}: {cache} above its budget ({run[f'{cache}_max_mb']} MB)")
    for name, fault in report["faults"].items():
        if fault.get("ok") is False:
            failures.append(f"{name}: {fault}")
    kill = report["faults"].get("kill -9 mid-write")
    if kill and kill["partial_after_start"]:
        failures.append("the start after kill -9 left partial files")
    for name in ("read-only folder", "full folder"):
        if name in report["faults"] and report["faults"][name]["warnings"] != 1:
            failures.append(f"{name}: {report['faults'][name]['warnings']} warnings, not one")
    return not failures, failures


def markdown(report: dict, command: str) -> str:
    req, lat = report["requests"], report["latency"]
    lines = [f"# Soak: {report['minutes']} min", "", f"`{command}`", ""]
    lines += [f"Verdict: **{'pass' if report['ok'] else 'FAIL'}** {report['failures'] or ''}", ""]
    lines += [f"Disk tier on: {report['disk']}; first start {report['first_start_s']} s, "
              f"restarts {report['restarts_s']} s; wall {report['wall_s']} s.", ""]  # fmt: skip
    lines += ["| requests | by status | transport errors (phase) | streamed | disconnected | greedy "
              "checked | mismatches | unfinished |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {req['total']} | {req['by_status']} | {req['transport_errors_by_phase']} | "
              f"{req['streamed']} | {req['disconnected']} | {req['greedy_checked']} | "
              f"{len(req['greedy_mismatch'])} | {len(req['unfinished'])} |", ""]  # fmt: skip
    lines += ["| latency | s |", "|---|---|", *[f"| {k} | {v} |" for k, v in lat.items()], ""]
    lines += ["| fault | what happened |", "|---|---|"]
    lines += [f"| {k} | `{json.dumps(v)}` |" for k, v in report["faults"].items()]
    runs = report["memory"]["analysis"]
    keys = list(dict.fromkeys(k for run in runs.values() for k in run))
    lines += ["", "| server run | " + " | ".join(keys) + " |", "|---" * (1 + len(keys)) + "|"]
    for name, run in runs.items():
        lines.append(f"| {name} | " + " | ".join(str(run.get(k, "")) for k in keys) + " |")
    cols = ["t_s", "segment", "rss_mb", "mlx_active_mb", "mlx_cache_mb", "prefix_ram_mb"]
    cols += ["prefix_disk_mb", "suffix_mb", "disk_writable"]
    lines += ["", "Memory every 10 s (MB):", "", "| " + " | ".join(cols) + " |"]
    lines += ["|---" * len(cols) + "|"]
    for s in report["memory"]["samples"]:
        lines.append("| " + " | ".join(f"{s[c]:.1f}" for c in cols) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--clients", type=int, default=16, help="most concurrent clients")
    p.add_argument("--read-timeout", type=float, default=10.0, help="--request-read-timeout")
    p.add_argument("--out", type=Path, default=Path("build/soak"))
    p.add_argument("--no-faults", action="store_true")
    p.add_argument("--warmup", type=float, default=60.0, help="seconds before memory is judged")
    p.add_argument("--reanalyze", type=Path, help="a soak.json: its memory and verdict again")
    a = p.parse_args(argv)
    if a.reanalyze:  # the samples judged again (after a change to the analysis)
        report = json.loads(a.reanalyze.read_text())
        report["memory"]["analysis"] = memory_analysis(report["memory"]["samples"], a.warmup)
        report["ok"], report["failures"] = verdict(report)
        a.reanalyze.write_text(json.dumps(report, indent=1))
        md = markdown(report, report["command"])
        a.reanalyze.with_suffix(".md").write_text(md)
        print(md.split("Memory every")[0])
        return 0 if report["ok"] else 1
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    command = "python tests/load/soak.py " + " ".join(argv if argv is not None else sys.argv[1:])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    faults = not a.no_faults
    report = asyncio.run(soak(a.minutes, a.out, a.clients, a.read_timeout, faults, a.warmup))
    report["commit"], report["command"] = commit.stdout.strip(), command  # the code that ran
    (a.out / "soak.json").write_text(json.dumps(report, indent=1))
    (a.out / "soak.md").write_text(markdown(report, command))
    print(markdown(report, command).split("Memory every")[0])
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
