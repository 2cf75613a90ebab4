"""Remote images (``--allow-remote-images``), fetched so that a client cannot reach inside.

The server fetches a URL a client names from the server's own network, so unchecked it reaches
what the client cannot: the machine's own services, the LAN, a cloud's metadata endpoint and its
credentials. So every hop, the URL and each redirect (followed here, at most ``MAX_REDIRECTS``),
must be http(s); its host is resolved here and every address it resolves to must be public;
and the connection goes to an address that was checked, never to a second lookup's answer (DNS
rebinding). Hosts the operator names in ``--allowed-image-hosts`` skip the address check.
Connections go direct: proxy variables are not read. docs/api.md, "Remote images".
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import socket
import ssl
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import quote, urljoin, urlsplit

MAX_REDIRECTS = 5
REDIRECTS = (301, 302, 303, 307, 308)
# Names that reach a cloud's metadata service wherever they resolve (some resolve only there).
METADATA_HOSTS = frozenset(
    {"metadata.google.internal", "metadata.goog", "metadata", "instance-data"}
    | {"instance-data.ec2.internal", "metadata.azure.com", "metadata.tencentyun.com"}
)
_METADATA_ADDRESSES = {"169.254.169.254", "169.254.170.2", "fd00:ec2::254", "100.100.100.200"}
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # IPv4 addresses written as IPv6 ones
_SHARED = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT: inside a provider
_UNIQUE_LOCAL = ipaddress.ip_network("fc00::/7")  # IPv6's private networks
# What a URL's path may hold as it is (an existing %-escape included); the rest is escaped.
_PATH_SAFE = "!#$%&'()*+,/:;=?@[]~"

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


_INSIDE = (
    ": this server does not fetch images from inside its network unless --allowed-image-hosts "
    "names the host"
)


class FetchRefused(ValueError):
    """A hop the server does not fetch: ``host`` (where it points), ``why`` (a predicate on
    it) and the ``fix``: the allow-list, or none (``host`` is then the whole URL)."""

    def __init__(self, host: str, why: str, redirected: bool, fix: str = _INSIDE) -> None:
        self.host = host
        subject = f"URL's host {host}" if fix else f"URL {host}"
        subject = f"URL redirects to {host}, which" if redirected else subject
        super().__init__(f"the image {subject} {why}{fix}")


class FetchFailed(ValueError):
    """The image could not be fetched (no answer, an HTTP error, too slow)."""


class FetchTooLarge(ValueError):
    """The image is over the byte limit."""


class _Late(FetchFailed):
    """The deadline passed (reworded with the limit by ``fetch_image``)."""


@dataclass(frozen=True)
class HostPolicy:
    """Which hosts may be fetched whatever they resolve to: ``names`` (lower case, no
    trailing dot) and ``networks`` (an address is a network of one)."""

    names: frozenset[str] = frozenset()
    networks: tuple[Network, ...] = ()

    @classmethod
    def of(cls, hosts: Iterable[str]) -> HostPolicy:
        """The policy of ``--allowed-image-hosts`` entries: names, addresses or networks."""
        names, networks = set(), []
        for host in hosts:
            entry = host.strip().strip("[]").rstrip(".").lower()
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                names.add(entry)
        return cls(frozenset(names), tuple(networks))

    def allows_name(self, host: str) -> bool:
        if host in self.names:
            return True
        try:
            return self.allows_address(ipaddress.ip_address(host))
        except ValueError:  # a name, not an address
            return False

    def allows_address(self, address: Address) -> bool:
        mapped = isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped
        return any(address in net or (mapped and mapped in net) for net in self.networks)


def internal_kind(address: Address) -> str | None:
    """What makes ``address`` one a client must not reach through the server ("loopback",
    "private", ...), or None for a public one; IPv4 written as IPv6 is judged as IPv4."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is None and address in _NAT64:
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is not None:
            return internal_kind(embedded)
    if str(address) in _METADATA_ADDRESSES:
        return "cloud metadata"
    checks = [
        ("loopback", address.is_loopback),
        ("unspecified", address.is_unspecified),
        ("link-local", address.is_link_local),
        ("multicast", address.is_multicast),
        ("unique-local", address in _UNIQUE_LOCAL),
        ("site-local", isinstance(address, ipaddress.IPv6Address) and address.is_site_local),
        ("reserved", address.is_reserved),
        ("private", address.is_private),
        ("shared (carrier-grade NAT)", address in _SHARED),
        ("non-public", not address.is_global),
    ]
    return next((kind for kind, hit in checks if hit), None)


@dataclass(frozen=True)
class _Hop:
    """One URL to fetch: where to connect (the checked addresses) and what to ask."""

    https: bool
    host: str
    port: int
    path: str
    addresses: tuple[str, ...]


def fetch_image(url: str, policy: HostPolicy, max_bytes: int, seconds: float) -> bytes:
    """The body of ``url``, redirects followed (each hop checked), within ``seconds`` in all
    and ``max_bytes``. Raises FetchRefused, FetchFailed or FetchTooLarge."""
    deadline = time.monotonic() + seconds
    for hop_number in range(MAX_REDIRECTS + 1):
        hop = _hop(url, policy, redirected=hop_number > 0)
        try:
            status, reason, location, body = _get(hop, deadline, max_bytes)
        except _Late:
            raise FetchFailed(f"no image within {seconds:g} s") from None
        if status in REDIRECTS and location:
            url = urljoin(url, location)
            continue
        if status != 200:
            raise FetchFailed(f"{hop.host} answered HTTP {status} {reason}".rstrip())
        return body
    raise FetchFailed(f"more than {MAX_REDIRECTS} redirects")


def _hop(url: str, policy: HostPolicy, redirected: bool) -> _Hop:
    """``url`` checked: http(s), a host, and every address it resolves to public unless the
    policy allows the host."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:  # "Invalid IPv6 URL", "Port out of range 0-65535", ...
        raise FetchFailed(f"the URL does not parse ({exc}): {url[:80]}") from None
    scheme, host = parts.scheme.lower(), (parts.hostname or "").rstrip(".")
    if scheme not in ("http", "https"):
        raise FetchRefused(url[:80], "is not an http(s) URL", redirected, fix="")
    if not host:
        raise FetchRefused(url[:80], "has no host", redirected, fix="")
    port = port or (443 if scheme == "https" else 80)
    named = policy.allows_name(host)
    if host in METADATA_HOSTS and not named:
        raise FetchRefused(host, "names a cloud metadata service", redirected)
    addresses = _resolve(host, port)
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%")[0])
        kind = None if named or policy.allows_address(ip) else internal_kind(ip)
        if kind is not None:
            raise FetchRefused(host, f"resolves to {ip} ({kind})", redirected)
    path = quote((parts.path or "/") + (f"?{parts.query}" if parts.query else ""), _PATH_SAFE)
    return _Hop(scheme == "https", host, port, path, addresses)


def _resolve(host: str, port: int) -> tuple[str, ...]:
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError) as exc:  # not found, bad IDNA, a NUL
        raise FetchFailed(
            f"cannot resolve {host}: {getattr(exc, 'strerror', None) or exc}"
        ) from None
    return tuple(dict.fromkeys(str(info[4][0]) for info in found))


class _Pinned(http.client.HTTPConnection):
    """An HTTP connection to ``address`` for ``host`` (its Host header); over TLS when
    ``tls`` is a context, its certificate checked against ``host``."""

    def __init__(
        self, host: str, port: int, address: str, timeout: float, tls: ssl.SSLContext | None
    ) -> None:
        super().__init__(host, port, timeout=timeout)
        self.address, self.tls = address, tls

    def connect(self) -> None:
        sock = socket.create_connection((self.address, self.port), self.timeout)
        self.sock = self.tls.wrap_socket(sock, server_hostname=self.host) if self.tls else sock


def _get(hop: _Hop, deadline: float, max_bytes: int) -> tuple[int, str, str | None, bytes]:
    """(status, reason, Location, body) of a GET of ``hop``, from the first of its checked
    addresses that answers; the socket is shut at ``deadline`` whatever it is doing."""
    tls = ssl.create_default_context() if hop.https else None
    errors: list[str] = []
    for address in hop.addresses:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _Late()
        conn = _Pinned(hop.host, hop.port, address, left, tls)
        try:
            conn.connect()
        except OSError as exc:
            errors.append(_reason(exc))
            conn.close()
            continue
        return _exchange(conn, hop, deadline, max_bytes)
    raise FetchFailed(f"could not connect to {hop.host}: {'; '.join(errors) or 'timed out'}")


def _exchange(
    conn: _Pinned, hop: _Hop, deadline: float, max_bytes: int
) -> tuple[int, str, str | None, bytes]:
    shut = threading.Timer(max(0.0, deadline - time.monotonic()), _shut, (conn,))
    shut.start()
    try:
        conn.request("GET", hop.path, headers={"User-Agent": "dflash-server", "Accept": "image/*"})
        response = conn.getresponse()
        if response.status != 200:  # a redirect, or an error: no body needed
            return response.status, response.reason, response.getheader("Location"), b""
        length = response.getheader("Content-Length") or ""
        if length.isdigit() and int(length) > max_bytes:
            raise FetchTooLarge(f"{hop.host} sends {int(length):,} bytes")
        body = _read(response, max_bytes, deadline)
        return response.status, response.reason, None, body
    except (OSError, http.client.HTTPException) as exc:
        if time.monotonic() >= deadline:
            raise _Late() from None
        raise FetchFailed(_reason(exc)) from None
    finally:
        shut.cancel()
        conn.close()


def _read(response: http.client.HTTPResponse, max_bytes: int, deadline: float) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while chunk := response.read1(64 * 1024):
        size += len(chunk)
        if size > max_bytes:
            raise FetchTooLarge(f"more than {max_bytes:,} bytes")
        if time.monotonic() > deadline:
            raise _Late()
        chunks.append(chunk)
    return b"".join(chunks)


def _shut(conn: _Pinned) -> None:
    """Unblock whatever the fetch waits on (a server that sends a byte now and then)."""
    if conn.sock is not None:
        with contextlib.suppress(OSError):  # already closed
            conn.sock.shutdown(socket.SHUT_RDWR)


def _reason(exc: BaseException) -> str:
    """An exception's reason in words (never a Python repr)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"its TLS certificate does not verify: {exc.verify_message}"
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, http.client.IncompleteRead):
        return "the answer ended early"
    if isinstance(exc, http.client.HTTPException) and not isinstance(exc, OSError):
        return "the answer is not valid HTTP"
    text = getattr(exc, "strerror", None) or str(exc)
    return text or type(exc).__name__
