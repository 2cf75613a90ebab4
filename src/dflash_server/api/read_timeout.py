"""Slow clients: a request must arrive within ``--request-read-timeout`` seconds.

uvicorn times out idle keep-alive connections only, and any byte resets that timer, so a client
that opens a connection and sends nothing, or sends its headers one byte a second (slowloris),
holds a connection (and its file descriptor) for ever. ``http_protocol`` gives uvicorn an h11
protocol that allows each request's headers that long from the connection's opening, or from
the request's first byte on a kept-alive connection; past it the client gets a ``408`` with an
OpenAI error object and the connection closes. The body then has the same time again
(``RequestGuard`` reads it under that deadline).
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from dflash_server.api.errors import APIError


def timeout_error(seconds: float) -> APIError:
    """The 408 a client too slow to send its request gets (the connection closes after it)."""
    return APIError(
        408,
        f"the request did not arrive within {seconds:g} s (--request-read-timeout)",
        code="request_timeout",
        type="invalid_request_error",
        headers={"connection": "close"},
    )


class ReadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers."""

    read_timeout = 60.0  # set per server by ``http_protocol``

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._read_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm()  # a connection that never sends a byte times out too

    def data_received(self, data: bytes) -> None:
        if self._read_timer is None and self.conn.their_state is h11.IDLE:
            self._arm()  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the headers are in: the app has it now
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._read_timer = self.loop.call_later(self.read_timeout, self._timed_out)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        # h11 cannot answer a request it has not parsed: the 408 is written as it goes out.
        body = json.dumps(timeout_error(self.read_timeout).body()).encode()
        head = (
            "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self.transport.close()


def http_protocol(read_timeout: float) -> type[asyncio.Protocol]:
    """The protocol class to give ``uvicorn.Config(http=...)``."""
    return type("ReadTimeoutProtocol", (ReadTimeoutProtocol,), {"read_timeout": read_timeout})
