"""`specvox up` (every service under the supervisor) and `specvox serve NAME` (one service alone)."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
from pathlib import Path

from services import SERVICE_MODULES
from services.cli.command import Command
from services.stack import READY_LINE

SERVICES = ("asr", "llm", "tts", "gateway")
START_ORDER = ("tts", "asr", "llm", "gateway")  # the gateway last: it calls the others


def up_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tts-python", help="run the tts service with this interpreter (e.g. the Coqui env's, "
                                             ".venv-coqui/bin/python); default: settings.tts_python, else this one")
    parser.add_argument("--workers", type=_workers_arg, default={}, metavar="STAGE=N,...",
                        help="processes per stage, e.g. llm=2,tts=2 (default 1 each): named llm-0, llm-1, ..., "
                             "worker i on the stage's port + i * supervisor.worker_port_stride")
    parser.add_argument("--services", type=_services_arg, default=SERVICES, metavar="STAGE,...",
                        help="start only these stages (e.g. llm,tts for a second machine sharing the "
                             "first one's Redis); default: all four")


def run_up(settings, args: argparse.Namespace) -> int:
    return up(settings, args.tts_python or settings.tts_python, args.services, args.workers)


def serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("service", choices=SERVICES)


def prepare_serve(settings, args: argparse.Namespace, started_as_command: bool) -> None:
    """A service's process: OpenMP threads that wait passively, and, started as a command (which
    may start again), glibc's allocator tuned or another malloc preloaded for it."""
    _idle_threads_yield()  # before torch or ctranslate2 loads OpenMP
    if started_as_command:
        from services.server import allocator

        allocator.exec_with_tunables(settings.malloc_mmap_threshold.get(args.service, 0), settings.malloc_huge_pages,
                                     settings.malloc_library.get(args.service, ""), args.service)


def run_serve(settings, args: argparse.Namespace) -> int:
    return serve_one(settings, args.service)


def _workers_arg(text: str) -> dict[str, int]:
    from services.server.supervisor import parse_workers

    try:
        return parse_workers(text, SERVICES)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _services_arg(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in SERVICES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown) or 'nothing'}: the stages are {', '.join(SERVICES)}")
    return names


def _idle_threads_yield() -> None:
    """A service's OpenMP threads wait passively (OMP_WAIT_POLICY=PASSIVE) unless told otherwise.

    The services share a machine's cores (`specvox up` runs asr, llm and tts side by side), and
    OpenMP's default lets idle threads spin at every barrier: a spinning torch or CTranslate2
    thread holds a core another stage needs, and a stage whose thread lost its core waits at
    the barrier for it. On 2 cores with one kept busy, plain decoding ran at 2 tokens/s
    spinning and 8 passive (and a 52-token prefill took 2.1 s against 0.18). Alone on a
    quiet machine spinning is faster (12 against 9.5 tokens/s), so the one-process commands
    (generate, bench spec) keep OpenMP's default, and an OMP_WAIT_POLICY already set wins.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def kernel_threads_beside_other_stages(settings, env: dict[str, str]) -> None:
    """Under `specvox up` the llm shares the machine's cores with asr and tts, so its int4-exact
    kernels run on the calling thread unless `llm.kernel_threads` names a count (its 0, one per core,
    is for an llm with a machine to itself). Two kernel threads beside the other stages, 4 sessions
    on 2 cores (2026-12-05, docs/benchmarks/history.md): the budget missed in 19 of 72 turns against 12 on one."""
    if settings.llm.kernel_threads == 0:
        env.setdefault("SPECVOX_LLM__KERNEL_THREADS", "1")


def serve_one(settings, service: str) -> int:
    import importlib

    from services.server.runtime import ServiceExit, run_service, set_priority

    module = importlib.import_module(SERVICE_MODULES[service])
    set_priority(settings, service)
    try:
        asyncio.run(run_service(settings, module.build))
    except ServiceExit as e:  # a worker failed (its traceback logged where it did), or the port is taken
        print(f"specvox: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


# What the asr and tts ports also speak (services/riva): `specvox up` says so under each.
RIVA_SURFACES = {"asr": "NVIDIA Riva: nvidia.riva.asr.RivaSpeechRecognition",
                 "tts": "NVIDIA Riva: nvidia.riva.tts.RivaSpeechSynthesis"}


def up(settings, tts_python: str = "", stages: tuple[str, ...] = SERVICES,
       workers: dict[str, int] | None = None) -> int:
    """Run each service (or each of `stages`) as its own processes under services/server/supervisor.py:
    models load in parallel, no shared GIL, a crashed one restarted while the others serve.

    The tts service may run under another interpreter: the Coqui backend's environment
    cannot share this one's torch.
    """
    from services import protos
    from services.gateway.web import http_surfaces
    from services.server import auth
    from services.server.supervisor import Supervisor, health_probe, plan_children
    from services.store.client import masked_url
    from services.store.embedded import default_data_dir, start_embedded_redis

    workers = workers or {}
    pythons = {name: sys.executable for name in SERVICES}
    if tts_python:
        resolved = shutil.which(tts_python)
        if resolved is None:
            print(f"specvox: the tts interpreter {tts_python!r} does not exist (for the Coqui backend: make coqui)",
                  file=sys.stderr)
            return 2
        pythons["tts"] = resolved

    try:
        protos.require()  # said once here, not by four children failing alike
    except protos.ProtosNotBuiltError as e:
        print(f"specvox: {e}", file=sys.stderr)
        return 2
    embedded = None
    env = dict(os.environ)
    kernel_threads_beside_other_stages(settings, env)
    # Keys enforced at the gateway: asr, llm and tts take only the cluster's credential (generated once).
    cluster_auth, credential_env = auth.cluster_credential(
        settings.auth, Path(settings.redis.data_dir or default_data_dir()).parent)
    settings = settings.model_copy(update={"auth": cluster_auth})
    env.update(credential_env)

    def ready(children) -> None:
        print(f"specvox: {READY_LINE}", flush=True)  # what services/stack.py waits for
        for child in children:
            stage = child.name.rsplit("-", 1)[0]
            other = f"  ({pythons[stage]})" if pythons[stage] != sys.executable else ""
            print(f"  {child.name:<10} {child.address:<22} pid {child.pid}{other}", flush=True)
            if stage == "gateway" and settings.http_port:
                for line in http_surfaces(settings, child.env.get("SPECVOX_HTTP_PORT", "")):
                    print(f"  {'':<10} {line}", flush=True)
            elif stage in RIVA_SURFACES:
                print(f"  {'':<10} {child.address}  ({RIVA_SURFACES[stage]})", flush=True)
        print("  redis      " + (embedded.display_url if embedded else masked_url(str(settings.redis_url))),
              flush=True)
        print("specvox: a crashed service is restarted; Ctrl-C stops everything", flush=True)

    supervisor = Supervisor(settings.supervisor, settings.drain_grace_s, health_probe(settings), on_ready=ready)
    supervisor.catch_signals()  # from here a SIGTERM drains, and the Valkey below is stopped
    try:
        if not settings.redis_url:
            embedded = start_embedded_redis(settings)
            env["SPECVOX_REDIS_URL"] = embedded.url
            print(f"specvox: embedded Valkey at {embedded.display_url} (data in {embedded.data_dir})", flush=True)
        ports = {name: getattr(settings, f"{name}_port") for name in SERVICES}
        order = [name for name in START_ORDER if name in stages]
        children = plan_children(order, workers, env, pythons, ports, settings.host, settings.metrics_port,
                                 settings.supervisor, settings.http_port)
        return supervisor.run(children)
    finally:
        if embedded:
            embedded.stop()
        print("specvox: stopped", flush=True)


COMMANDS = (
    Command("up", "start Redis (embedded unless configured) and all four services on loopback", up_arguments, run_up),
    Command("serve", "start one service alone", serve_arguments, run_serve,
            process_name=lambda args: args.service, prepare=prepare_serve),
)
