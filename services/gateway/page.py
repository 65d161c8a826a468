"""The browser page: a face to talk to, served by the gateway's HTTP surface (services/gateway/web.py).

Plumbing only. The page (services/gateway/static/: plain ES modules, HTML, CSS and a hand-drawn SVG,
no build step, nothing fetched from elsewhere) speaks the OpenAI Realtime API to `/v1/realtime` with
specvox's extension events on (services/gateway/realtime.py): one bridge onto the gateway's sessions,
not a second pipeline. `/` and `/static/` answer without an API key (web.py's auth lets them through:
they hold no data); the page asks for the key and presents it as the WebSocket subprotocol
`openai-insecure-api-key.<key>`, as OpenAI's browser clients do.

A browser grants the microphone only to a secure context: https://, or http:// on localhost. Served
over the gateway's TLS settings the page works from any machine; over plain HTTP only on the same one
(the page says so when it is not a secure context).
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

STATIC_DIR = Path(__file__).with_name("static")
PAGE_PATH, STATIC_PREFIX = "/", "/static/"
OPEN_PATHS = (PAGE_PATH,)  # exact paths open without a key; and everything under STATIC_PREFIX
# The page's files change with the gateway's version: a browser revalidates them rather than keep a stale copy
# beside a newer protocol.
NO_STALE = {"Cache-Control": "no-cache"}


def is_open(path: str) -> bool:
    """Whether `path` is one of the page's own files (web.py's auth lets these through without a key)."""
    return path in OPEN_PATHS or path.startswith(STATIC_PREFIX)


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "index.html", headers=NO_STALE)


async def _no_stale(request: web.Request, response: web.StreamResponse) -> None:
    if request.path.startswith(STATIC_PREFIX):
        response.headers.update(NO_STALE)


def add_routes(app: web.Application) -> None:
    app.router.add_get(PAGE_PATH, index)
    # aiohttp's static route: no directory listing, no path outside STATIC_DIR, ETag / Last-Modified revalidation.
    app.router.add_static(STATIC_PREFIX, STATIC_DIR, append_version=False)
    app.on_response_prepare.append(_no_stale)
