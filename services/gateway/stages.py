"""The conversation's ports onto the stages: the asr stream over gRPC, and a turn's llm and tts work
through their Redis work queues (any worker may take it), read back from the turn's token log and
speech stream, each item once, whichever worker wrote it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
from google.protobuf import json_format

from pipeline.llm.prompts import Exchange
from services.gateway.convert import asr_pb, common, llm_pb, tts_pb
from services.gateway.ports import AsrStreamClosed, ReplyPiece, SpeechEnd, TurnFailed
from services.server import limits, tracing
from services.server.errors import rejection
from services.settings import Settings
from services.store.client import REDIS_ERRORS, now_ms
from services.store.context import RedisContext
from services.store.turn_log import (
    TokenEntry,
    TokenStreamTimeout,
    TokenStreamWriter,
    read_speech_stream,
    read_token_stream,
)
from services.store.work_queue import WorkQueue, turn_work

log = logging.getLogger(__name__)
PREPARE_TIMEOUT_S = 5.0  # llm's prefill of a session's conversation at its start (a stream's close waits for it)


class GrpcAsrStream:
    """asr's Transcribe stream for one conversation: its config first, then audio and context
    updates, one write at a time (a gRPC stream takes no concurrent writes)."""

    def __init__(self, stub: Any, session_id: str, language: str, audio_format: Any, **asked: Any) -> None:
        """`asked`: what the stream asks of the asr's options (StreamConfig's max_utterance_s,
        context_pause_ms, vad_threshold, vad_gain_db; none: the service's)."""
        self._stub = stub
        self._first = asr_pb.TranscribeRequest(config=asr_pb.StreamConfig(
            session_id=session_id, language=language, format=audio_format, **asked))
        self._call_made: Any = None
        self._sent_config = False
        self._writes = asyncio.Lock()

    @property
    def _call(self) -> Any:
        if self._call_made is None:
            self._call_made = self._stub.Transcribe()
        return self._call_made

    async def _write(self, request: Any | None) -> None:
        async with self._writes:
            if not self._sent_config:
                self._sent_config = True
                await self._call.write(self._first)
            if request is None:
                await self._call.done_writing()
            else:
                await self._call.write(request)

    async def send_audio(self, chunk: bytes) -> None:
        try:
            await self._write(asr_pb.TranscribeRequest(audio=chunk))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:  # the call has ended
            raise AsrStreamClosed(str(e)) from e

    async def expect_phrases(self, phrases: tuple[str, ...]) -> None:
        with contextlib.suppress(asyncio.InvalidStateError, grpc.aio.AioRpcError):  # the call has ended
            await self._write(asr_pb.TranscribeRequest(context=asr_pb.Context(expected_phrases=phrases)))

    async def finish(self) -> None:
        try:
            await self._write(None)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
            raise AsrStreamClosed(str(e)) from e

    def cancel(self) -> None:
        self._call.cancel()

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._call.__aiter__()


@contextlib.contextmanager
def _turn_failures() -> Iterator[None]:
    """A stalled log or the store out of reach fails the turn, named by the status a client would see."""
    try:
        yield
    except (TokenStreamTimeout, *REDIS_ERRORS) as e:
        raise TurnFailed(rejection(e)) from e


class StageTurnRunner:
    """One session's turns through Redis (records, work queues, logs, history) and llm's side calls."""

    def __init__(self, settings: Settings, redis: RedisContext, queues: dict[str, WorkQueue], llm: Any,
                 session_id: str, config: Any) -> None:
        self.settings, self.redis, self.queues, self.llm = settings, redis, queues, llm
        self.session_id, self.config = session_id, config

    async def open(self, turn_id: str) -> None:
        """The session's turn count (past its limit: LimitExceededError), the turn's record (llm and
        tts check it), the session's expiry pushed ahead."""
        await limits.count_turn(self.redis.client, self.settings.limits, self.session_id, self.settings.session_ttl_s)
        await self.redis.turns.create(self.session_id, turn_id)
        await self.redis.sessions.touch(self.session_id)

    async def start_reply(self, turn_id: str, request: Any) -> None:
        await self._enqueue("llm", turn_id, request)

    async def start_speech(self, turn_id: str, request: Any) -> None:
        await self._enqueue("tts", turn_id, request)

    async def _enqueue(self, stage: str, turn_id: str, request: Any) -> None:
        """Hand a stage the turn's work, with the turn's trace context (its span is the work's parent)."""
        with _turn_failures():
            await self.queues[stage].add(turn_work(turn_id, request, **tracing.carrier()))

    async def reply(self, turn_id: str) -> AsyncIterator[ReplyPiece]:
        with _turn_failures():
            async for entry in read_token_stream(self.redis.client, turn_id, self.settings.token_timeout_s):
                times = None
                if entry.end and "times" in entry.extra:
                    times = json_format.Parse(entry.extra["times"], common.StageTimes())
                yield ReplyPiece(entry.text, entry.accepted, first=entry.seq == 0,
                                 cached_tokens=int(entry.extra.get("cached", 0)), end=entry.end,
                                 finish_reason=entry.finish_reason, times=times, error=entry.extra.get("error", ""))

    async def speech(self, turn_id: str) -> AsyncIterator[Any]:
        """It may wait for the whole reply's first phrase: twice the token log's wait."""
        with _turn_failures():
            async for entry in read_speech_stream(self.redis.client, turn_id, 2 * self.settings.token_timeout_s):
                if entry.kind == "end":
                    yield SpeechEnd(entry.data.get("finish_reason", ""), entry.data.get("error", ""))
                elif entry.event:  # (no event: a phrase's bookkeeping, for a tts worker resuming it)
                    yield tts_pb.SpeechEvent.FromString(entry.event)

    async def cancel(self, turn_id: str, reply_started: bool) -> None:
        """The turn's cancel key, which its workers see at their next step or piece; a turn cancelled
        before its llm work was queued gets its token log ended here, so a tts worker tailing it stops."""
        try:
            await self.redis.turns.cancel(turn_id)
            if not reply_started:
                await TokenStreamWriter(self.redis.client, turn_id, self.settings.token_stream_ttl_s).append(
                    TokenEntry(0, (), "", 0, now_ms(), end=True, finish_reason="cancelled"))
        except REDIS_ERRORS as e:  # its workers stop at their own timeouts instead
            log.warning("turn %s: could not tell its workers it is cancelled: %s", turn_id, e)

    async def record(self, exchange: Exchange) -> None:
        await self.redis.sessions.append(self.session_id, exchange)

    async def amend(self, old: Exchange | None, new: Exchange | None) -> None:
        await self.redis.sessions.amend(self.session_id, old, new)

    def configure(self, config: Any) -> None:
        self.config = config

    async def prepare(self, user_text: str) -> None:
        try:
            await self.llm.Prepare(llm_pb.PrepareRequest(
                session_id=self.session_id, system_prompt=self.config.system_prompt, user_text=user_text),
                timeout=PREPARE_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            log.info("llm could not prepare session %s: %s", self.session_id, e.details())

    async def end_of_turn(self, user_text: str) -> float:
        try:
            score = await self.llm.EndOfTurn(llm_pb.EndOfTurnRequest(
                session_id=self.session_id, user_text=user_text, system_prompt=self.config.system_prompt))
        except grpc.aio.AioRpcError as e:  # without a score the turn ends at the silence, as before
            log.warning("end-of-turn score failed, taking the turn as complete: %s", e.details())
            return 1.0
        return score.probability
