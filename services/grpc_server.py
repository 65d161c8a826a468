"""What every specvox gRPC server shares: limits, health, reflection, error mapping, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pipeline.audio import AudioFormatError
from pipeline.llm.prompts import PromptTooLongError
from pipeline.models import ModelNotFoundError
from services.redis_store import TokenStreamTimeout, UnknownSessionError, UnknownTurnError, now_ms

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
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)


def message_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


@contextlib.asynccontextmanager
async def status_on_error(context: grpc.aio.ServicerContext, stage: str) -> AsyncIterator[None]:
    """Turn a domain error into a clear gRPC status instead of a dropped stream."""
    try:
        yield
    except (asyncio.CancelledError, grpc.aio.AbortError):
        raise
    except grpc.aio.AioRpcError as e:  # a downstream service said no: pass its word on
        await context.abort(e.code(), f"{stage}: {e.details()}")
    except Exception as e:  # noqa: BLE001 - mapped below, the rest logged
        code = next((c for kind, c in STATUS_FOR_ERROR if isinstance(e, kind)), None)
        if code is None:
            log.exception("%s: internal error", stage)
            await context.abort(grpc.StatusCode.INTERNAL, f"{stage}: internal error: {type(e).__name__}: {e}")
        await context.abort(code, f"{stage}: {e}")


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
    """One thread for a service's model: calls run in order, off the event loop."""

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def iterate(self, iterator: Iterator[T]) -> AsyncIterator[T]:
        """Advance a blocking iterator in the worker thread, one item per call."""
        done = object()
        while (item := await self.call(next, iterator, done)) is not done:
            yield item  # type: ignore[misc]


async def serve(
    name: str,
    register: Callable[[grpc.aio.Server], None],
    service_names: list[str],
    address: str,
    max_message_bytes: int,
    on_stop: Callable[[], Any] | None = None,
) -> None:
    """Start a server with health and reflection, run until SIGINT/SIGTERM, stop gracefully."""
    server = grpc.aio.server(options=message_options(max_message_bytes))
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for service in ["", *service_names]:
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    if server.add_insecure_port(address) == 0:
        raise RuntimeError(f"{name}: cannot listen on {address}")
    await server.start()
    print(f"specvox {name} listening on {address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=3)
    if on_stop:
        await on_stop()
    log.info("%s stopped", name)
