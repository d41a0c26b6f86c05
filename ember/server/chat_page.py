"""The chat page: static files served at ``/`` (``--no-ui`` turns it off).

The page is plain HTML, CSS and JavaScript inside the package (no Node at install or
run time, nothing from a CDN). With API keys configured the page is behind them too:
a browser sends one as the password of HTTP Basic authentication (it asks for it on
the first visit), a script as a bearer key. Responses carry a Content-Security-Policy
that lets the page run its own script and nothing else, so even a rendering bug could
not execute markup from a model's reply.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ember.server.errors import APIError

STATIC = Path(__file__).with_name("static")
FILES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
         "style.css": "text/css; charset=utf-8"}
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                               "form-action 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def basic_password(authorization: str) -> str | None:
    """The password of an HTTP Basic ``Authorization`` header (the API key), else None."""
    scheme, _, credentials = authorization.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(credentials.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    _, colon, password = decoded.partition(":")
    return password if colon else None


def mount_chat_page(app: FastAPI, authorized: Callable[[Request], bool]) -> None:
    """Serve the page at ``/`` and its files under ``/ui/``; ``authorized(request)``
    says whether a request may see them."""

    def page(request: Request, name: str) -> Response:
        if not authorized(request):
            raise APIError(401, "the chat page needs an API key (as the password)",
                           code="invalid_api_key",
                           headers={"WWW-Authenticate": 'Basic realm="ember", charset="UTF-8"'})
        if name not in FILES:
            raise APIError(404, f"no such file: /ui/{name}")
        return Response((STATIC / name).read_bytes(), media_type=FILES[name], headers=HEADERS)

    @app.get("/", include_in_schema=False)
    async def index(request: Request) -> Response:
        return page(request, "index.html")

    @app.get("/ui/{name}", include_in_schema=False)
    async def static(request: Request, name: str) -> Response:
        return page(request, name)
