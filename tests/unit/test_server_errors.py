"""The one error table (what a client sees for each error) and the one interceptor wrapper (a hook
around each call, whatever the method's kind), without a server."""

from __future__ import annotations

import contextlib

import grpc
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.server.errors import REJECTED, rejection, status_of
from services.server.interceptors import wrap_handler
from services.server.limits import LimitExceededError
from services.store.client import RedisUnavailableError
from services.store.sessions import UnknownSessionError
from services.store.turn_log import TokenStreamTimeout


@pytest.mark.parametrize(("error", "code"), [
    (UnknownSessionError("no session 'x'"), grpc.StatusCode.NOT_FOUND),
    (ValueError("user_text is empty"), grpc.StatusCode.INVALID_ARGUMENT),
    (TokenStreamTimeout("no token in 5 s"), grpc.StatusCode.DEADLINE_EXCEEDED),  # a TimeoutError, not Redis's
    (RedisUnavailableError("redis unreachable"), grpc.StatusCode.UNAVAILABLE),
    (RedisConnectionError("refused"), grpc.StatusCode.UNAVAILABLE),
    (RedisTimeoutError("slow"), grpc.StatusCode.UNAVAILABLE),
    (KeyError("a bug"), grpc.StatusCode.INTERNAL),
])
def test_each_error_has_one_status(error, code):
    assert status_of(error) == code
    assert rejection(error) == f"{code.name}: {error}"


def test_a_queue_worker_refuses_what_no_retry_changes_and_retries_a_lost_redis():
    assert isinstance(LimitExceededError("max_turns_per_session", "too many"), REJECTED)
    assert isinstance(TokenStreamTimeout("quiet"), REJECTED)
    assert not isinstance(RedisUnavailableError("down"), REJECTED)


class Aborted(Exception):
    pass


class Context:
    async def abort(self, code, details):
        raise Aborted(f"{code.name}: {details}")


def recording(seen: list[str], refuse: bool = False):
    @contextlib.asynccontextmanager
    async def around(request, context):
        seen.append(f"enter {request}")
        if refuse:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "no")
        try:
            yield f"{request}+"
            seen.append("exit")
        except BaseException as e:
            seen.append(f"exit {type(e).__name__}")
            raise
    return around


async def test_the_hook_wraps_a_coroutine_and_hands_it_the_request_it_yields():
    seen: list[str] = []

    async def behaviour(request, context):
        seen.append(f"ran {request}")
        return "answer"

    handler = wrap_handler(grpc.unary_unary_rpc_method_handler(behaviour), recording(seen))
    assert await handler.unary_unary("q", Context()) == "answer"
    assert seen == ["enter q", "ran q+", "exit"]


async def test_the_hook_is_left_before_the_response_stream_is_closed():
    seen: list[str] = []

    async def behaviour(request, context):
        try:
            yield 1
            yield 2
        finally:
            seen.append("responses closed")

    handler = wrap_handler(grpc.unary_stream_rpc_method_handler(behaviour), recording(seen))
    responses = handler.unary_stream("q", Context())
    assert await responses.__anext__() == 1
    await responses.aclose()  # as grpc does when the client goes away
    assert seen == ["enter q", "exit GeneratorExit", "responses closed"]


async def test_a_hook_that_aborts_on_entry_runs_no_behaviour():
    seen: list[str] = []

    async def behaviour(request, context):
        seen.append("ran")
        yield 1

    handler = wrap_handler(grpc.unary_stream_rpc_method_handler(behaviour), recording(seen, refuse=True))
    with pytest.raises(Aborted, match="UNAUTHENTICATED: no"):
        await handler.unary_stream("q", Context()).__anext__()
    assert seen == ["enter q"]
