"""What every specvox gRPC server shares: limits, health, reflection, error mapping, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import inspect
import itertools
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pipeline.audio import AudioFormatError
from pipeline.llm.prompts import PromptTooLongError
from pipeline.models import ModelNotFoundError
from services import SERVICE_MODULES
from services.redis_store import (
    REDIS_DOWN,
    LogGap,
    LogMoved,
    RedisUnavailableError,
    TokenStreamTimeout,
    UnknownSessionError,
    UnknownTurnError,
    now_ms,
)
from services.server.limits import LimitExceededError
from services.store.work_queue import Fenced, HandBack

log = logging.getLogger(__name__)
T = TypeVar("T")

# Domain errors → the status a client sees. Anything else is INTERNAL and logged.
STATUS_FOR_ERROR: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (UnknownSessionError, grpc.StatusCode.NOT_FOUND),
    (UnknownTurnError, grpc.StatusCode.NOT_FOUND),
    (AudioFormatError, grpc.StatusCode.INVALID_ARGUMENT),
    (PromptTooLongError, grpc.StatusCode.INVALID_ARGUMENT),
    (ModelNotFoundError, grpc.StatusCode.FAILED_PRECONDITION),
    (TokenStreamTimeout, grpc.StatusCode.DEADLINE_EXCEEDED),
    (LimitExceededError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)

# Refusals: what a queue worker cannot ever do with a turn, however often it tries; the turn
# ends with the reason (`rejection`) instead of being retried.
REJECTED: tuple[type[BaseException], ...] = tuple(kind for kind, _ in STATUS_FOR_ERROR)


def rejection(error: BaseException) -> str:
    """A refusal as a status would say it: "INVALID_ARGUMENT: user_text is empty"."""
    code = next((c for kind, c in STATUS_FOR_ERROR if isinstance(error, kind)), grpc.StatusCode.INTERNAL)
    return f"{code.name}: {error}"


async def work_through_log(steps: AsyncIterator, end_log: Callable[[str], Awaitable[None]]) -> None:
    """A queue worker's turn run to its end, what became of its log told to the queue: another
    holder took the log (`Fenced`: let the entry go), a gap after a Redis restart (`HandBack`:
    resume from the log), a refusal (`end_log(reason)` ends the log with its status; the entry
    is done)."""
    try:
        async for _ in steps:
            pass
    except LogMoved as e:
        raise Fenced(str(e)) from None
    except LogGap as e:
        log.warning("%s; resuming from the log", e)
        raise HandBack(str(e)) from None
    except REJECTED as e:
        await end_log(rejection(e))


def message_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


MAX_DETAIL_BYTES = 1_000


def clipped(detail: str) -> str:
    """A status message short enough to reach the client: it travels in a trailer, percent-encoded,
    and a client drops trailers past 8 KiB (grpc's default), status and all. A message that quoted a
    huge field ("unknown session id '…'") ended as RESOURCE_EXHAUSTED "Stream removed" (fuzzing)."""
    raw = detail.encode()
    if len(raw) <= MAX_DETAIL_BYTES:
        return detail
    return raw[:MAX_DETAIL_BYTES].decode(errors="ignore") + f"… ({len(raw)} bytes in all)"


@contextlib.asynccontextmanager
async def status_on_error(context: grpc.aio.ServicerContext, stage: str) -> AsyncIterator[None]:
    """Turn a domain error into a clear gRPC status instead of a dropped stream."""
    try:
        yield
    except (asyncio.CancelledError, grpc.aio.AbortError):
        raise
    except grpc.aio.AioRpcError as e:  # a downstream service said no: pass its word on
        await context.abort(e.code(), clipped(f"{stage}: {e.details()}"))
    except REDIS_DOWN as e:  # out of reach past the retry deadline: the caller may try again later
        log.warning("%s: %s", stage, e)
        detail = str(e) if isinstance(e, RedisUnavailableError) else f"redis unreachable: {type(e).__name__}: {e}"
        await context.abort(grpc.StatusCode.UNAVAILABLE, clipped(f"{stage}: {detail}"))
    except Exception as e:  # noqa: BLE001 - mapped below, the rest logged
        code = next((c for kind, c in STATUS_FOR_ERROR if isinstance(e, kind)), None)
        if code is None:
            log.exception("%s: internal error", stage)
            await context.abort(grpc.StatusCode.INTERNAL, clipped(f"{stage}: internal error: {type(e).__name__}: {e}"))
        await context.abort(code, clipped(f"{stage}: {e}"))


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
        kind = ("stream_" if handler.request_streaming else "unary_") + (
            "stream" if handler.response_streaming else "unary")
        behaviour = getattr(handler, kind)
        if not (inspect.iscoroutinefunction(behaviour) or inspect.isasyncgenfunction(behaviour)):
            return handler  # a sync method: grpc runs it in a thread, left as it is
        method, parse = handler_call_details.method.lstrip("/"), handler.request_deserializer

        def tolerant(raw: bytes):
            try:
                return parse(raw)
            except DecodeError as e:
                return _Malformed(f"{method}: the request is not a valid protobuf message: {e}")

        wrap = _streamed_requests if handler.request_streaming else _single_request
        return handler._replace(request_deserializer=tolerant, **{kind: wrap(behaviour)})


def _single_request(behaviour):
    if inspect.isasyncgenfunction(behaviour):
        async def stream(request, context):
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            responses = behaviour(request, context)
            try:
                async for response in responses:
                    yield response
            finally:
                await responses.aclose()  # at once, as grpc closes the wrapper, not when collected

        return stream

    async def call(request, context):  # a unary answer, or a stream written with context.write
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await behaviour(request, context)

    return call


def _streamed_requests(behaviour):
    async def checked(requests):
        async for request in requests:
            if isinstance(request, _Malformed):
                raise MalformedRequestError(request.message)
            yield request

    if inspect.isasyncgenfunction(behaviour):
        async def stream(requests, context):
            responses = behaviour(checked(requests), context)
            try:
                async for response in responses:
                    yield response
            except MalformedRequestError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            finally:
                await responses.aclose()

        return stream

    async def call(requests, context):
        try:
            return await behaviour(checked(requests), context)
        except MalformedRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    return call


@dataclass
class StageClock:
    """When a stage received and emitted its first and last item (Unix ms)."""

    stage: str
    first_in_unix_ms: int = 0
    last_in_unix_ms: int = 0
    first_out_unix_ms: int = 0
    last_out_unix_ms: int = 0

    def received(self) -> None:
        t = now_ms()
        self.first_in_unix_ms = self.first_in_unix_ms or t
        self.last_in_unix_ms = t

    def emitted(self) -> None:
        t = now_ms()
        self.first_out_unix_ms = self.first_out_unix_ms or t
        self.last_out_unix_ms = t

    def to_proto(self, message_type: Callable[..., T]) -> T:
        return message_type(**vars(self))


class ModelWorker:
    """One thread for a service's model: calls run one at a time, off the event loop.

    Waiting calls go earliest deadline first (Liu and Layland 1973): each says when its result
    is due (Unix seconds; by default, when it was made, so calls that say nothing run in
    order). The tts says when each piece's audio will be played, so a new turn's first phrase
    goes ahead of the later phrases of replies already playing.
    """

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._busy = False
        self._waiting: list[tuple[float, int, asyncio.Future]] = []
        self._arrivals = itertools.count()

    @property
    def busy(self) -> bool:
        """A call is running (others may be waiting)."""
        return self._busy

    async def call(self, fn: Callable[..., T], *args: Any, due_s: float | None = None) -> T:
        await self._take_turn(time.time() if due_s is None else due_s)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        finally:
            self._pass_turn()

    async def iterate(self, iterator: Iterator[T], due_s: Callable[[], float] | None = None) -> AsyncIterator[T]:
        """Advance a blocking iterator in the worker thread, one item per call; `due_s`: each item's due time."""
        done = object()
        while (item := await self.call(next, iterator, done, due_s=due_s() if due_s else None)) is not done:
            yield item  # type: ignore[misc]

    async def _take_turn(self, due_s: float) -> None:
        if not self._busy:
            self._busy = True
            return
        turn = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (due_s, next(self._arrivals), turn))
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # the turn had come: hand it on
                self._pass_turn()
            raise

    def _pass_turn(self) -> None:
        while self._waiting:
            turn = heapq.heappop(self._waiting)[2]
            if not turn.done():
                turn.set_result(None)
                return
        self._busy = False


@dataclass
class Service:
    """What a service module builds for `run_service`: its servicers, its background workers, what to close."""

    name: str  # "asr" | "llm" | "tts" | "gateway": its port setting, proto and health names
    register: Callable[[grpc.aio.Server], None]  # adds the servicer(s)
    # Each runs while the service serves; the Event is set when draining begins: a worker stops
    # claiming new work, finishes or hands back what it holds, and returns. Raising, or returning
    # before the Event is set, stops the process (WorkerFailed, exit 1).
    workers: list[Callable[[asyncio.Event], Awaitable[None]]] = field(default_factory=list)
    close: Callable[[], Awaitable[None]] | None = None
    redis: Any = None  # the service's Redis client, where its interceptors keep counts (the gateway's limits)


class ServiceExit(RuntimeError):
    """The service stopped for a reason its message says in full (exit 1, no traceback needed)."""


class WorkerFailed(ServiceExit):
    """A background worker raised, or returned before the drain: the process exits for its supervisor to restart."""


class CannotListen(ServiceExit):
    """The service's port is taken (or not ours to bind)."""


def service_names(name: str) -> list[str]:
    """The full gRPC service names of one service's proto (what health and reflection announce)."""
    from services.protos import load

    messages, _ = load(name)
    return [s.full_name for s in messages.DESCRIPTOR.services_by_name.values()]


async def run_service(settings: Any, build: Callable[[Any], Awaitable[Service]]) -> None:
    """Build a service, serve it with health and reflection until SIGTERM or SIGINT, drain, close.

    Draining: health says NOT_SERVING, the server takes no new call and gives those in flight
    `settings.drain_grace_s` to finish while the workers see their Event set and wind down in the
    same grace (cancelled past it); then the close hook runs. A worker that fails takes the
    process down the same way and raises WorkerFailed, so a supervisor restarts a whole process
    rather than one that serves calls but no longer takes work.
    """
    from services.server import allocator

    allocator.tune(settings.malloc_arena_max, settings.malloc_trim_interval_s)  # before the models' threads
    service = await build(settings)
    try:
        await _serve(settings, service)
    finally:
        if service.close:
            await service.close()
        log.info("%s stopped", service.name)


async def _serve(settings: Any, service: Service) -> None:
    from services.server import hooks, memory_trace

    name, worker_name = service.name, settings.worker_name_of(service.name)
    # so_reuseport off: a second process on a taken port fails to bind instead of sharing its calls.
    options = [*message_options(settings.max_message_bytes), ("grpc.so_reuseport", 0)]
    server = grpc.aio.server(options=options,
                             interceptors=[*hooks.server_interceptors(settings, name, service.redis),
                                           MalformedRequests()])
    service.register(server)
    names = service_names(name)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for full_name in ["", *names]:
        await health_servicer.set(full_name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    address = f"{settings.host}:{getattr(settings, f'{name}_port')}"
    try:
        bound = hooks.add_port(server, address, settings, name)
    except RuntimeError as e:  # grpc raises where it once returned 0
        log.debug("%s: %s", name, e)
        bound = 0
    if bound == 0:
        raise CannotListen(f"{worker_name}: cannot listen on {address} (is another process on it?)")
    hooks.start_metrics(settings, name)
    await server.start()
    print(f"specvox {name} ({worker_name}) listening on {address}", flush=True)

    draining, signalled = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        # A repeated signal (Ctrl-C reaches `specvox up`'s children too, then its SIGTERM) is not a
        # second, harder stop: the drain keeps its grace, and a supervisor SIGKILLs past it.
        log.info("%s: %s: %s", worker_name, sig.name, "draining" if not signalled.is_set() else "already draining")
        signalled.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    memory_trace.install(name, worker_name, loop)
    workers = {asyncio.create_task(w(draining), name=f"{worker_name} worker {_label(w)}"): w for w in service.workers}
    failure: str | None = None
    try:
        signal_wait = asyncio.create_task(signalled.wait())
        done, _ = await asyncio.wait({signal_wait, *workers}, return_when=asyncio.FIRST_COMPLETED)
        signal_wait.cancel()
        for task in done - {signal_wait}:
            error = None if task.cancelled() else task.exception()
            failure = f"background worker {_label(workers[task])} " + (
                f"failed: {type(error).__name__}: {error}" if error else "returned before the drain began")
            log.critical("%s: %s; stopping the service (its supervisor restarts it)", worker_name, failure,
                         exc_info=error)
            break
        grace = float(settings.drain_grace_s)
        draining.set()
        await health_servicer.enter_graceful_shutdown()
        log.info("%s: draining: no new calls; the calls in flight and %d workers get %.1f s", worker_name,
                 len(workers), grace)
        stopping = asyncio.create_task(server.stop(grace))
        running = [t for t in workers if not t.done()]
        if running:
            _, late = await asyncio.wait(running, timeout=grace)
            for task in late:
                log.warning("%s: worker %s still running %.1f s into the drain; cancelled", worker_name,
                            _label(workers[task]), grace)
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        for task in running:
            if not task.cancelled() and (error := task.exception()) is not None:
                log.error("%s: worker %s failed while draining: %s", worker_name, _label(workers[task]), error,
                          exc_info=error)
        await stopping
    finally:
        for task in workers:
            task.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    if failure:
        raise WorkerFailed(f"{worker_name}: {failure}")


def set_priority(settings: Any, service: str) -> None:
    """This process at the service's `settings.nice`: every thread of it, since Linux keeps a
    nice value per thread (threads made later inherit their maker's). A value this process may
    not take (below its own, without the privilege) is logged and left."""
    nice = settings.nice.get(service, 0)
    if not nice:
        return
    tasks = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]
    try:
        for task in tasks:
            os.setpriority(os.PRIO_PROCESS, int(task), nice)
    except (PermissionError, ProcessLookupError) as e:
        log.warning("%s: nice %d not taken (%s)", service, nice, e)


def service_main(build: Callable[[Any], Awaitable[Service]]) -> None:
    """`python -m services.<name>_service`: the settings from the environment, run_service, exit 1
    with the reason when a worker failed or the port is taken. `specvox serve` does the same."""
    import sys

    from services.runtime import configure_logging
    from services.settings import Settings

    settings = Settings()
    configure_logging(os.environ.get("SPECVOX_LOG_LEVEL", "INFO"), settings.log_format)
    set_priority(settings, next(name for name, module in SERVICE_MODULES.items() if module == build.__module__))
    try:
        asyncio.run(run_service(settings, build))
    except ServiceExit as e:
        print(f"specvox: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


def _label(worker: Callable[..., Any]) -> str:
    return getattr(worker, "__qualname__", None) or repr(worker)
