"""OpenTelemetry spans for a turn across the four services, when the `otel` extra is installed.

Every server call gets a SERVER span whose parent comes from the caller's `traceparent`
metadata (W3C trace context), and every outgoing call made through services/channels.py
carries the current one, so a conversation is one trace: the gateway's Converse, asr's
Transcribe, and per turn a `turn` span with llm's EndOfTurn and Reply and tts's SpeakTurn.
Without the packages every function here does nothing and nothing else changes.

Spans go where the process's tracer provider sends them: `configure()` sets one up with an
OTLP exporter when OTEL_EXPORTER_OTLP_ENDPOINT is set (and the exporter is installed); a
test or an embedding application may install its own provider instead.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc

from services import channels
from services.server import logs
from services.server.interceptors import wrap_handler

log = logging.getLogger(__name__)

try:
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
    from opentelemetry.trace import SpanKind, Status, StatusCode

    AVAILABLE = True
except ImportError:  # the otel extra is not installed: tracing is off
    AVAILABLE = False

TRACER_NAME = "specvox"


def _inject() -> list[tuple[str, str]]:
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return list(carrier.items())


if AVAILABLE:
    channels.add_propagator(_inject)


def configure(service: str) -> bool:
    """A tracer provider for this process exporting over OTLP, if OTEL_EXPORTER_OTLP_ENDPOINT
    is set and none is installed yet. True when spans go somewhere."""
    if not AVAILABLE or not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return False
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("OTEL_EXPORTER_OTLP_ENDPOINT is set but opentelemetry-exporter-otlp is not installed")
        return False
    provider = TracerProvider(resource=Resource.create({"service.name": f"specvox-{service}"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return True


def _tracer():
    return trace.get_tracer(TRACER_NAME)


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """A SERVER span around each call, child of the caller's trace context."""

    def __init__(self, service: str) -> None:
        self.service = service

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith("/grpc."):  # health, reflection
            return handler
        carrier = {k: (v.decode() if isinstance(v, bytes) else v)
                   for k, v in (handler_call_details.invocation_metadata or ())}
        name = f"{self.service} {handler_call_details.method.lstrip('/')}"
        return wrap_handler(handler, functools.partial(self._traced, name, carrier))

    @contextlib.asynccontextmanager
    async def _traced(self, name: str, carrier: dict[str, str], request, context) -> AsyncIterator[Any]:
        # The span is current in the call's own task from here on: grpc runs each call in a task of
        # its own, so it is never detached (a stream may be closed from another task's context).
        parent = propagate.extract(carrier)
        span = _tracer().start_span(name, context=parent, kind=SpanKind.SERVER,
                                    attributes={"specvox.service": self.service, "rpc.system": "grpc"})
        otel_context.attach(trace.set_span_in_context(span, parent))
        error: BaseException | None = None
        try:
            yield request
        except BaseException as e:
            error = e
            raise
        finally:
            code = context.code()
            if error is not None and not isinstance(error, grpc.aio.AbortError | GeneratorExit):
                span.set_status(Status(StatusCode.ERROR, type(error).__name__))
            elif code not in (None, grpc.StatusCode.OK, 0):
                span.set_status(Status(StatusCode.ERROR, str(code)))
            span.end()


def server_interceptor(service: str) -> grpc.aio.ServerInterceptor | None:
    return TracingInterceptor(service) if AVAILABLE else None


class TurnSpan:
    """The span of one turn at the gateway (a no-op without OpenTelemetry)."""

    def __init__(self, session_id: str, turn_id: str, mode: str) -> None:
        self.span = None
        if AVAILABLE:
            self.span = _tracer().start_span("turn", attributes={
                "specvox.session_id": session_id, "specvox.turn_id": turn_id, "specvox.mode": mode})
        self.session_id, self.turn_id = session_id, turn_id

    def context(self) -> contextvars.Context:
        """A context for the turn's tasks: the span current (their calls carry it), the ids logged."""
        ctx = contextvars.copy_context()
        ctx.run(self._enter)
        return ctx

    def _enter(self) -> None:
        logs.bind(session_id=self.session_id, turn_id=self.turn_id)
        if self.span is not None:
            otel_context.attach(trace.set_span_in_context(self.span))

    def end(self, **attributes: Any) -> None:
        if self.span is not None:
            for key, value in attributes.items():
                if value is not None:
                    self.span.set_attribute(f"specvox.{key}", value)
            self.span.end()
            self.span = None


@contextlib.contextmanager
def span(name: str, **attributes: Any) -> Iterator[None]:
    """An internal span (a no-op without OpenTelemetry)."""
    if not AVAILABLE:
        yield
        return
    with _tracer().start_as_current_span(name, attributes={f"specvox.{k}": v for k, v in attributes.items()}):
        yield


def carrier() -> dict[str, str]:
    """The current trace context as W3C headers, to travel where no gRPC metadata goes (a work
    entry on a Redis stream); empty without OpenTelemetry."""
    found: dict[str, str] = {}
    if AVAILABLE:
        propagate.inject(found)
    return found


@contextlib.contextmanager
def work_span(service: str, name: str, headers: dict[str, str], **attributes: Any) -> Iterator[None]:
    """A CONSUMER span around work taken from a queue, child of the trace context the producer put in
    the entry (`carrier()`), so a turn's llm and tts work hang under its `turn` span as calls did."""
    if not AVAILABLE:
        yield
        return
    parent = propagate.extract(headers)
    attributes = {"specvox.service": service, **{f"specvox.{k}": v for k, v in attributes.items()}}
    with _tracer().start_as_current_span(name, context=parent, kind=SpanKind.CONSUMER, attributes=attributes):
        yield
