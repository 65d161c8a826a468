"""`specvox up` for a benchmark, as a user runs it, with what the benchmark needs to know of it.

Free ports (so a benchmark runs beside another stack) and a Valkey of the benchmark's own,
given to `specvox up` as its Redis URL, as the tests' stack is (tests/conftest.py): `up`'s
embedded Valkey keeps its generated password to itself, and a benchmark reads Redis too. Its
append-only file lives in a temporary directory (a benchmark's sessions do not belong in the
default one, which a running `specvox up` holds locked). A configured `redis_url` is used
instead. Started, waited for and stopped by the same code as bench e2e and the demo (services.demo).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.e2e import _free_port
from services.demo import specvox_up

SERVICES = ("gateway", "asr", "llm", "tts")


@dataclass
class Stack:
    process: subprocess.Popen
    addresses: dict[str, str]  # service name → host:port
    redis_url: str
    log: Path

    valkey_pid_file: Path | None = None  # the Valkey's own pidfile, where the benchmark started it

    def processes(self) -> dict[str, object]:
        """Each service's process (a second worker of a stage as "llm-1"…) and the Valkey's ("redis"),
        as psutil.Process, found afresh each time (a supervisor may have restarted one)."""
        import psutil

        found: dict[str, object] = {}
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
            if stage in SERVICES:
                n = sum(1 for name in found if name.split("-")[0] == stage)
                found[stage if n == 0 else f"{stage}-{n}"] = child
        if self.valkey_pid_file is not None:
            with contextlib.suppress(OSError, ValueError, psutil.NoSuchProcess):
                found["redis"] = psutil.Process(int(self.valkey_pid_file.read_text().strip()))
        return found


@contextlib.contextmanager
def running_stack(settings, log_dir: Path) -> Iterator[Stack]:
    """`specvox up` on free ports until the block ends (services.demo.specvox_up stops it)."""
    from services.redis_store import EmbeddedRedis

    ports = {name: _free_port() for name in SERVICES}
    data_dir = Path(tempfile.mkdtemp(prefix="specvox-bench-valkey-"))
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, data_dir, ignore_errors=True)
        redis_url, pid_file = settings.redis_url, None
        if not redis_url:
            valkey = cleanup.enter_context(EmbeddedRedis(data_dir=data_dir / "valkey"))
            redis_url, pid_file = valkey.url, valkey.data_dir / "valkey.pid"
        os.environ.update({f"SPECVOX_{name.upper()}_PORT": str(port) for name, port in ports.items()})
        os.environ.update(SPECVOX_REDIS_URL=redis_url, SPECVOX_REDIS__DATA_DIR=str(data_dir / "up"))
        log = log_dir / "up.log"
        with specvox_up(log) as up:
            yield Stack(up, {name: f"{settings.host}:{port}" for name, port in ports.items()}, redis_url, log,
                        pid_file)
