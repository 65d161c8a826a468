"""The gateway's gRPC transport: `CreateSession` and `Converse` for avatar backends.

It only converts and plumbs: a `Converse` stream's first message names the session, its config
is resolved against what llm and tts offer, and a `Conversation` (services/gateway/conversation.py)
is wired to the stages (services/gateway/stages.py) and to a bounded queue that this stream drains
to the client.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from services import session_config
from services.channels import message_size_options
from services.gateway import convert
from services.gateway.conversation import Conversation, Ports
from services.gateway.ports import ClientInput, SystemClock
from services.gateway.stages import GrpcAsrStream, StageTurnRunner
from services.protos import load
from services.server import limits, logs
from services.server.auth import INTERNAL_TENANT, TENANT
from services.server.errors import status_on_error
from services.server.limits import EventQueue
from services.server.runtime import Service, service_main
from services.settings import Settings
from services.store.context import RedisContext, open_redis
from services.store.work_queue import WorkQueue

pb, pb_grpc = load("gateway")
asr_pb, asr_grpc = load("asr")
llm_pb, llm_grpc = load("llm")
tts_pb, tts_grpc = load("tts")


@dataclass
class Stubs:
    asr: Any  # asr's stream
    llm: Any  # llm's EndOfTurn score, Prepare and Capabilities
    tts: Any  # tts's Capabilities


class GatewayServicer(pb_grpc.GatewayServicer):
    def __init__(self, settings: Settings, redis: RedisContext, stubs: Stubs) -> None:
        self.settings = settings
        self.redis = redis
        self.stubs = stubs
        # Producers only (no consumer name): turns go on the stages' queues, whichever worker takes them.
        self.queues = {stage: WorkQueue(redis.client, stage, options=settings.work)
                       for stage in ("llm", "tts")}
        self._choices: session_config.Choices | None = None

    async def choices(self) -> session_config.Choices:
        """What llm and tts offer (asked once): the values a session config may name."""
        if self._choices is None:
            llm = await self.stubs.llm.Capabilities(llm_pb.CapabilitiesRequest(), timeout=10)
            tts = await self.stubs.tts.Capabilities(tts_pb.CapabilitiesRequest(), timeout=10)
            self._choices = session_config.Choices(
                drafters=tuple(llm.drafters), voices=tuple(tts.voices), default_drafter=llm.default_drafter,
                default_voice=tts.default_voice, max_new_tokens=llm.max_new_tokens)
        return self._choices

    async def CreateSession(self, request, context: grpc.aio.ServicerContext):  # noqa: N802
        async with status_on_error(context, "gateway"):
            config = pb.SessionConfig()
            config.CopyFrom(request.config)
            config.system_prompt = config.system_prompt or request.system_prompt
            session_id, resolved = await self.create_session(config)
            return pb.Session(session_id=session_id, config=resolved)

    async def create_session(self, config: Any) -> tuple[str, Any]:
        """A session of the calling tenant (TENANT): its config checked against what llm and tts offer,
        defaults filled in, held against the tenant's session limit. Every transport creates sessions here."""
        resolved = session_config.resolve(config, await self.choices(), self.settings.turn_budget_ms)
        self._cap_reply_tokens(config.max_reply_tokens, resolved)
        session_id = await self.redis.sessions.create(resolved.system_prompt, session_config.to_json(resolved),
                                                      owner=TENANT.get())
        await limits.hold_session(self.redis.client, self.settings.limits, TENANT.get(), session_id,
                                  self.settings.session_ttl_s)
        return session_id, resolved

    def resolved(self, config: Any, choices: session_config.Choices) -> Any:
        """`config` checked and with its defaults, as a session or stream would use it (ValueError naming a field)."""
        resolved = session_config.resolve(config, choices, self.settings.turn_budget_ms)
        self._cap_reply_tokens(config.max_reply_tokens, resolved)
        return resolved

    def _cap_reply_tokens(self, asked: int, resolved) -> None:
        """Past limits.max_reply_tokens an ask is refused and a default is capped."""
        limits.check_reply_tokens(self.settings.limits, asked)
        cap = self.settings.limits.max_reply_tokens
        if cap and resolved.max_reply_tokens > cap:
            resolved.max_reply_tokens = cap

    async def Converse(self, request_iterator, context: grpc.aio.ServicerContext) -> AsyncIterator:  # noqa: N802
        async with status_on_error(context, "gateway"):
            start = await _first_start(request_iterator)
            conversation = await self.open_conversation(start.session_id, start.overrides, start.format)
            yield pb.ServerEvent(ready=pb.StreamReady(session_id=start.session_id, config=conversation.config))
            async for event in converse(conversation, _client_inputs(request_iterator)):
                yield event

    async def open_conversation(self, session_id: str, overrides: Any, audio_format: Any,
                                speech_notices: bool = False) -> Conversation:
        """A conversation on a session of the calling tenant, wired to the stages: the session's config
        with this stream's overrides, checked; its expiry renewed. Every transport opens its streams here
        (the gRPC Converse, the Realtime WebSocket) and drives them with `converse`."""
        logs.bind(session_id=session_id)
        tenant = TENANT.get()  # a session is the tenant's that made it (the cluster's credential: any)
        session = await self.redis.sessions.require(session_id, owner=None if tenant == INTERNAL_TENANT else tenant)
        stored = session_config.from_json(session.get("config", ""))
        config = session_config.resolve(session_config.merged(stored, overrides), await self.choices(),
                                        self.settings.turn_budget_ms)
        self._cap_reply_tokens(overrides.max_reply_tokens, config)
        await limits.renew_session(self.redis.client, self.settings.limits, tenant, session_id,
                                   self.settings.session_ttl_s)
        events = EventQueue(self.settings.limits.max_queued_events)  # bounded: a slow client is cut off
        return Conversation(session_id, config, audio_format, self.settings, Ports(
            asr=self._asr_stream(session_id, config, audio_format),
            turns=StageTurnRunner(self.settings, self.redis, self.queues, self.stubs.llm, session_id, config),
            sink=events, clock=SystemClock()), speech_notices=speech_notices)

    def _asr_stream(self, session_id: str, config: Any, audio_format: Any) -> GrpcAsrStream:
        """The conversation's Transcribe stream. A caption stream's utterances are cut at
        `caption_max_utterance_s`, go on from the speech before a pause (`caption_context_pause_ms`) and
        are heard by the VAD at `caption_vad_threshold`, `caption_vad_gain_db` louder; a conversation's
        take the asr's own settings, as its turns wait on each final and its avatar pauses on the voice
        the VAD hears."""
        if config.mode != convert.Config.CAPTION:
            return GrpcAsrStream(self.stubs.asr, session_id, config.language, audio_format)
        return GrpcAsrStream(self.stubs.asr, session_id, config.language, audio_format,
                             max_utterance_s=self.settings.caption_max_utterance_s,
                             context_pause_ms=self.settings.caption_context_pause_ms,
                             vad_threshold=self.settings.caption_vad_threshold,
                             vad_gain_db=self.settings.caption_vad_gain_db)


async def converse(conversation: Conversation, inputs: AsyncIterator[ClientInput]) -> AsyncIterator[Any]:
    """Drive `conversation` with the client's inputs; its events, in order, until it ends (raising what
    ended it). Leaving early (the client went away) stops everything it started."""
    runner = asyncio.create_task(conversation.run(inputs))
    conversation.sink.on_overflow = runner.cancel  # nothing more is made for a client that stopped reading
    try:
        async for event in conversation.events():
            yield event
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        await conversation.close()


async def _first_start(request_iterator):
    async for message in request_iterator:
        if message.WhichOneof("payload") != "start":
            raise ValueError("the first message of a Converse stream must be its start message")
        return message.start
    raise ValueError("the stream ended before its start message")


async def _client_inputs(request_iterator) -> AsyncIterator[ClientInput]:
    async for message in request_iterator:
        yield convert.client_input(message)


async def build(settings: Settings) -> Service:
    """The gateway for run_service: its Redis and its channels to asr, llm and tts (TLS and the
    service credential from the settings, services/server/hooks.py)."""
    from services.server.hooks import internal_channel

    redis = await open_redis(settings)
    options = message_size_options(settings.max_message_bytes)
    channels = {name: internal_channel(settings, name, options) for name in ("asr", "llm", "tts")}
    stubs = Stubs(asr_grpc.AsrStub(channels["asr"]), llm_grpc.LlmStub(channels["llm"]),
                  tts_grpc.TtsStub(channels["tts"]))
    servicer = GatewayServicer(settings, redis, stubs)
    surface = None
    if settings.http_port:  # the OpenAI HTTP endpoints and Realtime API, on the same sessions (services/gateway/web.py)
        from services.gateway.web import HttpSurface, WebContext
        from services.server.limits import tenant_limits

        surface = HttpSurface(WebContext(settings, servicer, tenant_limits(settings, redis.client)))

    async def close() -> None:
        if surface is not None:
            await surface.stop()
        for channel in channels.values():
            await channel.close()
        await redis.close()

    if surface is not None:
        try:
            await surface.start()
        except BaseException:
            await close()
            raise
    return Service("gateway", lambda server: pb_grpc.add_GatewayServicer_to_server(servicer, server), close=close,
                   redis=redis.client, workers=[surface.serve_until_drain] if surface is not None else [])


if __name__ == "__main__":
    service_main(build)
