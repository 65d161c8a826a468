"""What every specvox gRPC server shares: one way to build it (interceptors, health, reflection,
ports), and to run it until a signal, draining what is in flight."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services import SERVICE_MODULES
from services.channels import message_size_options
from services.server.interceptors import MalformedRequests

log = logging.getLogger(__name__)


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
    # gRPC services it serves beside its own proto's (Riva's on asr and tts): health and reflection name them too
    more_names: list[str] = field(default_factory=list)


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


class BuiltServer(NamedTuple):
    server: grpc.aio.Server  # not yet started
    health: health.aio.HealthServicer  # every name SERVING; a drain sets NOT_SERVING
    address: str  # host:port, bound


async def build_server(settings: Any, name: str, service: Service) -> BuiltServer:
    """The one place a server is made: the interceptors (metrics, auth, limits, tracing, then
    malformed requests), message limits, the service's servicers, health (every name SERVING),
    reflection, and its port (TLS where the settings give a certificate); CannotListen when the
    port is taken."""
    from services.server import hooks

    # so_reuseport off: a second process on a taken port fails to bind instead of sharing its calls.
    options = [*message_size_options(settings.max_message_bytes), ("grpc.so_reuseport", 0)]
    server = grpc.aio.server(options=options,
                             interceptors=[*hooks.server_interceptors(settings, name, service.redis),
                                           MalformedRequests()])
    service.register(server)
    names = [*service_names(name), *service.more_names]
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
        raise CannotListen(f"{settings.worker_name_of(name)}: cannot listen on {address} (is another process on it?)")
    return BuiltServer(server, health_servicer, address)


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
    server, health_servicer, address = await build_server(settings, name, service)
    hooks.start_metrics(settings, name)

    # Signals are handled before the service says it listens: one sent as soon as it does (a supervisor's
    # SIGTERM, SIGUSR2 for a snapshot) would otherwise meet the default action and end the process.
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
    await server.start()
    print(f"specvox {name} ({worker_name}) listening on {address}", flush=True)
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
    """`python -m <a module of SERVICE_MODULES>`: the settings from the environment, run_service,
    exit 1 with the reason when a worker failed or the port is taken. `specvox serve` does the same."""
    from services.server.logs import configure_logging
    from services.settings import Settings

    settings = Settings()
    configure_logging(os.environ.get("SPECVOX_LOG_LEVEL", "INFO"), settings.log_format)
    set_priority(settings, _service_of(build))
    try:
        asyncio.run(run_service(settings, build))
    except ServiceExit as e:
        print(f"specvox: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


def _service_of(build: Callable[..., Any]) -> str:
    """The service `build` serves, by its module in SERVICE_MODULES (under `python -m` its module is
    __main__: the name it was run by); "" for a build of another module (a test's probe)."""
    module = build.__module__
    if module == "__main__":
        module = getattr(sys.modules["__main__"].__spec__, "name", "")
    return next((name for name, path in SERVICE_MODULES.items() if path == module), "")


def _label(worker: Callable[..., Any]) -> str:
    return getattr(worker, "__qualname__", None) or repr(worker)
