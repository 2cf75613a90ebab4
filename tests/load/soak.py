"""A soak under faults: mixed traffic against two ``dflash-serve`` processes on the tiny fixture
models.

    .venv/bin/python tests/load/soak.py --minutes 60          # the full run
    .venv/bin/python tests/load/soak.py --minutes 2 --no-faults

Two servers, side by side:

* ``main``: a tiny Qwen3.5 vision-language target (``build_vision_target``) with a DFlash
  drafter and 8-bit quantized attention KV (``--kv-bits 8 --quantized-kv-start 0``: every
  request's KV is quantized from its first forward, the one start at which a batched or
  prefix-cached row is token-identical to its lone run; docs/design.md, "Quantized KV cache");
  the prefix cache's disk tier on a small tmpfs.
* ``mtp``: a tiny Qwen3.5 text target carrying an MTP head, served with ``--draft mtp``
  (full-precision KV, its disk tier in a plain folder).

1-16 concurrent clients (their number changes every 15 s; a quarter of them on the MTP server)
send each server's mix of tests/load/soak_requests.py: chat completions, legacy completions,
Messages and Responses, streamed and not, tools and schemas, second turns sharing cached
prefixes, prompts that repeat themselves (suffix copies), client disconnects, and on the main
server images in user messages and inside tool results. Faults, at fixed fractions of the run:
a slowloris client (on both servers), 500 connections opened at once, ``kill -9`` while a
disk-tier file is being written (then a start that must skip and delete it), the disk tier's
folder remounted read-only, a graceful restart, the folder filled to the last byte (all on the
main server), and a graceful restart of the MTP server. Every 10 s, from each server's /metrics:
RSS, MLX memory, the caches' own sizes and the tokens committed by source. The report (JSON and
Markdown, in ``--out``): requests by status (no 5xx), by server and kind, greedy answers against
their solo runs, suffix copies' share of the tokens, p50/p99 latency, each fault, memory per
server. tests/test_soak.py runs a short one.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
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
from soak_memory import BUDGETS, committed_by_source, memory_analysis, memory_sample
from soak_report import markdown, summarize, verdict
from soak_requests import Spec, mix
from soak_traffic import Traffic, solo_references

TMPFS_MB = 8  # the disk tier's file system: room for its budget, then filled by the last fault
SAMPLE_S = 10.0
KV = ["--kv-bits", "8", "--quantized-kv-start", "0"]  # the main server's KV (see above)
# Start-up log lines that say what a server runs (its drafter, images, KV), for the report.
STARTUP = ("INFO:     draft ", "INFO:     vision:", "INFO:     KV cache:")


def server_args(target: Path, draft: str, disk: Path, calibration: Path, timeout: float) -> list:
    return [
        "--target", str(target), "--draft", draft, "--served-model-name", "tiny",
        "--max-active", "4", "--max-queue", "512", "--context-length", "2048",
        "--stream-interval", "0", "--shutdown-timeout", "20",
        "--prefix-cache-bytes", str(BUDGETS["prefix_ram"]), "--prefix-cache-dir", str(disk),
        "--prefix-cache-disk-bytes", str(BUDGETS["prefix_disk"]),
        "--suffix-cache-bytes", str(BUDGETS["suffix"]),
        "--request-read-timeout", str(timeout), "--calibration-cache", str(calibration),
    ]  # fmt: skip


@dataclass
class Soaked:
    """One server of the soak: its process, its mix, its clients and its memory samples."""

    name: str
    serves: str  # what it serves, for the report
    flags: list[str]  # the flags that make it this server (the rest are common)
    server: Server
    specs: list[Spec]
    traffic: Traffic
    samples: list[dict[str, float]] = field(default_factory=list)
    restarts_s: list[float] = field(default_factory=list)
    first_start_s: float = 0.0
    startup: list[str] = field(default_factory=list)  # what its log says it runs

    async def sample(self, t: float) -> None:
        s = await memory_sample(self.server.base, self.server.starts, t)
        if s is not None:
            self.samples.append(s)

    async def restart(self, how: str) -> None:
        """Stop (SIGTERM after the clients' requests ended; or already killed) and start again;
        this server's clients hold off meanwhile."""
        self.traffic.phase = how
        if how == "kill -9":
            self.traffic.paused.set()  # requests in flight just fail
        else:
            await self.traffic.quiesce()
            # Off the event loop: the other server's clients go on meanwhile.
            await asyncio.to_thread(self.server.stop, signal.SIGTERM)
        self.restarts_s.append(round(await asyncio.to_thread(self.server.start), 1))
        self.traffic.paused.clear()
        self.traffic.phase = "steady"


def servers(tmp: Path, out: Path, most: int, read_timeout: float) -> tuple[Soaked, Soaked]:
    """The two servers' models, folders and processes (not started)."""
    from dflash_server.testing import build_target
    from dflash_server.testing.vision import build_vision_target
    from server_fixtures import build_draft, free_port

    vl = build_vision_target(tmp / "vl-target")
    draft = build_draft(tmp / "vl-draft", vl)
    args = server_args(vl, str(draft), tmp / "disk", tmp / "calibration", read_timeout)
    main = Server([*args, *KV], free_port(), out / "server.log")
    mtp_target = build_target(tmp / "mtp-target", arch="qwen3_5", mtp=True)
    args = server_args(mtp_target, "mtp", tmp / "mtp-disk", tmp / "mtp-calib", read_timeout)
    mtp = Server(args, free_port(), out / "server-mtp.log")
    share = max(1, most // 4)  # the MTP server's clients
    specs = mix("main", vision=True), mix("mtp", vision=False)
    return (
        Soaked("main", "tiny Qwen3.5-VL + DFlash drafter", ["--draft <DFlash folder>", *KV],
               main, specs[0], Traffic(main.base, specs[0], most=most - share)),
        Soaked("mtp", "tiny Qwen3.5 + its MTP head", ["--draft mtp"], mtp, specs[1],
               Traffic(mtp.base, specs[1], most=share, seed=1)),
    )  # fmt: skip


async def soak(
    minutes: float,
    out: Path,
    most: int,
    read_timeout: float,
    faults: bool,
    warmup_s: float = 60,
    sample_s: float = SAMPLE_S,
) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="dflash-soak-"))
    disk = DiskFolder(tmp / "disk", TMPFS_MB)
    main, mtp = both = servers(tmp, out, most, read_timeout)
    report: dict[str, Any] = {"minutes": minutes, "faults": {}, "sample_s": sample_s}
    report["disk"] = f"tmpfs {TMPFS_MB} MB" if disk.tmpfs else f"plain folder ({disk.why_not})"
    refs: dict[tuple[str, int], str] = {}
    try:
        starts = await asyncio.gather(*(asyncio.to_thread(s.server.start) for s in both))
        for s, took in zip(both, starts):
            s.first_start_s = round(took, 1)
            log = s.server.log_since_start().splitlines()
            s.startup = [ln[10:] for ln in log if ln.startswith(STARTUP)]
        t_solo = time.monotonic()
        for r in await asyncio.gather(*(solo_references(s.server.base, s.specs) for s in both)):
            refs |= r
        report["solo_runs_s"] = round(time.monotonic() - t_solo, 1)
        t0 = time.monotonic()
        duration = minutes * 60

        async def sampler() -> None:
            while not main.traffic.stopped:
                await asyncio.gather(*(s.sample(time.monotonic() - t0) for s in both))
                await asyncio.sleep(sample_s)

        async def at(fraction: float) -> None:
            await asyncio.sleep(max(0.0, t0 + fraction * duration - time.monotonic()))

        tasks = [asyncio.create_task(s.traffic.run()) for s in both]
        tasks.append(asyncio.create_task(sampler()))
        if faults:
            await faulty(report["faults"], main, mtp, disk, at, read_timeout, t0)
        await at(1.0)
        for s in both:
            s.traffic.stop()
        await asyncio.gather(*tasks)
        f = report["faults"]
        if "full folder" in f:
            f["full folder"]["warnings"] = main.server.log_since_start().count("cannot write to")
            now = await memory_sample(main.server.base, main.server.starts, time.monotonic() - t0)
            f["full folder"]["writable_gauge"] = now and now["disk_writable"]
        await asyncio.gather(*(s.sample(time.monotonic() - t0) for s in both))  # the last counts
        report["health_at_end"] = {}
        async with httpx.AsyncClient(timeout=10) as http:
            for s in both:
                health = (await http.get(f"{s.server.base}/health")).json()
                keys = ("status", "queue_depth", "prefix_cache", "draft_family", "vision")
                report["health_at_end"][s.name] = {k: health.get(k) for k in keys}
        report["wall_s"] = round(time.monotonic() - t0, 1)
    finally:  # whatever happened, no server left running and no mount left behind
        for s in both:
            s.server.close()
        disk.close()
    outcomes = [o for s in both for o in s.traffic.outcomes]
    report |= summarize(outcomes, refs, [spec for s in both for spec in s.specs])
    report["servers"] = {
        s.name: {"serves": s.serves, "flags": s.flags, "first_start_s": s.first_start_s,
                 "restarts_s": s.restarts_s, "clients": f"1-{s.traffic.most}",
                 "mix": len(s.specs), "startup": s.startup}
        for s in both
    }  # fmt: skip
    report["committed"] = {s.name: committed_by_source(s.samples) for s in both}
    report["memory"] = {
        s.name: {"samples": s.samples, "analysis": memory_analysis(s.samples, warmup_s, s.name)}
        for s in both
    }
    report["ok"], report["failures"] = verdict(report)
    return report


async def faulty(
    f: dict[str, Any],
    main: Soaked,
    mtp: Soaked,
    disk: DiskFolder,
    at: Callable[[float], Awaitable[None]],
    read_timeout: float,
    t0: float,
) -> None:
    """The faults, each at its fraction of the run; what happened goes into ``f``. The disk tier's
    faults, kill -9, 500 connections and the first restart are the main server's (the tmpfs is
    its disk tier); the MTP server gets a slowloris client and a graceful restart of its own."""
    await at(0.10)
    loris = [asyncio.create_task(slowloris(s.server.base, read_timeout)) for s in (main, mtp)]
    await at(0.20)
    # The main server's only: the same HTTP layer on the MTP server adds no coverage, and the
    # burst lifts a server's RSS for good by 15-30 MB (the allocator's high-water mark), which
    # the memory analysis would count against the MTP server's long first run.
    main.traffic.phase = "500 connections"
    f["500 connections"] = await many_connections(main.server.base, 500)
    main.traffic.phase = "steady"
    f["slowloris"], f["slowloris (mtp)"] = await asyncio.gather(*loris)
    await at(0.30)
    main.traffic.phase = "kill -9"
    f["kill -9 mid-write"] = kill = await kill_during_write(main.server, disk.path)
    await main.restart("kill -9")
    kill["next_start"] = [
        ln for ln in main.server.log_since_start().splitlines() if "partial" in ln
    ]
    kill["partial_after_start"] = len(list((disk.path / ".partial").glob("*")))
    if disk.tmpfs:
        await at(0.45)
        disk.remount("ro")
        main.traffic.phase = "read-only folder"
        f["read-only folder"] = ro = await write_pressure(main.server, "read-only")
        await at(0.55)
        now = await memory_sample(main.server.base, main.server.starts, time.monotonic() - t0)
        ro["writable_gauge"] = now and now["disk_writable"]
        ro["warnings"] = main.server.log_since_start().count("cannot write to")
        disk.remount("rw")
    await at(0.55)
    await main.restart("graceful restart")
    f["graceful restart"] = {"took_s": main.restarts_s[-1]}
    if disk.tmpfs:
        await at(0.70)
        _, size = fill(disk.path)  # gone with the tmpfs
        main.traffic.phase = "full folder"
        f["full folder"] = {"filler_mb": round(size / 2**20, 2)}
        f["full folder"] |= await write_pressure(main.server, "full")
    await at(0.80)
    await mtp.restart("graceful restart")
    f["graceful restart (mtp)"] = {"took_s": mtp.restarts_s[-1]}


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--clients", type=int, default=16, help="most concurrent clients (both servers)")
    p.add_argument("--read-timeout", type=float, default=10.0, help="--request-read-timeout")
    p.add_argument("--out", type=Path, default=Path("build/soak"))
    p.add_argument("--no-faults", action="store_true")
    p.add_argument("--warmup", type=float, default=60.0, help="seconds before memory is judged")
    p.add_argument("--reanalyze", type=Path, help="a soak.json: its memory and verdict again")
    a = p.parse_args(argv)
    if a.reanalyze:  # the samples judged again (after a change to the analysis)
        report = json.loads(a.reanalyze.read_text())
        for name, memory in report["memory"].items():
            memory["analysis"] = memory_analysis(memory["samples"], a.warmup, name)
        report["ok"], report["failures"] = verdict(report)
        a.reanalyze.write_text(json.dumps(report, indent=1))
        md = markdown(report, report["command"])
        a.reanalyze.with_suffix(".md").write_text(md)
        print(md.split("Memory of the")[0])
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
    print(markdown(report, command).split("Memory of the")[0])
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
