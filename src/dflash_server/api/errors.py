"""Every failure leaves the server as an OpenAI error object (Anthropic's on its paths).

``{"error": {"message", "type", "param", "code"}}`` with the matching HTTP status, so the
OpenAI SDKs raise their usual exception classes (BadRequestError, RateLimitError, ...). Under
``/v1/messages`` errors are ``{"type": "error", "error": {"type", "message"}}``, as the
Anthropic SDKs expect.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("dflash_server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
ANTHROPIC_PATHS = "/v1/messages"


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """The Anthropic error body for ``status``."""
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class APIError(Exception):
    """An error with an HTTP status, raised anywhere in request handling."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "server_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_message(self) -> str:
        """The message in the wording Anthropic's clients expect (the same, but for some)."""
        return self.message

    def response(self, path: str = "") -> JSONResponse:
        """The error as JSON, in Anthropic's shape on the Anthropic paths."""
        anthropic = path == ANTHROPIC_PATHS or path.startswith(ANTHROPIC_PATHS + "/")
        body = anthropic_error(self.status, self.anthropic_message()) if anthropic else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


class ContextLengthError(APIError):
    """A prompt that does not fit the context, worded as each protocol's clients parse it:
    OpenAI's ``context_length_exceeded`` message, Anthropic's ``prompt is too long: N tokens >
    M maximum`` (Claude Code compacts the conversation when it reads that)."""

    def __init__(self, tokens: int, limit: int, param: str) -> None:
        what = "messages" if param != "prompt" else "prompt"
        super().__init__(
            400,
            f"This model's maximum context length is {limit} tokens. However, your {what} "
            f"resulted in {tokens} tokens. Please reduce the length of the {what}.",
            param=param,
            code="context_length_exceeded",
        )
        self.tokens, self.limit = tokens, limit

    def anthropic_message(self) -> str:
        return f"prompt is too long: {self.tokens} tokens > {self.limit} maximum"


def _param(loc: tuple[Any, ...]) -> str | None:
    """'messages.0.content' style name of a pydantic error location, without 'body'."""
    parts = [str(p) for p in loc if p != "body"]
    # Union members show up as type names ("str", "list[int]"); they do not help the client.
    parts = [p for p in parts if not (p[:1].islower() and ("[" in p or p in {"str", "int"}))]
    return ".".join(parts) or None


def validation_error(exc: RequestValidationError) -> APIError:
    """The first pydantic error as a 400 naming the field."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    err = errors[0]
    param = _param(tuple(err.get("loc", ())))
    if err.get("type") == "json_invalid":
        return APIError(400, "request body is not valid JSON", code="invalid_json")
    msg = err.get("msg", "invalid value")
    if err.get("type") == "missing":
        msg = "field required"
    text = f"{param}: {msg}" if param else msg
    return APIError(400, text, param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    """Register handlers so no response ever escapes in FastAPI's default error shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 400: "invalid_json", 405: "method_not_allowed"}
        # Starlette's 405 names the allowed methods in its headers ("Allow"): keep them.
        error = APIError(
            exc.status_code,
            str(exc.detail),
            code=code.get(exc.status_code),
            headers=dict(exc.headers or {}) or None,
        )
        return error.response(request.url.path)

    app.add_middleware(CrashGuard)


def _crash_response(path: str, exc: Exception) -> JSONResponse:
    log.error("unhandled error on %s", path, exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}").response(path)


class CrashGuard:
    """A bug becomes a 500 error object, and the connection stays usable.

    (Starlette's own last-resort handler sends its response and then re-raises, so the server
    closes the keep-alive connection; this one answers and returns.) Inside the error
    middleware: errors after a response started are left to it.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:
            if started:
                raise
            await _crash_response(scope.get("path", ""), exc)(scope, receive, send)
