"""Slow clients (``--request-read-timeout``): a connection that sends nothing, headers sent one
byte at a time (slowloris) or a trickled body get a 408 OpenAI error object and the connection
closes; requests that arrive in time are served as before. Idle kept-alive connections
(``--timeout-keep-alive``) stay open longer than clients keep them."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server_fixtures import RunningServer, ScriptedGenerate, make_app, run_server

TIMEOUT = 0.5


@pytest.fixture(scope="module")
def server(tiny_hybrid_path: Path, draft_path: Path) -> Iterator[RunningServer]:
    generate = ScriptedGenerate(["hel", "lo"])
    app = make_app(tiny_hybrid_path, draft_path, generate=generate, request_read_timeout=TIMEOUT)
    with run_server(app) as srv:  # served with its --request-read-timeout
        yield srv


def connect(server: RunningServer) -> socket.socket:
    host, port = server.base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    return sock


def trickle(sock: socket.socket, data: bytes, seconds: float = 0.05) -> None:
    """Send ``data`` a byte at a time until the server closes the connection."""
    for byte in data:
        try:
            sock.sendall(bytes([byte]))
        except OSError:  # closed by the server
            return
        time.sleep(seconds)


def answer(sock: socket.socket) -> tuple[int, dict, bytes]:
    """(status, JSON body, raw) of the server's answer, read until it closes the connection."""
    raw = b""
    while chunk := sock.recv(65536):
        raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body), head.lower()


BODY = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\n\r\n" % len(BODY)
)


def check_408(status: int, body: dict, head: bytes) -> None:
    assert status == 408, body
    assert body["error"]["code"] == "request_timeout"
    assert "--request-read-timeout" in body["error"]["message"]
    assert b"connection: close" in head


def test_a_silent_connection_gets_408_and_is_closed(server: RunningServer) -> None:
    with connect(server) as sock:
        check_408(*answer(sock))


def test_headers_sent_one_byte_at_a_time_get_408(server: RunningServer) -> None:
    with connect(server) as sock:
        trickle(sock, HEAD)  # 20 bytes a second: the whole head would take seconds
        check_408(*answer(sock))


def test_a_trickled_body_gets_408(server: RunningServer) -> None:
    with connect(server) as sock:
        sock.sendall(HEAD)  # the headers in time, then the body a byte at a time
        trickle(sock, BODY)
        check_408(*answer(sock))


def test_a_slow_second_request_on_a_kept_alive_connection_gets_408(
    server: RunningServer,
) -> None:
    with connect(server) as sock:
        sock.sendall(HEAD + BODY)
        first = b""
        while b'"finish_reason"' not in first:
            first += sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        trickle(sock, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
        assert b"HTTP/1.1 408" in raw and b"request_timeout" in raw


def test_requests_in_time_are_served(server: RunningServer) -> None:
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        for _ in range(3):  # one kept-alive connection
            r = client.post("/v1/chat/completions", content=BODY, headers=HEAD_TYPE)
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"]
            time.sleep(TIMEOUT * 1.5)  # idle between requests is keep-alive's business
        assert client.get("/health").status_code == 200


HEAD_TYPE = {"content-type": "application/json"}


def served(sock: socket.socket) -> bytes:
    """Send a chat request on ``sock`` and read its whole answer, leaving the connection open
    (b"" when the server had closed it)."""
    sock.sendall(HEAD + BODY)
    raw = b""
    while b"\r\n\r\n" not in raw:
        if not (chunk := sock.recv(65536)):
            return raw
        raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    length = int(
        next(h for h in head.lower().split(b"\r\n") if h.startswith(b"content-length")).split(b":")[
            1
        ]
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head


@pytest.mark.slow
def test_an_idle_connection_outlives_the_clients_pools(server: RunningServer) -> None:
    """Idle for 5.5 s, longer than httpx (the OpenAI and Anthropic SDKs) keeps a pooled
    connection: still served. uvicorn's own 5 s closed it then, and a client reusing it at
    that moment got a reset."""
    with connect(server) as sock:
        assert served(sock).startswith(b"HTTP/1.1 200")
        time.sleep(5.5)
        assert served(sock).startswith(b"HTTP/1.1 200")


def test_an_idle_connection_closes_after_the_keep_alive_timeout(
    tiny_hybrid_path: Path, draft_path: Path
) -> None:
    app = make_app(tiny_hybrid_path, draft_path, generate=ScriptedGenerate(["hi"]),
                   timeout_keep_alive=0.5)  # fmt: skip
    with run_server(app) as srv, connect(srv) as sock:
        assert served(sock).startswith(b"HTTP/1.1 200")
        sock.settimeout(10)
        assert sock.recv(1) == b""  # closed by the server, with nothing more sent
