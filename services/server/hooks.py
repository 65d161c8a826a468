"""What `run_service` adds to every server and client channel from the settings: request metrics,
authentication, TLS, the metrics endpoint, and the credential a service presents to the others.

Each piece lives in its own module (metrics, auth, tls); this one only puts them together in
the order they must run, so that the server runner needs a few calls and no policy.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc

from services import tls
from services.channels import open_channel
from services.server import auth, limits

log = logging.getLogger(__name__)


def server_interceptors(settings: Any, service: str, redis: Any = None) -> list[grpc.aio.ServerInterceptor]:
    """Metrics outermost (refused calls are counted too), then authentication; logs the modes."""
    from services.server import metrics

    interceptors: list[grpc.aio.ServerInterceptor] = [metrics.RequestMetricsInterceptor(service)]
    authenticator = auth.authenticator(settings.auth, service)
    log.warning(auth.describe(settings.auth, service, authenticator)) if authenticator is None else \
        log.info(auth.describe(settings.auth, service, authenticator))
    if authenticator is not None:
        interceptors.append(auth.AuthInterceptor(authenticator))
    interceptors.extend(limits.interceptors(settings, service, redis))  # per tenant: after auth
    interceptors.extend(_tracing_interceptors(service))
    return interceptors


def _tracing_interceptors(service: str) -> list[grpc.aio.ServerInterceptor]:
    from services.server import tracing

    if tracing.configure(service):
        log.info("%s: OpenTelemetry spans exported over OTLP", service)
    interceptor = tracing.server_interceptor(service)
    return [interceptor] if interceptor is not None else []


def add_port(server: grpc.aio.Server, address: str, settings: Any, service: str) -> int:
    """Listen on `address`, over TLS where the settings give a certificate; the port bound (0: failed)."""
    credentials = tls.server_credentials(settings.tls)
    log.info(tls.describe(settings.tls, service))
    if credentials is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, credentials)


_watchers: set[Any] = set()


def start_metrics(settings: Any, service: str) -> int:
    """The Prometheus endpoint on `metrics_port` (0: none); the port it listens on. The gateway's
    also reports the work streams' lag, from a Redis client of its own (a configured URL only)."""
    import asyncio

    from services.server import metrics
    from services.store.client import connect

    port = metrics.start_endpoint(settings, service)
    if port and service == "gateway" and settings.redis_url:
        task = asyncio.get_running_loop().create_task(metrics.watch_streams(connect(settings.redis_url,
                                                                                    settings.redis)))
        _watchers.add(task)
        task.add_done_callback(_watchers.discard)
    return port


def internal_channel(settings: Any, service: str, options: list[tuple[str, Any]] | None = None) -> grpc.aio.Channel:
    """The gateway's channel to asr, llm or tts: their TLS, the cluster's service credential."""
    return open_channel(settings.address(service), secret=auth.service_token(settings.auth), tls=settings.tls,
                        options=options)
