"""Every failure leaves the server as an OpenAI error object.

``{"error": {"message", "type", "param", "code"}}`` with the matching HTTP status, so the
OpenAI SDKs raise their usual exception classes (BadRequestError, RateLimitError, ...).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

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

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


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
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 400: "invalid_json"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return APIError(500, f"internal error: {type(exc).__name__}").response()
