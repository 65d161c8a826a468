"""Limits on what one tenant (API key) may hold or ask of the gateway; each refusal is
RESOURCE_EXHAUSTED with a message naming the limit and its setting.

Per-key counts are per tenant (the keys of one tenant share them); with auth off every caller
is the one tenant "". All the counts are kept in Redis, so they hold across gateways (the
request rate by GCRA on the server's clock, open streams as leases that a dead gateway's run
out). 0 turns a limit off.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from services.server import metrics
from services.server.auth import TENANT
from services.server.interceptors import abort_refused, wrap_handler
from services.store.client import REDIS_ERRORS
from services.store.keys import session_key, session_turns_key, tenant_rate_key, tenant_sessions_key, tenant_streams_key


@dataclass(frozen=True)
class LimitOptions:
    max_streams_per_key: int = 0  # Converse streams open at once, per tenant
    max_sessions_per_key: int = 0  # sessions held at once (created, not yet expired), per tenant
    requests_per_s_per_key: float = 0.0  # gateway calls per second, per tenant (a token bucket) ...
    burst_per_key: int = 0  # ... holding this many (0: twice the rate, at least 1)
    max_utterance_s: float = 0.0  # one utterance of the user's speech (asr splits at asr.max_utterance_s)
    max_reply_tokens: int = 0  # the most a session may ask for (SessionConfig.max_reply_tokens)
    max_turns_per_session: int = 0  # the conversation's length in turns, across its streams
    max_queued_events: int = 1000  # events waiting for a slow client on one stream
    stream_lease_s: float = 30.0  # a stream's slot lasts this long, renewed every third of it (a dead gateway's lapses)


class LimitExceededError(Exception):
    """A limit was reached: RESOURCE_EXHAUSTED (services/server/errors.py)."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit
        metrics.limited(limit)


# GCRA, the generic cell rate algorithm (ITU-T I.371; Redis's redis-cell module does the same):
# one number per tenant, the theoretical arrival time (TAT) of its next call. A call at `now` is
# allowed when max(TAT, now) + T - now <= burst * T, with T = 1 / rate; it moves TAT on by T.
# The server's clock (TIME) is the one clock, so gateways on several machines share the bucket.
_RATE = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local interval, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local tat = math.max(tonumber(redis.call('GET', KEYS[1]) or now), now) + interval
if tat - now > burst * interval then return 0 end
redis.call('SET', KEYS[1], tat, 'PX', math.ceil(tat - now))
return 1
"""

# The tenant's open streams: a sorted set of stream ids scored by the end of their lease. Leases
# run out (a gateway that died holds nothing past `stream_lease_s`) and are renewed while a stream
# lives. Counting and adding are one script, so concurrent opens never overshoot.
_OPEN_STREAM = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local held = redis.call('ZCARD', KEYS[1])
if held >= tonumber(ARGV[1]) then return held end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return -1
"""
_RENEW_STREAM = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 0
"""


class TenantLimits:
    """The gateway's per-tenant request rate and concurrent streams, counted in Redis so that they hold
    across every gateway of the cluster; what each transport (the gRPC interceptor below, the HTTP
    middleware in services/gateway/web.py) admits a call through."""

    def __init__(self, options: LimitOptions, redis: Any) -> None:
        self.options = options
        self.redis = redis
        self._burst = options.burst_per_key or max(1, int(2 * options.requests_per_s_per_key))
        self._rate = redis.register_script(_RATE)
        self._open = redis.register_script(_OPEN_STREAM)
        self._renew = redis.register_script(_RENEW_STREAM)

    async def check_rate(self, tenant: str) -> None:
        """LimitExceededError past the tenant's rate; a Redis error where it cannot be counted."""
        o = self.options
        if not o.requests_per_s_per_key:
            return
        interval_ms = 1000.0 / o.requests_per_s_per_key
        if not await self._rate(keys=[tenant_rate_key(tenant)], args=[interval_ms, self._burst]):
            raise LimitExceededError("requests_per_s_per_key", f"more than {o.requests_per_s_per_key:g} requests a "
                                     "second for this key (limits.requests_per_s_per_key): slow down")

    async def open_stream(self, tenant: str) -> str | None:
        """The stream's lease id, or None when streams are not limited; LimitExceededError when all are held."""
        o = self.options
        if not o.max_streams_per_key:
            return None
        lease = uuid.uuid4().hex
        held = await self._open(keys=[tenant_streams_key(tenant)],
                                args=[o.max_streams_per_key, lease, int(o.stream_lease_s * 1000)])
        if held >= 0:
            raise LimitExceededError("max_streams_per_key", f"this key already has {held} streams open, at most "
                                     f"{o.max_streams_per_key} (limits.max_streams_per_key)")
        return lease

    @contextlib.asynccontextmanager
    async def holding(self, tenant: str, lease: str | None) -> AsyncIterator[None]:
        """While the body runs, the stream's lease is renewed; after it, the slot is freed."""
        if lease is None:
            yield
            return
        keeper = asyncio.create_task(self._keep_stream(tenant, lease))
        try:
            yield
        finally:
            keeper.cancel()
            await self._close_stream(tenant, lease)

    async def _keep_stream(self, tenant: str, lease: str) -> None:
        """Renew the lease a third of its length ahead, for as long as the stream lives."""
        lease_ms = int(self.options.stream_lease_s * 1000)
        while True:
            await asyncio.sleep(self.options.stream_lease_s / 3)
            with contextlib.suppress(*REDIS_ERRORS):  # a lapse past the lease frees a slot early, no more
                await self._renew(keys=[tenant_streams_key(tenant)], args=[lease, lease_ms])

    async def _close_stream(self, tenant: str, lease: str) -> None:
        with contextlib.suppress(*REDIS_ERRORS):  # if Redis is away the lease runs out by itself
            await self.redis.zrem(tenant_streams_key(tenant), lease)


def tenant_limits(settings: Any, redis: Any = None) -> TenantLimits | None:
    """The gateway's rate and stream limits on its Redis client (`Service.redis`); None when none is set."""
    o: LimitOptions = settings.limits
    if not (o.requests_per_s_per_key or o.max_streams_per_key):
        return None
    if redis is None:
        raise ValueError("the gateway's per-key limits need its Redis client (Service.redis)")
    return TenantLimits(o, redis)


class LimitsInterceptor(grpc.aio.ServerInterceptor):
    """`TenantLimits` on the gateway's gRPC calls (after auth: TENANT is set); a Converse stream holds a slot."""

    def __init__(self, limits: TenantLimits) -> None:
        self.limits = limits

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith("/grpc."):  # health, reflection
            return handler
        streaming = handler.request_streaming and handler.response_streaming  # Converse: it holds a slot
        return wrap_handler(handler, functools.partial(self._admitted, streaming))

    @contextlib.asynccontextmanager
    async def _admitted(self, streaming: bool, request, context) -> AsyncIterator[Any]:
        """The call goes on within the tenant's rate, a stream while it holds a slot (kept till it ends)."""
        tenant = TENANT.get()
        lease = await self._admit(request, context, tenant, streaming)
        async with self.limits.holding(tenant, lease):
            yield request

    async def _admit(self, request, context, tenant: str, stream: bool) -> str | None:
        """The stream's lease id (None: not a limited stream); a call over a limit is refused."""
        try:
            await self.limits.check_rate(tenant)
            return await self.limits.open_stream(tenant) if stream else None
        except LimitExceededError as e:
            await abort_refused(request, context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"gateway: {e}")
        except REDIS_ERRORS as e:
            await abort_refused(request, context, grpc.StatusCode.UNAVAILABLE,
                                f"gateway: the per-key limits cannot be checked: {e}")
        return None


def interceptors(settings: Any, service: str, redis: Any = None) -> list[grpc.aio.ServerInterceptor]:
    """The gateway's rate and stream limits, on its Redis client (`Service.redis`)."""
    limits = tenant_limits(settings, redis) if service == "gateway" else None
    return [LimitsInterceptor(limits)] if limits is not None else []


async def hold_session(redis: Any, options: LimitOptions, tenant: str, session_id: str, ttl_s: int) -> None:
    """Count a session just created against its tenant (a sorted set scored by expiry); past the
    limit it is taken back and deleted (nobody has its id yet). Adding and counting in one MULTI
    means concurrent creations never overshoot (they may both be refused)."""
    if not options.max_sessions_per_key:
        return
    key, now = tenant_sessions_key(tenant), time.time()
    async with redis.pipeline(transaction=True) as pipe:
        pipe.zremrangebyscore(key, "-inf", now)
        pipe.zadd(key, {session_id: now + ttl_s})
        pipe.expire(key, ttl_s)
        pipe.zcard(key)
        *_, held = await pipe.execute()
    if held > options.max_sessions_per_key:
        async with redis.pipeline(transaction=False) as pipe:
            pipe.zrem(key, session_id)
            pipe.delete(session_key(session_id))
            await pipe.execute()
        raise LimitExceededError("max_sessions_per_key", f"this key holds {held - 1} sessions, at most "
                                 f"{options.max_sessions_per_key} (limits.max_sessions_per_key): reuse one, or "
                                 "let one expire")


async def release_session(redis: Any, options: LimitOptions, tenant: str, session_id: str) -> None:
    """A session deleted before its expiry (one an HTTP request made for itself) no longer counts."""
    if options.max_sessions_per_key:
        await redis.zrem(tenant_sessions_key(tenant), session_id)


async def renew_session(redis: Any, options: LimitOptions, tenant: str, session_id: str, ttl_s: int) -> None:
    """A session in use is still held: its expiry in the count moves with the session's own."""
    if options.max_sessions_per_key:
        async with redis.pipeline(transaction=False) as pipe:
            pipe.zadd(tenant_sessions_key(tenant), {session_id: time.time() + ttl_s}, xx=True)
            pipe.expire(tenant_sessions_key(tenant), ttl_s)
            await pipe.execute()


async def count_turn(redis: Any, options: LimitOptions, session_id: str, ttl_s: int) -> None:
    """One more turn of the session's conversation, refused past `max_turns_per_session`."""
    if not options.max_turns_per_session:
        return
    key = session_turns_key(session_id)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.incr(key)
        pipe.expire(key, ttl_s)
        turns, _ = await pipe.execute()
    if turns > options.max_turns_per_session:
        raise LimitExceededError("max_turns_per_session", f"the conversation reached {options.max_turns_per_session} "
                                 "turns (limits.max_turns_per_session): start a new session")


def check_reply_tokens(options: LimitOptions, asked: int) -> None:
    if options.max_reply_tokens and asked > options.max_reply_tokens:
        raise LimitExceededError("max_reply_tokens", f"max_reply_tokens {asked} is over this service's "
                                 f"{options.max_reply_tokens} (limits.max_reply_tokens)")


def check_utterance(options: LimitOptions, speech_start_s: float, speech_end_s: float) -> None:
    if options.max_utterance_s and speech_end_s - speech_start_s > options.max_utterance_s:
        raise LimitExceededError("max_utterance_s", f"an utterance of {speech_end_s - speech_start_s:.1f} s is "
                                 f"longer than {options.max_utterance_s:g} s (limits.max_utterance_s)")


class EventQueue(asyncio.Queue):
    """A stream's outgoing events, at most `limit` waiting (0: no limit): past it new events are
    dropped, `overflowed` is set and `on_overflow` runs once (the stream then ends
    RESOURCE_EXHAUSTED), so a client that stops reading cannot grow the server's memory.
    Exceptions and the end marker always go in."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.overflowed = False
        self.on_overflow: Callable[[], Any] | None = None

    def put_nowait(self, item: Any) -> None:
        if self.limit and self.qsize() >= self.limit and not (isinstance(item, BaseException) or type(item) is object):
            if not self.overflowed:
                self.overflowed = True
                if self.on_overflow is not None:
                    self.on_overflow()
            return
        super().put_nowait(item)

    def failure(self) -> LimitExceededError | None:
        """The error the stream ends with, once it overflowed (services/gateway/ports.EventSink)."""
        return self.error() if self.overflowed else None

    def error(self) -> LimitExceededError:
        return LimitExceededError("max_queued_events", f"the client fell more than {self.limit} events behind "
                                  "(limits.max_queued_events): read the stream as fast as it comes")
