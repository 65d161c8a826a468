"""The per-key limits with their Redis away: every call is refused UNAVAILABLE, naming why, streaming
calls included (whose refusal a client could read as INTERNAL, grpc/grpc#36066), and the server
keeps answering. Redis is away for real: the client dials a loopback port nothing listens on."""

from __future__ import annotations

import grpc
import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from services.server.limits import LimitOptions, LimitsInterceptor, TenantLimits
from services.stack import free_port
from tests.grpc_status import expect_status

ECHO = "/specvox.test.Echo/"


async def _once(request, context):
    return request


async def _chat(requests, context):
    async for request in requests:
        yield request


ECHO_HANDLERS = grpc.method_handlers_generic_handler("specvox.test.Echo", {
    "Once": grpc.unary_unary_rpc_method_handler(_once),
    "Chat": grpc.stream_stream_rpc_method_handler(_chat),
})


@pytest.fixture
async def limited_server():
    nothing_there = free_port()
    # no retries: the service's own client retries with backoff first (services/store/client.py), which
    # only delays the same refusal
    redis = aioredis.Redis(host="127.0.0.1", port=nothing_there, socket_connect_timeout=1.0,
                           retry=Retry(NoBackoff(), 0))
    limits = LimitOptions(max_streams_per_key=2, requests_per_s_per_key=100.0)
    server = grpc.aio.server(interceptors=[LimitsInterceptor(TenantLimits(limits, redis))])
    server.add_generic_rpc_handlers([ECHO_HANDLERS])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)
        await redis.aclose()


async def test_calls_are_refused_unavailable_while_the_limits_cannot_be_checked(limited_server):
    async with grpc.aio.insecure_channel(limited_server) as channel:
        once = channel.unary_unary(ECHO + "Once")
        chat = channel.stream_stream(ECHO + "Chat")
        for _ in range(3):  # again and again: the server stays up and answers each the same way
            await expect_status(grpc.StatusCode.UNAVAILABLE, "per-key limits cannot be checked",
                                once(b"hello", timeout=10))
            await expect_status(grpc.StatusCode.UNAVAILABLE, "per-key limits cannot be checked",
                                chat(iter([b"one", b"two"]), timeout=10))
