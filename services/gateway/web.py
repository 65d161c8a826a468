"""The gateway's HTTP and WebSocket surface: where clients of other protocols reach the same sessions.

One aiohttp application on `http_port`, served in the gateway's own process and loop (a gateway
worker, so it starts and drains with the gRPC server) over the same TLS settings. It holds no
pipeline of its own: route modules (services/gateway/openai_http.py, the OpenAI HTTP endpoints;
services/gateway/realtime.py, the OpenAI Realtime API) convert requests and plumb them into the
gateway's servicer, its sessions and the stages. What every route shares is here, in middlewares,
in the order a request meets them (metrics first, so that they count every refusal by its status):

- errors: any failure answers in OpenAI's JSON shape (`{"error": {"message", "type", "param",
  "code"}}`) with the HTTP status that matches the gRPC status the same error gets on the native API
  (services/server/errors.py holds that one table);
- metrics and tracing: `specvox_requests_total` and the duration histogram, with the method named
  `HTTP <verb> <route>`, and a span per request;
- auth: the API key as `Authorization: Bearer <key>` (what every OpenAI client sends), or, for a
  browser's WebSocket that cannot set headers, the subprotocol `openai-insecure-api-key.<key>`;
  the tenant goes in `TENANT` as on the gRPC calls;
- limits: the tenant's request rate; a WebSocket holds one of its stream slots while it is open.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from aiohttp import web

from services.gateway import page
from services.server import metrics, tracing
from services.server.auth import TENANT, Authenticator, authenticator
from services.server.errors import status_of
from services.server.limits import LimitExceededError, TenantLimits
from services.server.runtime import CannotListen
from services.store.client import REDIS_ERRORS

log = logging.getLogger(__name__)

HEALTH_PATH = "/health"  # open like gRPC health (auth.open_health): load balancers and `specvox up`
BROWSER_KEY_PROTOCOL = "openai-insecure-api-key."  # a WebSocket subprotocol carrying the key, as OpenAI's

# gRPC status → (HTTP status, OpenAI error type): the native API's statuses, as OpenAI's clients read them.
HTTP_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
}


class HttpError(Exception):
    """A refusal with its HTTP status, OpenAI error type, the parameter at fault and a code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind


@dataclass
class WebContext:
    """What the routes reach the gateway through: its settings and its servicer (sessions, stages, choices)."""

    settings: Any
    gateway: Any  # services.gateway.service.GatewayServicer
    limits: TenantLimits | None = None


CONTEXT: web.AppKey[WebContext] = web.AppKey("context", WebContext)
WEBSOCKETS: web.AppKey[weakref.WeakSet] = web.AppKey("websockets", weakref.WeakSet)
ROUTE_MODULES = ("services.gateway.openai_http", "services.gateway.realtime", "services.gateway.page")


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object (what its SDKs parse into an APIError's message, type, param and code)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(error_body(message, kind, param, code), status=status, headers=headers)


def http_error_of(error: BaseException) -> HttpError:
    """Any failure as the HTTP refusal a client sees: the native API's status, mapped (INTERNAL → 500)."""
    if isinstance(error, HttpError):
        return error
    code = status_of(error)
    status, kind = HTTP_STATUS.get(code, (500, "server_error"))
    message = error.details() if isinstance(error, grpc.aio.AioRpcError) else str(error)
    return HttpError(status, message or type(error).__name__, code=code.name.lower(), kind=kind)


def _route_name(request: web.Request) -> str:
    """`HTTP POST /v1/chat/completions`: the route's template, never the raw path (bounded label values)."""
    resource = request.match_info.route.resource
    return f"HTTP {request.method} {resource.canonical if resource is not None else 'unmatched'}"


@web.middleware
async def errors_middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    """Every failure in OpenAI's JSON shape; aiohttp's own refusals (404, 405, 413) reshaped too."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        message = {404: f"no route {request.method} {request.path}",
                   405: f"{request.method} is not allowed on {request.path}"}.get(e.status, e.reason)
        if e.status == 413:
            limit = request.app[CONTEXT].settings.http_max_body_bytes
            message = f"the request body is larger than {limit} bytes (http_max_body_bytes)"
        return error_response(e.status, message, kind, headers={k: v for k, v in e.headers.items()
                                                                 if k.lower() == "allow"})
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:  # noqa: BLE001 - every failure becomes a status, the server keeps serving
        refusal = http_error_of(e)
        if refusal.status >= 500:
            log.warning("%s failed: %s", _route_name(request), e, exc_info=refusal.status == 500)
        return error_response(refusal.status, str(refusal), refusal.kind, refusal.param, refusal.code)


@web.middleware
async def metrics_middleware(request: web.Request, handler):
    """The same request counters and span as a gRPC call gets (services/server/metrics.py, tracing.py)."""
    method = _route_name(request)
    metrics.ACTIVE_REQUESTS.labels("gateway", method).inc()
    started, code = time.perf_counter(), "500"
    try:
        with tracing.span(method, **{"http.method": request.method, "http.route": method.split(" ", 2)[-1]}):
            response = await handler(request)
        code = str(response.status)
        return response
    except asyncio.CancelledError:
        code = "499"
        raise
    finally:
        metrics.ACTIVE_REQUESTS.labels("gateway", method).dec()
        metrics.REQUESTS.labels("gateway", method, code).inc()
        metrics.REQUEST_DURATION.labels("gateway", method).observe(time.perf_counter() - started)


def presented_key(request: web.Request) -> str:
    """The API key of the request: `Authorization: Bearer`, else a browser WebSocket's key subprotocol."""
    scheme, _, secret = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and secret.strip():
        return secret.strip()
    for protocol in request.headers.get("Sec-WebSocket-Protocol", "").split(","):
        if protocol.strip().startswith(BROWSER_KEY_PROTOCOL):
            return protocol.strip()[len(BROWSER_KEY_PROTOCOL):]
    return ""


def auth_middleware(auth: Authenticator | None):
    @web.middleware
    async def middleware(request: web.Request, handler):
        if auth is None or request.path == HEALTH_PATH:
            return await handler(request)
        if _is_page_file(request):
            return await handler(request)  # the browser page's own files (services/gateway/page.py): no data in them
        key = presented_key(request)
        tenant, reason = auth.decide(request.path, [("authorization", f"Bearer {key}")] if key else [])
        if tenant is None:
            reason = reason.replace("send metadata 'authorization: Bearer <API key>'",
                                    "send the header 'Authorization: Bearer <API key>'")
            raise HttpError(401, reason, code="invalid_api_key", kind="authentication_error")
        TENANT.set(tenant)  # in the request's own task, which runs the handler
        return await handler(request)

    return middleware


def limits_middleware(limits: TenantLimits | None):
    @web.middleware
    async def middleware(request: web.Request, handler):
        if limits is None or request.path == HEALTH_PATH or _is_page_file(request):
            return await handler(request)  # the page's files are no tenant's calls: they share no bucket
        tenant = TENANT.get()
        try:
            await limits.check_rate(tenant)
            lease = await limits.open_stream(tenant) if _is_websocket(request) else None
        except LimitExceededError as e:
            raise HttpError(429, f"gateway: {e}", code=e.limit, kind="rate_limit_error") from None
        except REDIS_ERRORS as e:
            raise HttpError(503, f"gateway: the per-key limits cannot be checked: {e}", kind="server_error") from None
        async with limits.holding(tenant, lease):
            return await handler(request)

    return middleware


def _is_page_file(request: web.Request) -> bool:
    return request.method in ("GET", "HEAD") and page.is_open(request.path)


def _is_websocket(request: web.Request) -> bool:
    return request.headers.get("Upgrade", "").lower() == "websocket"


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def build_app(context: WebContext) -> web.Application:
    """The application: the shared middlewares, `/health`, and each route module's routes."""
    import importlib

    settings = context.settings
    app = web.Application(client_max_size=settings.http_max_body_bytes, middlewares=[
        metrics_middleware, errors_middleware, auth_middleware(authenticator(settings.auth, "gateway")),
        limits_middleware(context.limits)])
    app[CONTEXT] = context
    app[WEBSOCKETS] = weakref.WeakSet()
    app.router.add_get(HEALTH_PATH, health)
    for module in ROUTE_MODULES:  # imported here: each route module imports this one
        importlib.import_module(module).add_routes(app)
    app.on_shutdown.append(_close_websockets)
    return app


async def _close_websockets(app: web.Application) -> None:
    """A drain closes each open WebSocket with 1001 (going away): its client reconnects elsewhere."""
    for ws in list(app[WEBSOCKETS]):
        await ws.close(code=1001, message=b"the gateway is shutting down")


def server_ssl_context(tls: Any) -> ssl.SSLContext | None:
    """The gRPC ports' TLS: their certificate; under mutual TLS, client certificates of `tls.client_ca_file`."""
    if not tls.server_on:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls.cert_file, tls.key_file)
    if tls.client_ca_file:
        context.load_verify_locations(tls.client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def http_url(settings: Any, host: str | None = None, websocket: bool = False) -> str:
    """The surface's base address as a client writes it: http(s):// or ws(s)://host:port."""
    secure = settings.tls.server_on
    scheme = ("wss" if secure else "ws") if websocket else ("https" if secure else "http")
    return f"{scheme}://{host or settings.host}:{settings.http_port}"


def http_surfaces(settings: Any, port: str | int = "") -> list[str]:
    """What `specvox up` prints under a gateway: each surface's address (`port`: that worker's HTTP port)."""
    if port:
        settings = settings.model_copy(update={"http_port": int(port)})
    base, ws = http_url(settings), http_url(settings, websocket=True)
    return [f"{base}/v1  (OpenAI HTTP: chat/completions, models, audio/transcriptions, audio/speech)",
            f"{ws}/v1/realtime  (OpenAI Realtime API)",
            f"{base}/  (the page: talk to the avatar in a browser)"]


class HttpSurface:
    """The application bound and serving: started by the gateway's build (so the port is taken, or the
    start fails, before gRPC health says SERVING), served until the drain by a gateway worker, which
    then gives open requests and WebSockets `drain_grace_s` to finish (aiohttp's graceful shutdown)."""

    def __init__(self, context: WebContext) -> None:
        self.settings = context.settings
        self.runner = web.AppRunner(build_app(context), access_log=None,
                                    shutdown_timeout=float(self.settings.drain_grace_s), handle_signals=False)

    async def start(self) -> None:
        settings = self.settings
        await self.runner.setup()
        site = web.TCPSite(self.runner, settings.host, settings.http_port,
                           ssl_context=server_ssl_context(settings.tls), reuse_port=False)
        try:
            await site.start()
        except OSError as e:
            await self.runner.cleanup()
            raise CannotListen(f"gateway: cannot listen on {settings.host}:{settings.http_port} (http_port; "
                               f"0 turns the HTTP surface off): {e.strerror}") from None
        log.info("gateway: OpenAI HTTP and Realtime API on %s", http_url(settings))

    async def serve_until_drain(self, draining: asyncio.Event) -> None:
        await draining.wait()
        await self.stop()

    async def stop(self) -> None:
        await self.runner.cleanup()  # a second call does nothing


def json_of(text: bytes | str, what: str = "the request body") -> Any:
    """Parsed JSON, or a 400 naming where it broke."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HttpError(400, f"{what} is not valid JSON: {e}") from None
