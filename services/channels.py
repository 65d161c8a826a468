"""Client channels that carry what a server asks of a caller: TLS credentials, the bearer
credential and the trace context, on every call without each call site adding them.

The credential travels as metadata through an interceptor rather than gRPC call credentials,
which gRPC refuses on plaintext channels (auth without TLS is allowed, for loopback).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc

from services.tls import TlsOptions, channel_credentials, channel_options

Metadata = Sequence[tuple[str, str]]


def credential_metadata(secret: str) -> tuple[tuple[str, str], ...]:
    """A call's bearer credential (an API key, or the cluster's service credential), as
    services/server/auth.py reads it."""
    return (("authorization", f"Bearer {secret}"),) if secret else ()


def message_size_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """The channel options that let messages up to `max_message_bytes` through, both ways."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


class _AddMetadata:
    """Adds `extra()`'s pairs to every call's metadata (asked per call: a trace context changes)."""

    def __init__(self, extra: Callable[[], Metadata]) -> None:
        self.extra = extra

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        pairs = self.extra()
        if not pairs:
            return details
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        for key, value in pairs:
            metadata.add(key, value)
        return details._replace(metadata=metadata)


# One class per kind of call: a channel files each interceptor under the first kind it is.
class _UnaryUnary(_AddMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _UnaryStream(_AddMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _StreamUnary(_AddMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStream(_AddMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def metadata_interceptors(extra: Callable[[], Metadata]) -> list[Any]:
    return [kind(extra) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


# Functions adding metadata to every outgoing call (services/server/tracing.py registers the trace context).
_PROPAGATORS: list[Callable[[], Metadata]] = []


def add_propagator(extra: Callable[[], Metadata]) -> None:
    if extra not in _PROPAGATORS:
        _PROPAGATORS.append(extra)


def open_channel(address: str, *, secret: str = "", tls: TlsOptions | None = None,
                 options: list[tuple[str, Any]] | None = None) -> grpc.aio.Channel:
    """A channel to `address`: TLS where `tls` says so, `secret` as the bearer credential."""
    tls = tls or TlsOptions()
    fixed = credential_metadata(secret)

    def extra() -> list[tuple[str, str]]:
        out = list(fixed)
        for propagate in _PROPAGATORS:
            out.extend(propagate())
        return out

    interceptors = metadata_interceptors(extra)
    all_options = [*(options or []), *channel_options(tls)]
    credentials = channel_credentials(tls)
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=all_options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, credentials, options=all_options, interceptors=interceptors)


def open_sync_channel(address: str, *, secret: str = "", tls: TlsOptions | None = None) -> grpc.Channel:
    """The blocking twin, for `specvox up`'s health checks."""
    tls = tls or TlsOptions()
    credentials = channel_credentials(tls)
    channel = grpc.insecure_channel(address) if credentials is None else \
        grpc.secure_channel(address, credentials, options=channel_options(tls))
    if secret:
        channel = grpc.intercept_channel(channel, _SyncMetadata(credential_metadata(secret)))
    return channel


class _SyncMetadata(grpc.UnaryUnaryClientInterceptor):
    def __init__(self, pairs: Metadata) -> None:
        self.pairs = pairs

    def intercept_unary_unary(self, continuation, client_call_details, request):
        details = _SyncDetails(client_call_details.method, client_call_details.timeout,
                               [*(client_call_details.metadata or ()), *self.pairs],
                               client_call_details.credentials, client_call_details.wait_for_ready,
                               getattr(client_call_details, "compression", None))
        return continuation(details, request)


class _SyncDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression) -> None:
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression
