"""The soak's server processes and the faults they suffer (tests/load/soak.py).

``Server`` runs ``dflash-serve`` (``python -m dflash_server.cli``) as a subprocess, its log in a
file; ``DiskFolder`` is the prefix cache's disk tier on a small tmpfs (when this process may
mount one; else a plain folder, and the read-only and full faults are skipped). Each fault
returns what happened, for the report.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx


class Server:
    """``dflash-serve ARGS`` on ``port``; restarted with the same arguments."""

    def __init__(self, args: list[str], port: int, log: Path) -> None:
        self.args, self.port, self.log = args, port, log
        self.base = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, timeout: float = 300) -> float:
        """Start and wait until /health says ready; the seconds it took."""
        t0 = time.monotonic()
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        command = [sys.executable, "-m", "dflash_server.cli", *self.args, "--port", str(self.port)]
        with self.log.open("ab") as f:
            f.write(f"\n===== start {self.starts} =====\n".encode())
            self.proc = subprocess.Popen(command, env=env, stdout=f, stderr=subprocess.STDOUT)
        self.starts += 1
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dflash-serve exited ({self.proc.returncode}); see {self.log}")
            with contextlib.suppress(httpx.TransportError):
                r = httpx.get(f"{self.base}/health", timeout=2)
                if r.status_code == 200 and r.json().get("status") == "ready":
                    return time.monotonic() - t0
            time.sleep(0.2)
        raise RuntimeError(f"dflash-serve not ready after {timeout} s; see {self.log}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def close(self) -> None:
        """SIGTERM if still running (SIGKILL if that does not end it)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.stop(signal.SIGTERM, timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log_since_start(self) -> str:
        """This run's log (since the last start)."""
        return self.log.read_text(errors="replace").rsplit("===== start", 1)[-1]


class DiskFolder:
    """The disk tier's folder: a ``size_mb`` tmpfs when mounting works here, else a folder."""

    def __init__(self, path: Path, size_mb: int) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        run = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)],
            capture_output=True,
            text=True,
        )
        self.tmpfs = run.returncode == 0
        self.why_not = "" if self.tmpfs else (run.stderr.strip() or "mount failed")

    def remount(self, mode: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{mode}", str(self.path)], check=True)

    def close(self) -> None:
        if self.tmpfs:
            subprocess.run(["umount", "-l", str(self.path)], check=False)


async def slowloris(base: str, expect_within: float) -> dict[str, Any]:
    """A client sending its request one byte a second: when and how the server ends it."""
    host, port = base.removeprefix("http://").split(":")
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"

    def run() -> dict[str, Any]:
        t0 = time.monotonic()
        sent, answer = 0, b""
        with socket.create_connection((host, int(port)), timeout=expect_within + 30) as sock:
            sock.settimeout(1.0)
            for byte in head * 10:
                try:
                    sock.sendall(bytes([byte]))
                    sent += 1
                    chunk = sock.recv(65536)  # waits up to the 1 s between bytes
                except TimeoutError:
                    continue
                except OSError:
                    break
                answer += chunk
                if not chunk:
                    break
                if time.monotonic() - t0 > expect_within + 30:
                    break
        closed = time.monotonic() - t0
        status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/") else None
        return {"bytes_sent": sent, "closed_after_s": round(closed, 1), "status": status,
                "ok": status == "408" and closed <= expect_within + 5}  # fmt: skip

    return await asyncio.to_thread(run)


async def many_connections(base: str, n: int = 500) -> dict[str, Any]:
    """``n`` connections opened at once, each asking GET /health."""
    host, port = base.removeprefix("http://").split(":")
    t0 = time.monotonic()

    async def one() -> str:
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
        except OSError as exc:
            return f"connect: {type(exc).__name__}"
        try:
            writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), 60)
            return line.split(b" ")[1].decode() if line else "closed"
        except (OSError, asyncio.TimeoutError, IndexError) as exc:
            return f"read: {type(exc).__name__}"
        finally:
            writer.close()

    results = await asyncio.gather(*(one() for _ in range(n)))
    counts: dict[str, int] = {}
    for r in results:
        counts[r] = counts.get(r, 0) + 1
    return {"connections": n, "answers": counts, "seconds": round(time.monotonic() - t0, 2),
            "ok": counts.get("200", 0) == n}  # fmt: skip


# The watcher of ``kill_during_write``, in a process of its own: the soak's own threads share
# one GIL with its busy event loop, and a small file can be written and renamed in the
# milliseconds a thread waits for it. Seeing a file, it stops the server (SIGSTOP, every thread
# of it), looks again, and kills it only if a file is still there; else it lets it go on.
WATCHER = """
import json, os, signal, sys, time
folder, pid, wait = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])

def names():
    try:
        return os.listdir(folder)
    except FileNotFoundError:
        return []

def state(task):
    try:
        with open(f"/proc/{pid}/task/{task}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "X"  # a thread that just ended

def stopped():
    return all(state(t) in "tTZX" for t in os.listdir(f"/proc/{pid}/task"))

end, misses = time.monotonic() + wait, 0
while time.monotonic() < end:
    if names():
        os.kill(pid, signal.SIGSTOP)
        frozen = time.monotonic() + 2
        while not stopped() and time.monotonic() < frozen:
            pass
        held = names()
        if held:
            break
        misses += 1
        os.kill(pid, signal.SIGCONT)
else:
    held = []
os.kill(pid, signal.SIGKILL)
print(json.dumps({"held": held, "misses": misses}))
"""


async def kill_during_write(server: Server, folder: Path, wait: float = 60) -> dict[str, Any]:
    """``kill -9`` the server while a disk-tier file is being written (a file in
    ``.partial/``), or at the end of ``wait`` seconds if none was caught."""
    partial = folder / ".partial"
    assert server.proc is not None
    watcher = await asyncio.create_subprocess_exec(
        sys.executable, "-c", WATCHER, str(partial), str(server.proc.pid), str(wait),
        stdout=subprocess.PIPE,
    )  # fmt: skip
    seen = json.loads((await watcher.communicate())[0])
    server.proc.wait(30)
    left = sorted(p.name for p in partial.glob("*")) if partial.is_dir() else []
    sizes = {p.name: p.stat().st_size for p in partial.glob("*")} if partial.is_dir() else {}
    return {"mid_write": bool(seen["held"]), "partial_seen": seen["held"],
            "writes_finished_first": seen["misses"], "left_in_partial": left,
            "partial_sizes": sizes}  # fmt: skip


def fill(folder: Path) -> tuple[Path, int]:
    """Fill the file system of ``folder`` to the last byte (a real ENOSPC); (filler, bytes)."""
    target = folder / "filler.bin"  # not a *.safetensors name: the disk tier ignores it
    fd = os.open(target, os.O_WRONLY | os.O_CREAT, 0o644)
    written = 0
    try:
        for size in (1 << 16, 1 << 12, 1):
            with contextlib.suppress(OSError):
                while True:
                    written += os.write(fd, b"\0" * size)
    finally:
        os.close(fd)
    return target, written


async def write_pressure(server: Server, tag: str, n: int = 4, wait: float = 60) -> dict[str, Any]:
    """``n`` requests with prompts of their own (each evicts an older prefix-cache entry, so the
    disk tier writes), then the disk tier's warnings in the log (waiting up to ``wait`` s for
    the first): what a fault on the folder did to requests and to the log."""
    statuses: dict[str, int] = {}
    async with httpx.AsyncClient(base_url=server.base, timeout=300) as http:
        for i in range(n):
            system = f"Pressure {tag} {i}. " + "Fresh words every time, nothing shared. " * 20
            body = {"messages": [{"role": "system", "content": system},
                                 {"role": "user", "content": "Hi"}],
                    "max_tokens": 2, "temperature": 0}  # fmt: skip
            r = await http.post("/v1/chat/completions", json=body)
            statuses[str(r.status_code)] = statuses.get(str(r.status_code), 0) + 1
    end = time.monotonic() + wait
    while "cannot write to" not in server.log_since_start() and time.monotonic() < end:
        await asyncio.sleep(0.5)
    lines = [ln for ln in server.log_since_start().splitlines() if "cannot write to" in ln]
    return {"pressure_requests": statuses, "warnings": len(lines), "warning": lines[:1],
            "ok": not any(k.startswith("5") for k in statuses) and len(lines) == 1}  # fmt: skip
