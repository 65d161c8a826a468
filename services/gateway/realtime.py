"""The OpenAI Realtime API on the gateway: `GET /v1/realtime`, a WebSocket onto one specvox conversation.

Plumbing only. A connection creates a session of the caller's (the gateway's CreateSession) or takes
the one named by the query's `session_id`, opens a conversation on it as the gRPC `Converse` does
(GatewayServicer.open_conversation, the same Conversation and stages), and converts in both directions
with services/gateway/realtime_events.py: the GA dialect, or the beta one when the client sends
`OpenAI-Beta: realtime=v1`. Auth, limits, metrics and TLS are services/gateway/web.py's.

A refused client event (bad JSON, an unknown type, a format not served, a frame past
`max_message_bytes`) is answered with an OpenAI-shaped `error` event and the connection goes on; only
the conversation's own end (a session limit, a stage gone) closes it, after an `error` event saying why.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import WSMsgType, web

from services.gateway import realtime_session
from services.gateway import web as gateway_web
from services.gateway.convert import Config, common
from services.gateway.ports import ClientInput
from services.gateway.realtime_events import RealtimeConverter, client_event_id
from services.gateway.realtime_session import RealtimeError
from services.gateway.service import converse
from services.server.errors import status_of

log = logging.getLogger(__name__)
PATH = "/v1/realtime"
# The conversation hears the client's audio as 16-bit PCM at 24 kHz whatever the session's format
# (realtime_events._InputAudio converts G.711), so a format change leaves its asr stream as it is.
INPUT_FORMAT = common.AudioFormat(encoding=common.AudioFormat.PCM_S16LE, sample_rate_hz=24_000, channels=1,
                                  sample_width_bytes=2)
SUBPROTOCOL = "realtime"  # what OpenAI's browser clients offer beside their key
BETA_SUBPROTOCOL = "openai-beta.realtime-v1"  # a browser's way of sending OpenAI-Beta: realtime=v1
FRAME_SLACK = 4  # aiohttp itself closes (1009) past this many times max_message_bytes; below, an error event


def add_routes(app: web.Application) -> None:
    app.router.add_get(PATH, realtime)


async def realtime(request: web.Request) -> web.WebSocketResponse:
    context = request.app[gateway_web.CONTEXT]
    gateway, settings = context.gateway, context.settings
    dialect: realtime_session.Dialect = "beta" if _asks_beta(request) else "ga"
    ws = web.WebSocketResponse(protocols=(SUBPROTOCOL,), max_msg_size=FRAME_SLACK * settings.max_message_bytes)
    if not ws.can_prepare(request).ok:  # before a session is made for it
        raise gateway_web.HttpError(400, f"{PATH} is a WebSocket: connect with a Realtime client (Upgrade: websocket)",
                                    code="websocket_required")
    choices = await gateway.choices()  # failures here answer as HTTP errors, before the upgrade
    session_id = request.query.get("session_id", "")
    if not session_id:
        session_id, _ = await gateway.create_session(Config(mode=_mode(request.query.get("mode", "dialogue"))))
    conversation = await gateway.open_conversation(session_id, Config(), INPUT_FORMAT, speech_notices=True)
    converter = RealtimeConverter(
        realtime_session.initial(session_id, conversation.config, settings.asr, request.query.get("model", "")),
        dialect, choices.voices,
        settings.asr, settings.turn_taking, conversation.config, lambda config: gateway.resolved(config, choices),
        drafters=choices.drafters)
    await ws.prepare(request)
    request.app[gateway_web.WEBSOCKETS].add(ws)
    # Bounded, so a client that stops reading holds the conversation's own bounded queue back, which then
    # ends the conversation as it ends a gRPC stream (limits.max_queued_events), instead of growing here.
    outgoing: asyncio.Queue[dict | None] = asyncio.Queue(max(1, settings.limits.max_queued_events))
    inputs: asyncio.Queue[ClientInput | None] = asyncio.Queue()
    for event in converter.session_created():
        await outgoing.put(event)
    writer = asyncio.create_task(_write(ws, outgoing))
    reader = asyncio.create_task(_read(ws, converter, inputs, outgoing, settings.max_message_bytes))
    talker = asyncio.create_task(_talk(conversation, converter, inputs, outgoing))
    try:
        await asyncio.wait({reader, talker}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (reader, talker):
            task.cancel()
        await asyncio.gather(reader, talker, return_exceptions=True)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(outgoing.put(None), 5)
            await asyncio.wait_for(writer, 5)
        writer.cancel()
        await ws.close()
    return ws


def _mode(asked: str) -> int:
    """`?mode=` of a new session: a connection's mode is its session's (the Realtime API has no field for it)."""
    modes = {"dialogue": Config.DIALOGUE, "caption": Config.CAPTION}
    if asked not in modes:
        raise gateway_web.HttpError(400, f"mode {asked!r}: dialogue or caption", param="mode", code="invalid_value")
    return modes[asked]


def _asks_beta(request: web.Request) -> bool:
    """The beta dialect: the header `OpenAI-Beta: realtime=v1`, or a browser's subprotocol saying the same."""
    protocols = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",")]
    return "realtime=v1" in request.headers.get("OpenAI-Beta", "") or BETA_SUBPROTOCOL in protocols


async def _write(ws: web.WebSocketResponse, outgoing: asyncio.Queue) -> None:
    """The one writer of the socket: events in the order they were queued."""
    while (event := await outgoing.get()) is not None:
        if ws.closed:
            return
        try:
            await ws.send_str(json.dumps(event))
        except (ConnectionResetError, RuntimeError):  # the client went away mid-send
            return


async def _read(ws: web.WebSocketResponse, converter: RealtimeConverter, inputs: asyncio.Queue,
                outgoing: asyncio.Queue, max_bytes: int) -> None:
    """Client frames → the conversation's inputs, and the answers that need no conversation; until the
    client closes."""
    async for message in ws:
        if message.type == WSMsgType.ERROR:
            break
        if message.type != WSMsgType.TEXT:
            await outgoing.put(converter.error_event(RealtimeError(
                "send client events as JSON text frames", "invalid_event", None)))
            continue
        if len(message.data) > max_bytes:
            await outgoing.put(converter.error_event(RealtimeError(
                f"the event is {len(message.data)} bytes; at most {max_bytes} (max_message_bytes): send audio in "
                "smaller appends", "message_too_large", None)))
            continue
        try:
            new_inputs, answers = converter.client_event(message.data)
        except RealtimeError as e:
            await outgoing.put(converter.error_event(e, client_event_id(message.data)))
            continue
        for item in new_inputs:
            inputs.put_nowait(item)
        for answer in answers:
            await outgoing.put(answer)
    inputs.put_nowait(None)


async def _talk(conversation: Any, converter: RealtimeConverter, inputs: asyncio.Queue,
                outgoing: asyncio.Queue) -> None:
    """The conversation driven by the client's inputs; its events converted, until it ends."""
    async def client_inputs() -> AsyncIterator[ClientInput]:
        while (item := await inputs.get()) is not None:
            yield item

    try:
        async for event in converse(conversation, client_inputs()):
            for server_event in converter.conversation_event(event):
                await outgoing.put(server_event)
    except Exception as e:  # noqa: BLE001 - the conversation's end, told to the client before the close
        log.info("realtime conversation %s ended: %s", conversation.session_id, e)
        code = status_of(e).name.lower()
        kind = "server_error" if code in ("internal", "unavailable", "unknown") else "invalid_request_error"
        with contextlib.suppress(asyncio.QueueFull):  # a client too slow to read gets no more
            outgoing.put_nowait(converter.error_event(RealtimeError(str(e), code), kind=kind))
