"""The chat page: ``GET /`` and its static files, shipped in the package (``dflash_server/web``).

No build step and nothing from a CDN. The page needs no API key to load (the guard only
protects ``/v1``); its API calls send the key the user types. A strict Content-Security-Policy
keeps anything the model writes from running as script, even if the Markdown renderer slipped.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

WEB_DIR = Path(__file__).resolve().parent.parent / "web"
ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "images.js": "text/javascript; charset=utf-8",
    "markdown.js": "text/javascript; charset=utf-8",
    "views.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

web = APIRouter()


@cache
def _read(name: str) -> bytes:
    return (WEB_DIR / name).read_bytes()


def _serve(name: str) -> Response:
    return Response(_read(name), media_type=ASSETS[name], headers=HEADERS)


# HEAD too: uptime checks and proxies probe the root that way; the server sends no body.
@web.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def index() -> Response:
    return _serve("index.html")


@web.get("/web/{name}", include_in_schema=False)
async def asset(name: str) -> Response:
    if name not in ASSETS:
        return Response("not found", status_code=404, media_type="text/plain")
    return _serve(name)
