"""`specvox up`'s process supervisor: one process per worker, restarted when it crashes.

A child that exits while the stack runs is restarted after a backoff that doubles with each
exit inside `restart_window_s` (0.5, 1, 2, 4 ... capped at `restart_backoff_max_s`); the other
children keep running. One that exits more than `max_restarts` times within the window is
crash-looping: the supervisor says so and stops the whole stack (exit 1), since a stack without
that stage cannot serve a turn. SIGTERM or SIGINT drains: SIGTERM to every child, up to the
children's drain grace (plus `stop_margin_s` for their close hooks), then SIGKILL.

The backoff is the few lines of `restart_delay_s` rather than a library's: tenacity's wait
functions take a RetryCallState from its own retry loop, which a supervisor polling child
processes does not run, and jitter (what a library would add) spreads many clients' retries
against one server, not one supervisor's restarts of its own children.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

STAGES = ("asr", "llm", "tts", "gateway")
MAX_WORKERS = 64  # more than this per stage on one machine is a typo, not a plan


@dataclass(frozen=True)
class SupervisorOptions:
    """How `specvox up` restarts its children (settings: supervisor.*)."""

    restart_backoff_s: float = 0.5  # the wait before the first restart; doubled for each further exit in the window
    restart_backoff_max_s: float = 30.0
    max_restarts: int = 5  # restarts allowed within restart_window_s; one exit more is a crash loop
    restart_window_s: float = 60.0
    stop_margin_s: float = 5.0  # past drain_grace_s, for a child's close hooks, before SIGKILL
    start_timeout_s: float = 300.0  # every child healthy within this, or the stack stops
    # Worker i of a stage listens on the stage's port + i * worker_port_stride (and so does its
    # metrics port): the same address across its restarts.
    worker_port_stride: int = 100


def parse_workers(text: str, stages: Iterable[str] = STAGES) -> dict[str, int]:
    """`llm=2,tts=2` -> {"llm": 2, "tts": 2}; a clear ValueError for anything else."""
    stages = tuple(stages)
    counts: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        stage, sep, count = (s.strip() for s in part.partition("="))
        if not sep:
            raise ValueError(f"{part!r}: expected STAGE=COUNT, e.g. llm=2")
        if stage not in stages:
            raise ValueError(f"{stage!r} is not a stage here; the stages are {', '.join(stages)}")
        if stage in counts:
            raise ValueError(f"{stage} is given twice")
        try:
            n = int(count)
        except ValueError:
            raise ValueError(f"{stage}={count!r}: the count must be a whole number") from None
        if not 1 <= n <= MAX_WORKERS:
            raise ValueError(f"{stage}={n}: the count must be between 1 and {MAX_WORKERS}")
        counts[stage] = n
    if not counts:
        raise ValueError("no STAGE=COUNT given, e.g. llm=2,tts=2")
    return counts


def restart_delay_s(exits_in_window: int, options: SupervisorOptions) -> float:
    """Exponential backoff: the first exit in the window waits restart_backoff_s, each further one twice as long."""
    return min(options.restart_backoff_max_s, options.restart_backoff_s * 2 ** max(0, exits_in_window - 1))


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


@dataclass
class Child:
    """One supervised worker: its command, its environment, the address its health answers on."""

    name: str  # llm-0, llm-1, ...
    argv: list[str]
    env: dict[str, str]
    address: str
    process: subprocess.Popen | None = None
    exits: deque[float] = field(default_factory=deque)  # monotonic times of its exits in the window
    restart_at: float | None = None
    ready: bool = False

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None


class Supervisor:
    """Starts the children, restarts crashed ones, drains them all on SIGTERM/SIGINT or a give-up."""

    def __init__(self, options: SupervisorOptions, drain_grace_s: float, health: Callable[[str], bool],
                 on_ready: Callable[[list[Child]], None] | None = None) -> None:
        self.children: list[Child] = []
        self.options = options
        self.drain_grace_s = drain_grace_s
        self.health = health  # address -> SERVING?
        self.on_ready = on_ready
        self._stop = threading.Event()
        self._signal: str = ""

    def request_stop(self, signum: int = 0, _frame: object = None) -> None:
        self._signal = signal.Signals(signum).name if signum else "stop"
        self._stop.set()

    def catch_signals(self) -> None:
        """SIGTERM and SIGINT drain from here on (call it before starting what must be stopped)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.request_stop)

    def run(self, children: list[Child]) -> int:
        """0 when stopped by a signal; 1 when a child crash-looped or the stack never became ready."""
        self.children = children
        self.catch_signals()
        try:
            for child in self.children:
                self._start(child)
            return self._supervise()
        finally:
            self._stop_all()

    def _supervise(self) -> int:
        started, announced = time.monotonic(), False
        while not self._stop.is_set():
            now = time.monotonic()
            for child in self.children:
                if child.process and child.process.poll() is not None:
                    if not self._exited(child, now):
                        return 1
                if child.process is None and child.restart_at is not None and now >= child.restart_at:
                    self._start(child, restart=True)
                if child.process and not child.ready and self.health(child.address):
                    child.ready = True
                    if announced:
                        _say(f"{child.name} ready again (pid {child.pid}) on {child.address}")
            if not announced:
                if all(c.ready for c in self.children):
                    announced = True
                    if self.on_ready:
                        self.on_ready(self.children)
                elif now - started > self.options.start_timeout_s:
                    late = ", ".join(c.name for c in self.children if not c.ready)
                    _say(f"not ready after {self.options.start_timeout_s:.0f} s: {late}", error=True)
                    return 1
            self._stop.wait(0.1)
        _say(f"{self._signal}: draining the stack")
        return 0

    def _exited(self, child: Child, now: float) -> bool:
        """Schedule a crashed child's restart; False when it crash-loops (the stack must stop)."""
        assert child.process is not None
        how, pid = describe_exit(child.process.returncode), child.pid
        child.process, child.ready = None, False
        if self._stop.is_set():  # Ctrl-C reached it with us: stopping, not crashing
            return True
        while child.exits and now - child.exits[0] > self.options.restart_window_s:
            child.exits.popleft()
        child.exits.append(now)
        window = self.options.restart_window_s
        if len(child.exits) > self.options.max_restarts:
            _say(f"{child.name} (pid {pid}) {how}; it exited {len(child.exits)} times within {window:.0f} s "
                 f"(supervisor.max_restarts={self.options.max_restarts}): crash loop, giving up and stopping "
                 "the stack", error=True)
            return False
        delay = restart_delay_s(len(child.exits), self.options)
        child.restart_at = now + delay
        _say(f"{child.name} (pid {pid}) {how}; restarting it in {delay:.1f} s "
             f"(exit {len(child.exits)} of {self.options.max_restarts + 1} allowed within {window:.0f} s)",
             error=True)
        return True

    def _start(self, child: Child, restart: bool = False) -> None:
        child.process = subprocess.Popen(child.argv, env=child.env)
        child.restart_at = None
        _say(f"{'restarted' if restart else 'started'} {child.name} (pid {child.pid}) for {child.address}")

    def _stop_all(self) -> None:
        live = [c for c in self.children if c.process and c.process.poll() is None]
        for child in live:
            child.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        deadline = time.monotonic() + self.drain_grace_s + self.options.stop_margin_s
        for child in live:
            assert child.process is not None
            try:
                child.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _say(f"{child.name} (pid {child.pid}) did not stop within {self.drain_grace_s:.0f} s of draining "
                     f"(+{self.options.stop_margin_s:.0f} s); killing it", error=True)
                child.process.kill()
                child.process.wait()


def plan_children(stages: Iterable[str], workers: dict[str, int], base_env: dict[str, str],
                  pythons: dict[str, str], ports: dict[str, int], host: str, metrics_port: int,
                  options: SupervisorOptions, http_port: int = 0) -> list[Child]:
    """The children of a stack: `workers[stage]` processes of each stage (1 by default), each
    with its stable name (SPECVOX_WORKER_NAME), its own port and, where metrics are on, its own
    metrics port (the gateway's metrics_port, asr +1, llm +2, tts +3; worker i + i * stride), and each
    gateway its own HTTP port (http_port + i * stride, where it is on)."""
    metrics_offset = {"gateway": 0, "asr": 1, "llm": 2, "tts": 3}
    children = []
    for stage in stages:
        for i in range(workers.get(stage, 1)):
            port = ports[stage] + i * options.worker_port_stride
            env = dict(base_env, SPECVOX_WORKER_NAME=f"{stage}-{i}", **{f"SPECVOX_{stage.upper()}_PORT": str(port)})
            if metrics_port:
                env["SPECVOX_METRICS_PORT"] = str(metrics_port + metrics_offset[stage] + i * options.worker_port_stride)
            if stage == "gateway" and http_port:
                env["SPECVOX_HTTP_PORT"] = str(http_port + i * options.worker_port_stride)
            children.append(Child(f"{stage}-{i}", [pythons[stage], "-m", "services.cli", "serve", stage], env,
                                  f"{host}:{port}"))
    return children


def _say(message: str, error: bool = False) -> None:
    print(f"specvox: {message}", file=sys.stderr if error else sys.stdout, flush=True)


def health_probe(settings) -> Callable[[str], bool]:
    """address -> whether its grpc.health.v1 says SERVING (over the stack's TLS, with its credential)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.channels import open_sync_channel
    from services.server import auth

    def serving(address: str) -> bool:
        with open_sync_channel(address, secret=auth.service_token(settings.auth), tls=settings.tls) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=0.5)
            except grpc.RpcError:
                return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    return serving
