"""Remote image URLs cannot reach inside, and image errors say what was sent and the limit.

With --allow-remote-images a URL (or any redirect) to a loopback, private, link-local,
unique-local, multicast/reserved or cloud-metadata address, or to another scheme than http(s),
is a 400 naming the host and --allowed-image-hosts, unless that flag names the host. Every
server here is on loopback and started by the test; refused URLs are refused before any
connection, so the addresses they name are never contacted.
"""

from __future__ import annotations

import base64
import contextlib
import http.server
import io
import ipaddress
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dflash_server.api import image_fetch, images
from dflash_server.api.image_fetch import (
    FetchFailed,
    FetchRefused,
    FetchTooLarge,
    HostPolicy,
    fetch_image,
    internal_kind,
)
from dflash_server.settings import Settings
from server_fixtures import RunningServer, make_app, run_server
from test_images import PICTURES


def _png(image: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


PNG = _png(PICTURES[0])  # what the image host serves


class ImageHost:
    """A loopback HTTP server: ``/a.png`` (an image), ``/to?URL`` (a 302 to URL), ``/slow`` (a
    byte every half second), ``/big`` (more bytes than allowed, no length); it records the Host
    header of each request it gets."""

    def __init__(self) -> None:
        self.hosts: list[str] = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                owner.hosts.append(self.headers.get("Host", ""))
                if self.path.startswith("/to?"):
                    self.send_response(302)
                    self.send_header("Location", self.path[4:])
                    self.end_headers()
                elif self.path == "/slow":
                    self.send_response(200)
                    self.end_headers()
                    with contextlib.suppress(OSError):
                        for _ in range(40):
                            self.wfile.write(b"x")
                            self.wfile.flush()
                            time.sleep(0.5)
                elif self.path == "/big":
                    self.send_response(200)
                    self.end_headers()
                    with contextlib.suppress(OSError):
                        self.wfile.write(b"x" * 5000)
                else:
                    found = self.path == "/a.png"
                    self.send_response(200 if found else 404)
                    self.send_header("Content-Length", str(len(PNG) if found else 0))
                    self.end_headers()
                    self.wfile.write(PNG if found else b"")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def host() -> Iterator[ImageHost]:
    served = ImageHost()
    yield served
    served.server.shutdown()


LOOPBACK = HostPolicy.of(["127.0.0.1"])


# ----- which addresses are inside -----------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("169.254.1.1", "link-local"),
        ("fe80::1", "link-local"),
        ("169.254.169.254", "cloud metadata"),
        ("fd00:ec2::254", "cloud metadata"),
        ("fc00::1", "unique-local"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("240.0.0.1", "reserved"),
        ("0.0.0.0", "unspecified"),
        ("100.64.0.1", "shared (carrier-grade NAT)"),
        ("::ffff:127.0.0.1", "loopback"),  # IPv4 written as IPv6 is judged as IPv4
        ("2002:7f00:1::", "loopback"),  # 6to4 of 127.0.0.1
        ("64:ff9b::a00:1", "private"),  # NAT64 of 10.0.0.1
        ("8.8.8.8", None),
        ("2001:4860:4860::8888", None),
    ],
)
def test_inside_addresses(address: str, kind: str | None) -> None:
    assert internal_kind(ipaddress.ip_address(address)) == kind


def test_allow_list_entries() -> None:
    policy = HostPolicy.of(["Images.Example.", "10.0.0.0/8", "[::1]"])
    assert policy.allows_name("images.example") and not policy.allows_name("example")
    assert policy.allows_name("10.2.3.4") and policy.allows_name("::1")
    assert policy.allows_address(ipaddress.ip_address("::ffff:10.0.0.1"))
    assert not policy.allows_address(ipaddress.ip_address("127.0.0.1"))


def test_allow_list_flag() -> None:
    s = Settings.load(allowed_image_hosts="127.0.0.1, images.lan,10.0.0.0/8")
    assert s.allowed_image_hosts == ["127.0.0.1", "images.lan", "10.0.0.0/8"]
    with pytest.raises(ValueError, match=r"'10\.0\.0\.0/33' is not a network"):
        Settings.load(allowed_image_hosts="10.0.0.0/33")


# ----- fetching -----------------------------------------------------------------------------


def _fetch(url: str, policy: HostPolicy = LOOPBACK, **limits: Any) -> bytes:
    return fetch_image(url, policy, limits.get("max_bytes", 10**6), limits.get("seconds", 10))


def test_loopback_is_refused_unless_allowed(host: ImageHost) -> None:
    before = len(host.hosts)
    with pytest.raises(FetchRefused, match=r"host 127\.0\.0\.1 resolves to 127\.0\.0\.1 \(loopback\).*--allowed-image-hosts"):  # fmt: skip
        _fetch(f"{host.url}/a.png", HostPolicy())
    for spelled in ("localhost", "127.1", "2130706433", "[::ffff:127.0.0.1]"):  # same place
        with pytest.raises(FetchRefused, match="loopback"):
            _fetch(f"http://{spelled}:{host.port}/a.png", HostPolicy())
    assert len(host.hosts) == before  # refused before connecting
    assert _fetch(f"{host.url}/a.png") == PNG
    assert _fetch(f"http://localhost:{host.port}/a.png", HostPolicy.of(["LOCALHOST"])) == PNG


@pytest.mark.parametrize(
    ("target", "cause"),
    [
        ("http://169.254.169.254/latest/meta-data/", "cloud metadata"),
        ("http://metadata.google.internal/computeMetadata/v1/", "cloud metadata service"),
        ("http://[fd00:ec2::254]/latest/meta-data/", "cloud metadata"),
        ("http://10.0.0.1/a.png", "private"),
        ("http://[::1]:1/a.png", "loopback"),
        ("file:///etc/passwd", "not an http(s) URL"),
        ("ftp://127.0.0.1/a.png", "not an http(s) URL"),
    ],
)
def test_a_redirect_inside_is_refused(host: ImageHost, target: str, cause: str) -> None:
    """From an allowed host to a refused one: each hop is checked."""
    with pytest.raises(FetchRefused, match="redirects to") as refused:
        _fetch(f"{host.url}/to?{target}")
    assert cause in str(refused.value)


def test_redirects_are_followed_and_bounded(host: ImageHost) -> None:
    assert _fetch(f"{host.url}/to?/to?/a.png") == PNG
    six = "/to?" * 6 + "/a.png"
    with pytest.raises(FetchFailed, match="more than 5 redirects"):
        _fetch(host.url + six)


def test_the_checked_address_is_the_one_connected(
    host: ImageHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DNS rebinding: a name that resolves to an allowed address when checked and elsewhere
    a moment later is fetched from the address checked (one lookup per hop), under its own
    name; a name with any refused address among its answers is refused."""
    answers = [("127.0.0.1",), ("192.0.2.1",)]  # 192.0.2.0/24: documentation, never routed
    monkeypatch.setattr(image_fetch, "_resolve", lambda name, port: answers.pop(0))
    assert _fetch(f"http://rebind.test:{host.port}/a.png") == PNG
    assert answers == [("192.0.2.1",)] and host.hosts[-1] == f"rebind.test:{host.port}"
    monkeypatch.setattr(image_fetch, "_resolve", lambda name, port: ("127.0.0.1", "10.0.0.1"))
    with pytest.raises(FetchRefused, match=r"resolves to 10\.0\.0\.1 \(private\)"):
        _fetch(f"http://two.test:{host.port}/a.png")


def test_time_and_size_limits(host: ImageHost) -> None:
    start = time.monotonic()
    with pytest.raises(FetchFailed, match="no image within 1 s"):
        _fetch(f"{host.url}/slow", seconds=1)
    assert time.monotonic() - start < 3
    with pytest.raises(FetchTooLarge):
        _fetch(f"{host.url}/a.png", max_bytes=len(PNG) - 1)  # by its Content-Length
    with pytest.raises(FetchTooLarge):
        _fetch(f"{host.url}/big", max_bytes=4000)  # as it arrives


# ----- over HTTP ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_vl_path: Path) -> Iterator[RunningServer]:
    app = make_app(tiny_vl_path, None, temperature=0.0, allow_remote_images=True)
    with run_server(app) as srv:
        yield srv


def _chat(srv: RunningServer, *parts: dict[str, Any]) -> httpx.Response:
    content = [{"type": "text", "text": "What is this?"}, *parts]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    return httpx.post(f"{srv.base_url}/v1/chat/completions", json=body, timeout=60)


def _url_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def _openai_error(r: httpx.Response, code: str, *words: str) -> str:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == code, error
    assert all(w in error["message"] for w in words), (words, error["message"])
    return error["message"]


def test_refused_urls_on_every_api(
    server: RunningServer, host: ImageHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"{host.url}/a.png"
    r = _chat(server, _url_part(url))
    words = ("messages.0.content.1", "127.0.0.1", "--allowed-image-hosts")
    _openai_error(r, "image_url_refused", *words)
    assert r.json()["error"]["param"] == "messages.0.content"
    part = {"type": "input_image", "image_url": url}
    body = {"input": [{"role": "user", "content": [part]}], "max_output_tokens": 2}
    r = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=60)
    _openai_error(r, "image_url_refused", "input.0.content.0", "127.0.0.1", "--allowed-image-hosts")
    block = {"type": "image", "source": {"type": "url", "url": url}}
    body = {"messages": [{"role": "user", "content": [block]}], "max_tokens": 2}
    r = httpx.post(f"{server.base_url}/v1/messages", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert all(w in error["message"] for w in ("messages.0.content.0", "--allowed-image-hosts"))
    # Named in the allow-list: fetched; a redirect from there to inside: refused.
    monkeypatch.setattr(server.app.state.settings, "allowed_image_hosts", ["127.0.0.1"])
    assert _chat(server, _url_part(url)).status_code == 200
    inside = f"{host.url}/to?http://169.254.169.254/latest/meta-data/"
    _openai_error(_chat(server, _url_part(inside)), "image_url_refused", "redirects to")


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://127.0.0.1/a.png", "gopher://x/"])
def test_other_schemes_are_refused(server: RunningServer, url: str) -> None:
    scheme = url.partition(":")[0]
    _openai_error(_chat(server, _url_part(url)), "invalid_image", f"a {scheme} URL", "http(s)")


@pytest.mark.parametrize(
    ("url", "code", "cause"),
    [
        ("http://[::1", "invalid_image", "does not parse (Invalid IPv6 URL)"),
        ("http://127.0.0.1:99999/a.png", "invalid_image", "does not parse (Port out of range"),
        ("http:///a.png", "image_url_refused", "the image URL http:///a.png has no host"),
    ],
)
def test_malformed_urls_are_400s(server: RunningServer, url: str, code: str, cause: str) -> None:
    _openai_error(_chat(server, _url_part(url)), code, "messages.0.content.1", cause)


def _png_header(width: int, height: int) -> bytes:
    """A PNG that says it is ``width`` x ``height`` (what a decompression bomb says)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 64)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    )


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_image_errors_name_the_part_the_cause_and_the_limit(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not an image (Pillow's message held a Python repr), a decompression bomb (Pillow's
    limit was quoted, not the server's), an image over the decoded cap, too many bytes."""
    message = _openai_error(
        _chat(server, _url_part(_data_url(b"not an image at all"))),
        "invalid_image",
        "messages.0.content.1: the data is not an image this server reads (PNG, JPEG",
    )
    assert "0x" not in message and "<" not in message
    limits = ("67,108,864 pixels this server decodes", "--max-image-pixels, 1,048,576")
    bomb = _chat(server, _url_part(_data_url(_png_header(20000, 20000))))
    message = _openai_error(bomb, "image_too_large", "messages.0.content.1", "400,000,000", *limits)
    assert "178,956,970" not in message and "178956970" not in message
    over = _chat(server, _url_part(_data_url(_png_header(10000, 8000))))
    _openai_error(over, "image_too_large", "messages.0.content.1: the image is 10000x8000", *limits)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png"}}
    block["source"]["data"] = base64.b64encode(_png_header(20000, 20000)).decode()
    body = {"messages": [{"role": "user", "content": [block]}], "max_tokens": 2}
    r = httpx.post(f"{server.base_url}/v1/messages", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert all(w in r.json()["error"]["message"] for w in ("messages.0.content.0", *limits))
    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", 100)
    big = _chat(server, _url_part(_data_url(PNG)))
    _openai_error(big, "invalid_image", "messages.0.content.1", "larger than 100 bytes")
