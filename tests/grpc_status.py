"""The status a gRPC call ends with, read one way by every test: a unary call is awaited, a
server stream read to its end, and the error it raises is what the server answered."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest


async def run_to_end(call: Any) -> None:
    """Await `call` or read it to its end: a gRPC call of any kind, a coroutine, an async iterator."""
    if hasattr(call, "__aiter__"):
        async for _ in call:
            pass
    else:
        await call


async def status_code(call: Any) -> grpc.StatusCode:
    """The code `call` ends with: OK, or its error's."""
    try:
        await run_to_end(call)
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


async def refusal(call: Any) -> grpc.aio.AioRpcError:
    """The error `call` ends with; the test fails if it ends OK."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await run_to_end(call)
    return caught.value


def _assert_status(expected: grpc.StatusCode, fragment: str, code: grpc.StatusCode, details: str | None) -> str:
    assert code == expected, (code, details)
    assert fragment in (details or ""), (code, details)
    return details or ""


async def expect_status(code: grpc.StatusCode, fragment: str, call: Any) -> str:
    """`call` ends with `code` and details that contain `fragment` ("" for any); returns the details."""
    error = await refusal(call)
    return _assert_status(code, fragment, error.code(), error.details())


async def expect_stream_status(code: grpc.StatusCode, fragment: str, call: Any, messages: list) -> str:
    """A bidirectional `call` sent `messages` ends with `code` and details that contain `fragment`.

    The first message goes alone, and the rest after the server's first answer (READY, or its error).
    The message the server rejects must be the last: a write after the server has ended the call
    fails in the client's own core, which then reports INTERNAL instead of the server's status."""
    try:
        await call.write(messages[0])
        if len(messages) > 1:
            await call.read()
            for message in messages[1:]:
                await call.write(message)
        await call.done_writing()
        while await call.read() is not grpc.aio.EOF:
            pass
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        pass  # the status below is what the server said
    return _assert_status(code, fragment, await call.code(), await call.details())
