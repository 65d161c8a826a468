"""Starting a whole stack as a user does, `specvox up` in a subprocess: the demo's, the benchmarks'
and the tests' one way to run it; and the one free-port helper.

`running_stack` starts `python -m services.cli up` on a block of free ports (so that it runs beside
another stack), its output in LOG_DIR/up.log, waits for its "all services ready" line (progress on
the way), yields a `Stack`, and at the end sends Ctrl-C (SIGINT: `up` drains every service), then
SIGKILL past a timeout. A SIGTERM to this process meanwhile ends the block as Ctrl-C does, so that
the stack is not left running without its parent.

Ports: `free_ports(span)` hands out `span` consecutive free loopback ports, picked by the kernel
unless `use_port_block` named a block to take them from (tests/conftest.py: one per xdist worker).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STAGES = ("gateway", "asr", "llm", "tts")
# Worker i of a stage listens on the stage's port + i * supervisor.worker_port_stride (100): a block
# of 400 holds 4 stages x up to 4 workers.
PORT_SPAN = 400
READY_LINE = "all services ready"
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0  # Ctrl-C drains every service (their drain grace, 10 s by default), then SIGKILL
PROGRESS_EVERY_S = 10.0
LAST_PORT = 65_535


# ---- free ports ------------------------------------------------------------------------------

def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class PortBlock:
    """Ports handed out in order from a range: each span bindable, none handed out twice."""

    def __init__(self, ports: range) -> None:
        self.ports = ports
        self.next = ports.start

    def take(self, span: int) -> int:
        while self.next + span <= self.ports.stop:
            first, self.next = self.next, self.next + span
            if all(_bindable(port) for port in range(first, first + span)):
                return first
        raise RuntimeError(f"the ports {self.ports.start}-{self.ports.stop - 1} are used up")


_block: PortBlock | None = None


def use_port_block(ports: range) -> None:
    """From now on this process takes its free ports from `ports` instead of the kernel's."""
    global _block
    _block = PortBlock(ports)


def free_ports(span: int = 1) -> int:
    """The first of `span` consecutive loopback ports that are free now."""
    if _block is not None:
        return _block.take(span)
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = int(s.getsockname()[1])
        if first + span - 1 <= LAST_PORT and all(_bindable(port) for port in range(first + 1, first + span)):
            return first
    raise RuntimeError(f"found no {span} consecutive free ports")


def free_port() -> int:
    return free_ports(1)


# ---- the stack -------------------------------------------------------------------------------

class StackDidNotStart(RuntimeError):
    """`specvox up` exited, or did not say it was ready in time; the message ends with its log's tail."""


@dataclass
class Stack:
    process: subprocess.Popen
    log: Path
    addresses: dict[str, str]  # stage -> host:port
    redis_url: str = ""  # the Redis it was given ("": `up` runs an embedded Valkey of its own)
    valkey_pid_file: Path | None = None  # the Valkey's pidfile, where the stack's Valkey was started here
    http: str = ""  # host:port of the gateway's HTTP surface (the OpenAI endpoints, the Realtime API)
    killed: bool = False  # it had not stopped STOP_TIMEOUT_S after Ctrl-C

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def processes(self) -> dict[str, Any]:
        """Each service's process (a second worker of a stage as "llm-1"…) and the Valkey's ("redis"),
        as psutil.Process, found afresh each time (the supervisor may have restarted one)."""
        import psutil

        found: dict[str, Any] = {}
        try:
            children = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        for child in sorted(children, key=lambda c: c.pid):
            try:
                cmdline = child.cmdline()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            stage = cmdline[cmdline.index("serve") + 1] if "serve" in cmdline[:-1] else ""
            if stage in STAGES:
                n = sum(1 for name in found if name.split("-")[0] == stage)
                found[stage if n == 0 else f"{stage}-{n}"] = child
        if self.valkey_pid_file is not None:
            with contextlib.suppress(OSError, ValueError, psutil.NoSuchProcess):
                found["redis"] = psutil.Process(int(self.valkey_pid_file.read_text().strip()))
        return found


@contextlib.contextmanager
def running_stack(log_dir: Path, *, args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                  redis: str | AbstractContextManager = "", host: str = "127.0.0.1", cwd: Path | None = None,
                  start_timeout_s: float = START_TIMEOUT_S,
                  stop_timeout_s: float = STOP_TIMEOUT_S) -> Iterator[Stack]:
    """`specvox up ARGS` on free ports, this process's environment plus `env`, from ready until the
    block ends. `redis`: "" for `up`'s own embedded Valkey (its password stays inside it); a URL; or
    an EmbeddedRedis not yet started, started here for the stack and stopped after it, for a caller
    that reads Redis too (its process is then among `Stack.processes()`)."""
    first = free_ports(PORT_SPAN)
    ports = {name: first + i for i, name in enumerate((*STAGES, "http"))}  # http: the gateway's HTTP surface
    log = Path(log_dir) / "up.log"
    with contextlib.ExitStack() as cleanup:
        if isinstance(redis, str):
            redis_url, valkey_pid_file = redis, None
        else:
            valkey = cleanup.enter_context(redis)
            redis_url, valkey_pid_file = valkey.url, Path(valkey.data_dir) / "valkey.pid"
        environ = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        environ.update({f"SPECVOX_{name.upper()}_PORT": str(port) for name, port in ports.items()})
        if redis_url:
            environ["SPECVOX_REDIS_URL"] = redis_url
        print(f"starting {_command(args)} (log: {log}) …", flush=True)
        with open(log, "wb") as out:
            process = subprocess.Popen([sys.executable, "-m", "services.cli", "up", *args], cwd=cwd, env=environ,
                                       stdout=out, stderr=subprocess.STDOUT)
        stack = Stack(process, log, {name: f"{host}:{ports[name]}" for name in STAGES}, redis_url,
                      valkey_pid_file, http=f"{host}:{ports['http']}")
        try:
            with _terminate_as_interrupt():
                _wait_ready(stack, args, start_timeout_s)
                yield stack
        finally:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(stop_timeout_s)
            except subprocess.TimeoutExpired:
                stack.killed = True
                process.kill()
                process.wait()


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt, as Ctrl-C does, so `finally` blocks run (in the main
    thread only, where Python delivers signals; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    before = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _command(args: Sequence[str]) -> str:
    return " ".join(["specvox up", *args])


def _wait_ready(stack: Stack, args: Sequence[str], timeout_s: float) -> None:
    """Until the log says every service is ready; the time so far on one line rewritten on a
    terminal, a line every PROGRESS_EVERY_S otherwise (a log file)."""
    started, said = time.monotonic(), 0.0
    on_terminal = sys.stdout.isatty()
    while READY_LINE not in stack.log.read_text(errors="replace"):
        elapsed = time.monotonic() - started
        if stack.process.poll() is not None or elapsed > timeout_s:
            tail = stack.log.read_text(errors="replace")[-3000:]
            why = f"exited with code {stack.process.returncode}" if stack.process.returncode is not None else \
                f"was not ready within {timeout_s:.0f} s"
            raise StackDidNotStart(f"{_command(args)} {why}:\n{tail}")
        if on_terminal:
            print(f"\r  loading models … {elapsed:4.0f} s", end="", flush=True)
        elif elapsed - said >= PROGRESS_EVERY_S:
            said = elapsed
            print(f"  loading models … {elapsed:.0f} s", flush=True)
        time.sleep(0.5)
    print(f"{chr(13) if on_terminal else ''}  specvox up ready after {time.monotonic() - started:.0f} s",
          flush=True)
