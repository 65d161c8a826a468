"""What every server interceptor shares: one way to put a hook around each call, whatever the
method's kind (unary or streamed, a coroutine or an async generator); the refusal that reads a
request stream briefly first; and the interceptor that answers unparseable requests.

Auth, limits, metrics and tracing (services/server/{auth,limits,metrics,tracing}.py) each write
their per-call work as an async context manager and hand it to `wrap_handler`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

# One call's hook: entered before the behaviour runs, left after its last response (before the
# behaviour's own generator is closed), seeing any error on the way; it yields the request (or
# the request iterator) the behaviour gets. It may abort the call on entry (the behaviour never
# runs) or turn an error into a status on the way out.
Around = Callable[[Any, grpc.aio.ServicerContext], AbstractAsyncContextManager[Any]]


def behaviour_kind(handler: grpc.RpcMethodHandler) -> str:
    """The handler's field that holds its behaviour: "unary_unary", "stream_stream", ..."""
    return ("stream_" if handler.request_streaming else "unary_") + \
        ("stream" if handler.response_streaming else "unary")


def wrap_handler(handler: grpc.RpcMethodHandler, around: Around) -> grpc.RpcMethodHandler:
    """The same handler (kind, serializers) whose behaviour runs inside `around(request, context)`."""
    kind = behaviour_kind(handler)
    return handler._replace(**{kind: _wrapped(getattr(handler, kind), around)})


def _wrapped(behaviour: Callable[..., Any], around: Around) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behaviour):
        async def stream(request, context):
            responses = None
            try:
                async with around(request, context) as request:
                    responses = behaviour(request, context)
                    async for response in responses:
                        yield response
            finally:
                if responses is not None:
                    await responses.aclose()  # at once, as grpc closes the wrapper, not when collected

        return stream

    async def call(request, context):  # a unary answer, or a stream written with context.write
        async with around(request, context) as request:
            result = behaviour(request, context)
            return await result if inspect.isawaitable(result) else result

    return call


# How long a refused call's request stream is read before the refusal (see `abort_refused`).
REFUSAL_DRAIN_S = 0.5
REFUSAL_DRAIN_MESSAGES = 16


async def abort_refused(request, context, code: grpc.StatusCode, details: str) -> None:
    """End a refused call with `code`, a streaming one after reading its first requests (a few, briefly).

    grpc's asyncio client reports INTERNAL "Internal error from Core" instead of the server's
    status when one of its writes is still in flight as the status arrives (grpc/grpc#36066,
    about 1 call in 100 on loopback), so a client sending a request or two and closing would
    now and then not learn why it was refused. Bounded in time and count: a client that
    streams on and never closes is refused all the same."""
    if hasattr(request, "__aiter__"):
        async def read() -> None:
            n = 0
            async for _ in request:
                n += 1
                if n >= REFUSAL_DRAIN_MESSAGES:
                    return

        # the time bound, a broken stream, a malformed message: the refusal follows all the same
        with contextlib.suppress(Exception):
            await asyncio.wait_for(read(), REFUSAL_DRAIN_S)
    await context.abort(code, details)


class MalformedRequestError(ValueError):
    """A request's bytes are no valid protobuf message of its method's type."""


@dataclass(frozen=True)
class _Malformed:
    message: str


class MalformedRequests(grpc.aio.ServerInterceptor):
    """A request that does not parse is INVALID_ARGUMENT naming the method and the type.

    grpc answers it UNKNOWN on its own (a unary request), and a streamed one raised DecodeError
    inside the servicer's loop, which status_on_error took for an internal error (found by
    bench/fuzz.py). Parsing still happens where grpc does it; a failure comes back as a marker that
    the wrapped method turns into the status (or, in a request stream, into a MalformedRequestError,
    a ValueError, which every servicer already answers INVALID_ARGUMENT).
    """

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        behaviour = getattr(handler, behaviour_kind(handler))
        if not (inspect.iscoroutinefunction(behaviour) or inspect.isasyncgenfunction(behaviour)):
            return handler  # a sync method: grpc runs it in a thread, left as it is
        method, parse = handler_call_details.method.lstrip("/"), handler.request_deserializer

        def tolerant(raw: bytes):
            try:
                return parse(raw)
            except DecodeError as e:
                return _Malformed(f"{method}: the request is not a valid protobuf message: {e}")

        checked = _checked_requests if handler.request_streaming else _checked_request
        return wrap_handler(handler, checked)._replace(request_deserializer=tolerant)


@contextlib.asynccontextmanager
async def _checked_request(request, context) -> AsyncIterator[Any]:
    if isinstance(request, _Malformed):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
    yield request


@contextlib.asynccontextmanager
async def _checked_requests(requests, context) -> AsyncIterator[Any]:
    async def parsed():
        async for request in requests:
            if isinstance(request, _Malformed):
                raise MalformedRequestError(request.message)
            yield request

    try:
        yield parsed()
    except MalformedRequestError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
