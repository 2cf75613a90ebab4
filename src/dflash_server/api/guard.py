"""The first thing every request meets: API-key check on ``/v1``, the request-body size limit and
the time the body may take to arrive (``--request-read-timeout``: a 408 past it).

A plain ASGI middleware, so it runs before routing and body parsing: a wrong key or an
oversized body is refused without reading (or buffering) more than the limit, and unknown
``/v1`` paths need the key too. The key comes as ``Authorization: Bearer <key>`` (OpenAI) or
``x-api-key: <key>`` (Anthropic).
"""

from __future__ import annotations

import asyncio
import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dflash_server.api.errors import APIError
from dflash_server.api.read_timeout import timeout_error


class RequestGuard:
    """401 for a missing/wrong key on ``/v1/*``, 415 for a non-JSON body there, 413 for bodies
    over ``max_body`` bytes, 408 for a body that takes over ``read_timeout`` seconds."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        max_body: int,
        protected: tuple[str, ...] = (),
        read_timeout: float | None = None,
    ) -> None:
        self.app = app
        # Bytes on both sides: compare_digest on str refuses non-ASCII (a 500 waiting to happen).
        self.key = api_key.encode() if api_key else None
        self.max_body = max_body
        self.protected = protected  # paths outside /v1 that need the key too (/metrics)
        self.read_timeout = read_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        error = self._check(scope, headers)
        if error is None and scope["method"] in {"POST", "PUT", "PATCH"}:
            body, error = await self._read_body(receive)
            if error is None:
                receive = _replay(body, receive)
        if error is not None:
            await error.response(scope["path"])(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _check(self, scope: Scope, headers: dict[bytes, bytes]) -> APIError | None:
        path: str = scope["path"]
        guarded = path == "/v1" or path.startswith("/v1/") or path in self.protected
        # Preflights carry no credentials; the CORS layer answers them.
        if self.key and guarded and scope["method"] != "OPTIONS" and not self._key_ok(headers):
            return APIError(
                401,
                "missing or incorrect API key: send 'Authorization: Bearer <key>' "
                "(or 'x-api-key: <key>')",
                code="invalid_api_key",
            )
        # The model load/unload actions take no body: nothing to check the type of.
        bodiless = path.endswith(("/load", "/unload")) and headers.get(b"content-length") in (
            None,
            b"0",
        )
        if scope["method"] in {"POST", "PUT", "PATCH"} and path.startswith("/v1/") and not bodiless:
            ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if ctype != b"application/json" and not ctype.endswith(b"+json"):
                return APIError(
                    415,
                    "send the request body as JSON with 'Content-Type: application/json'",
                    code="unsupported_media_type",
                )
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return APIError(400, "invalid Content-Length header", code="invalid_request")
            if int(length) > self.max_body:
                return self._too_large()
        return None

    def _key_ok(self, headers: dict[bytes, bytes]) -> bool:
        """One constant-time comparison of the key sent: the bearer token, else ``x-api-key``
        (what the Anthropic SDKs send)."""
        assert self.key is not None
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() != b"bearer":
            token = headers.get(b"x-api-key", b"")
        return hmac.compare_digest(token.strip(), self.key)

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"request body is larger than {self.max_body} bytes (--max-request-bytes)",
            code="request_too_large",
        )

    async def _read_body(self, receive: Receive) -> tuple[bytes, APIError | None]:
        """The whole body, read up to the limit (chunked uploads have no Content-Length)."""
        chunks: list[bytes] = []
        size = 0
        loop = asyncio.get_running_loop()
        deadline = None if self.read_timeout is None else loop.time() + self.read_timeout
        while True:
            try:
                left = None if deadline is None else max(0.0, deadline - loop.time())
                message = await asyncio.wait_for(receive(), left)
            except asyncio.TimeoutError:  # a client trickling its body (slowloris)
                assert self.read_timeout is not None
                return b"", timeout_error(self.read_timeout)
            if message["type"] != "http.request":  # client left before sending it all
                return b"", APIError(400, "request body incomplete", code="invalid_request")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return b"", self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands the app the buffered body once, then waits for disconnects."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
