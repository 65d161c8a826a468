"""The Redis client every process uses: made by `connect`, it rides out a lost Redis with backoff
until a deadline, then fails with RedisUnavailableError (clients see gRPC UNAVAILABLE); what a
call raises when Redis is down (REDIS_ERRORS); and the clock written into Redis (now_ms).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import AbstractBackoff, EqualJitterBackoff
from redis.exceptions import AuthenticationError, BusyLoadingError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError


def now_ms() -> int:
    """Unix time in ms: the timestamps written to Redis and carried in messages."""
    return int(time.time() * 1000)


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
# Redis is down: what a call raises when Redis is out of reach (RedisUnavailableError after a retry
# deadline). redis-py turns the socket's own errors (OSError, ssl errors, asyncio timeouts) into
# these, so OSError is not in it: it would take a TimeoutError of the code's own (TokenStreamTimeout)
# for a Redis fault.
REDIS_ERRORS: tuple[type[Exception], ...] = (RedisConnectionError, RedisTimeoutError)


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
        url, decode_responses=True, retry=DeadlineRetry(backoff, options.retry_deadline_s, masked_url(url)),
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


def masked_url(url: str) -> str:
    """The URL to print or log: its password masked."""
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


async def wait_for_redis(client: aioredis.Redis, timeout_s: float = 30.0) -> None:
    """At start a service waits for Redis longer than one call's retry deadline (compose starts
    them together); each PING already retries with backoff."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await client.ping()
            return
        except REDIS_ERRORS:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)
