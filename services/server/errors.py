"""What an error means to whoever waits on it: the gRPC status a client sees (the one table of
domain errors → status codes, `status_of`), and what a queue worker does with a turn that raised
it (`work_through_log`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from pipeline.audio import AudioFormatError
from pipeline.llm.prompts import PromptTooLongError
from pipeline.models import ModelNotFoundError
from services.server.limits import LimitExceededError
from services.store.client import REDIS_ERRORS, RedisUnavailableError
from services.store.sessions import UnknownSessionError
from services.store.turn_log import LogGap, LogMoved, TokenStreamTimeout, UnknownTurnError
from services.store.work_queue import Fenced, HandBack

log = logging.getLogger(__name__)

# Refusals: what no retry changes (the request is wrong, or names what is gone). A queue worker
# ends the turn with the reason (`rejection`) instead of retrying it.
REFUSALS: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (UnknownSessionError, grpc.StatusCode.NOT_FOUND),
    (UnknownTurnError, grpc.StatusCode.NOT_FOUND),
    (AudioFormatError, grpc.StatusCode.INVALID_ARGUMENT),
    (PromptTooLongError, grpc.StatusCode.INVALID_ARGUMENT),
    (ModelNotFoundError, grpc.StatusCode.FAILED_PRECONDITION),
    (TokenStreamTimeout, grpc.StatusCode.DEADLINE_EXCEEDED),
    (LimitExceededError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)
REJECTED: tuple[type[BaseException], ...] = tuple(kind for kind, _ in REFUSALS)

# Domain errors → the status a client sees, the first match winning: the refusals, then Redis out
# of reach past its retry deadline (the caller may try again later). Anything else is INTERNAL.
STATUS_FOR_ERROR: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    *REFUSALS,
    *((kind, grpc.StatusCode.UNAVAILABLE) for kind in REDIS_ERRORS),
)


def status_of(error: BaseException) -> grpc.StatusCode:
    """The status a client sees for `error`: a downstream call's own, the table's, else INTERNAL."""
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code()
    return next((code for kind, code in STATUS_FOR_ERROR if isinstance(error, kind)), grpc.StatusCode.INTERNAL)


def rejection(error: BaseException) -> str:
    """An error as a status would say it: "INVALID_ARGUMENT: user_text is empty"."""
    return f"{status_of(error).name}: {error}"


MAX_DETAIL_BYTES = 1_000


def clipped(detail: str) -> str:
    """A status message short enough to reach the client: it travels in a trailer, percent-encoded,
    and a client drops trailers past 8 KiB (grpc's default), status and all. A message that quoted a
    huge field ("unknown session id '…'") ended as RESOURCE_EXHAUSTED "Stream removed" (fuzzing)."""
    raw = detail.encode()
    if len(raw) <= MAX_DETAIL_BYTES:
        return detail
    return raw[:MAX_DETAIL_BYTES].decode(errors="ignore") + f"… ({len(raw)} bytes in all)"


@contextlib.asynccontextmanager
async def status_on_error(context: grpc.aio.ServicerContext, stage: str) -> AsyncIterator[None]:
    """Turn a domain error into a clear gRPC status instead of a dropped stream."""
    try:
        yield
    except (asyncio.CancelledError, grpc.aio.AbortError):
        raise
    except grpc.aio.AioRpcError as e:  # a downstream service said no: pass its word on
        await context.abort(e.code(), clipped(f"{stage}: {e.details()}"))
    except Exception as e:  # noqa: BLE001 - named by the table, the rest logged
        code = status_of(e)
        await context.abort(code, clipped(f"{stage}: {_detail(stage, e, code)}"))


def _detail(stage: str, error: Exception, code: grpc.StatusCode) -> str:
    if code == grpc.StatusCode.UNAVAILABLE:  # Redis, out of reach past the retry deadline
        log.warning("%s: %s", stage, error)
        return str(error) if isinstance(error, RedisUnavailableError) else \
            f"redis unreachable: {type(error).__name__}: {error}"
    if code == grpc.StatusCode.INTERNAL:
        log.exception("%s: internal error", stage)
        return f"internal error: {type(error).__name__}: {error}"
    return str(error)


async def work_through_log(steps: AsyncIterator, end_log: Callable[[str], Awaitable[None]]) -> None:
    """A queue worker's turn run to its end, what became of its log told to the queue: another
    holder took the log (`Fenced`: let the entry go), a gap after a Redis restart (`HandBack`:
    resume from the log), a refusal (`end_log(reason)` ends the log with its status; the entry
    is done)."""
    try:
        async for _ in steps:
            pass
    except LogMoved as e:
        raise Fenced(str(e)) from None
    except LogGap as e:
        log.warning("%s; resuming from the log", e)
        raise HandBack(str(e)) from None
    except REJECTED as e:
        await end_log(rejection(e))
