"""The four services in the test's own process: each module's real `build(settings)` served by
`build_server` (interceptors, health, reflection, TLS port) on free loopback ports, as `run_service`
serves them without its signal loop. One process, so OpenTelemetry's in-memory exporter and one metrics
registry see all four services."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
from collections.abc import AsyncIterator

from services import SERVICE_MODULES
from services.server.runtime import build_server
from services.stack import free_port

ORDER = ("tts", "asr", "llm", "gateway")  # the gateway last: its channels reach the others


@contextlib.asynccontextmanager
async def four_services(settings) -> AsyncIterator[dict[str, str]]:
    """Yields the addresses; `settings` without ports: free ones are chosen here."""
    ports = {name: free_port() for name in (*ORDER, "http")}
    settings = settings.model_copy(update={f"{name}_port": port for name, port in ports.items()})
    async with contextlib.AsyncExitStack() as stack:
        for name in ORDER:
            await stack.enter_async_context(serve_one(settings, name))
        yield {name: f"127.0.0.1:{port}" for name, port in ports.items()}


@contextlib.asynccontextmanager
async def serve_one(settings, name: str) -> AsyncIterator[str]:
    """One service's real `build(settings)` on its port setting, as `run_service` serves it; its address.
    A gateway whose caller left `http_port` unset serves its HTTP surface on a free port."""
    draining = asyncio.Event()
    if name == "gateway" and "http_port" not in settings.model_fields_set:
        settings = settings.model_copy(update={"http_port": free_port()})
    service = await importlib.import_module(SERVICE_MODULES[name]).build(settings)
    workers: list[asyncio.Task] = []
    server = None
    try:
        server, _, address = await build_server(settings, name, service)
        await server.start()
        workers = [asyncio.create_task(work(draining)) for work in service.workers]
        yield address
    finally:
        draining.set()
        await asyncio.wait_for(asyncio.gather(*workers, return_exceptions=True), 30)
        if server is not None:
            await server.stop(None)
        if service.close:
            await service.close()
