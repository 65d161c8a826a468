"""OpenAI's HTTP endpoints on the gateway: `/v1/chat/completions`, `/v1/models`, `/v1/audio/transcriptions`,
`/v1/audio/speech`, for the clients voice stacks already use (the `openai` SDK, Pipecat's OpenAI services).

Plumbing only: each request is converted (services/gateway/openai_shapes.py) onto a stage's own RPC, as
the native API reaches it. A chat completion is llm's `Reply` on a session of its own holding the request's
persona and history (so the prompt is built as every reply's is, pipeline/llm/prompts.py), deleted after;
a transcription is asr's `Transcribe` stream over the upload's audio decoded by PyAV (pipeline/media.py),
sent unpaced; speech is tts's `Synthesize`, its chunks encoded and written as each phrase is spoken. A
stream's first item (or its refusal) is awaited before the response starts, so a refusal still gets its
status; a failure after that ends the stream with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from aiohttp import web

from pipeline.audio import float_to_pcm16
from pipeline.media import SAMPLE_RATE_HZ, MediaAudio, MediaError
from services.gateway import openai_shapes as shapes
from services.gateway.convert import asr_pb, common, llm_pb, tts_pb
from services.gateway.web import CONTEXT, HttpError, WebContext, error_body, http_error_of, json_of
from services.server import limits
from services.server.auth import TENANT
from services.store.keys import history_key, session_key, token_stream_key, turn_key

log = logging.getLogger(__name__)

AUDIO_PIECE_S = 1.0  # audio per Transcribe message: well inside a gRPC message, and the stage reads them in bulk
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


@dataclass(frozen=True)
class Offer:
    """What the stages serve, asked once: the models each endpoint takes, the drafters and voices."""

    models: tuple[dict[str, Any], ...]  # GET /v1/models's entries
    chat_models: tuple[str, ...]
    transcription_models: tuple[str, ...]
    speech_models: tuple[str, ...]
    drafters: tuple[str, ...]
    default_drafter: str
    voices: tuple[str, ...]


OFFER: web.AppKey[dict[str, Offer]] = web.AppKey("openai_offer", dict)


def add_routes(app: web.Application) -> None:
    app[OFFER] = {}
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/audio/transcriptions", transcriptions)
    app.router.add_post("/v1/audio/speech", speech)


async def offer_of(app: web.Application) -> Offer:
    cached = app[OFFER].get("offer")
    if cached is None:
        context = app[CONTEXT]
        llm = await context.gateway.stubs.llm.Capabilities(llm_pb.CapabilitiesRequest(), timeout=10)
        tts = await context.gateway.stubs.tts.Capabilities(tts_pb.CapabilitiesRequest(), timeout=10)
        models = shapes.served_models(llm.model, context.settings.asr.model)
        cached = app[OFFER]["offer"] = Offer(
            tuple(shapes.model_entry(m, int(time.time())) for m in models.all), models.chat, models.transcription,
            models.speech, tuple(llm.drafters), llm.default_drafter, tuple(tts.voices))
    return cached


# ---- models ------------------------------------------------------------------------------------

async def list_models(request: web.Request) -> web.Response:
    offer = await offer_of(request.app)
    return web.json_response({"object": "list", "data": list(offer.models)})


async def get_model(request: web.Request) -> web.Response:
    offer = await offer_of(request.app)
    name = request.match_info["model"]
    for model in offer.models:
        if model["id"] == name:
            return web.json_response(model)
    raise HttpError(404, f"the model {name!r} does not exist here", param="model", code="model_not_found",
                    kind="not_found_error")


# ---- chat completions --------------------------------------------------------------------------

async def chat_completions(request: web.Request) -> web.StreamResponse:
    context = request.app[CONTEXT]
    body = json_of(await request.read())  # a body too large or not JSON is refused before any stage is asked
    offer = await offer_of(request.app)
    chat = shapes.chat_request(body, offer.chat_models, offer.drafters)
    try:
        limits.check_reply_tokens(context.settings.limits, chat.max_new_tokens)
    except limits.LimitExceededError as e:
        raise HttpError(400, str(e), param="max_tokens", code="invalid_value") from None
    cap = context.settings.limits.max_reply_tokens
    if cap and not chat.max_new_tokens:  # the llm's default, held to the cap as a session's is
        chat = dataclasses.replace(chat, max_new_tokens=min(cap, (await context.gateway.choices()).max_new_tokens))
    result = shapes.ChatResult(chat, chat.drafter or offer.default_drafter)
    async with _chat_session(context, chat) as (session_id, turn_id):
        call = context.gateway.stubs.llm.Reply(chat.reply_request(session_id, turn_id))
        try:
            if not chat.stream:
                async for step in call:
                    result.add(step)
                return web.json_response(result.completion())
            steps = call.__aiter__()
            step = await anext(steps)  # a refusal (an unknown drafter, too long a prompt) still gets its status
            response = await _event_stream(request)
            async with _stream_errors(response):
                await response.write(shapes.sse(result.chunk({"role": "assistant", "content": ""})))
                while True:
                    if delta := result.add(step):
                        await response.write(shapes.sse(result.chunk({"content": delta})))
                    if step.end:
                        break
                    step = await anext(steps)
                await response.write(shapes.sse(result.chunk({}, result.finish_reason, last=True)))
                if chat.include_usage:
                    await response.write(shapes.sse(result.usage_chunk()))
                await response.write(shapes.sse("[DONE]"))
            return response
        finally:
            call.cancel()  # a client gone mid-reply: llm stops at its next step


@contextlib.asynccontextmanager
async def _request_session(context: WebContext, persona: str = "") -> AsyncIterator[str]:
    """A session for one request (the stages' calls need one), held against the key's max_sessions_per_key
    while the request lasts (the gRPC CreateSession's count), deleted and released after."""
    redis, tenant = context.gateway.redis, TENANT.get()
    session_id = await redis.sessions.create(persona, owner=tenant)
    await limits.hold_session(redis.client, context.settings.limits, tenant, session_id, context.settings.session_ttl_s)
    try:
        yield session_id
    finally:
        with contextlib.suppress(Exception):  # (it expires anyway)
            await redis.client.delete(session_key(session_id))
            await limits.release_session(redis.client, context.settings.limits, tenant, session_id)


@contextlib.asynccontextmanager
async def _chat_session(context: WebContext, chat: shapes.ChatRequest) -> AsyncIterator[tuple[str, str]]:
    """A request's session holding its persona and history, and a turn for its reply; all deleted after."""
    redis = context.gateway.redis
    async with _request_session(context, chat.persona) as session_id:
        turn_id = ""
        try:
            for exchange in chat.history:
                await redis.sessions.append(session_id, exchange, keep=len(chat.history))
            turn_id = await redis.turns.create(session_id)
            yield session_id, turn_id
        finally:
            with contextlib.suppress(Exception):
                await redis.client.delete(history_key(session_id),
                                          *((turn_key(turn_id), token_stream_key(turn_id)) if turn_id else ()))


async def _event_stream(request: web.Request, content_type: str = "") -> web.StreamResponse:
    headers = dict(SSE_HEADERS) if not content_type else {"Content-Type": content_type}
    response = web.StreamResponse(headers=headers)
    await response.prepare(request)
    return response


@contextlib.asynccontextmanager
async def _stream_errors(response: web.StreamResponse, sse: bool = True) -> AsyncIterator[None]:
    """A failure once the response has begun: an `error` event in OpenAI's shape (what its SDKs raise),
    then the end of the stream; an audio stream can only be cut short."""
    try:
        yield
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:  # noqa: BLE001 - the status is sent already; the client hears why, the server goes on
        refusal = http_error_of(e)
        log.warning("a streamed response failed after it began (%s): %s", type(e).__name__, e)
        if sse:
            with contextlib.suppress(ConnectionResetError):
                await response.write(shapes.sse(error_body(str(refusal), refusal.kind, refusal.param, refusal.code)))
    with contextlib.suppress(ConnectionResetError):
        await response.write_eof()


# ---- transcriptions ----------------------------------------------------------------------------

async def transcriptions(request: web.Request) -> web.StreamResponse:
    context = request.app[CONTEXT]
    if request.content_type != "multipart/form-data":
        raise HttpError(400, "the request must be multipart/form-data with the audio in its `file` field",
                        param="file")
    try:
        form = await request.post()
    except ValueError as e:
        raise HttpError(400, f"the multipart body cannot be read: {e}") from None
    upload = form.get("file")
    if not isinstance(upload, web.FileField):
        raise HttpError(400, "the audio must be sent as the `file` field, a file", param="file",
                        code="missing_required_parameter")
    fields = {key: [v for v in form.getall(key) if isinstance(v, str)] for key in set(form.keys()) if key != "file"}
    offer = await offer_of(request.app)
    asked = shapes.transcription_request(fields, offer.transcription_models)
    async with _uploaded_audio(upload) as audio, _request_session(context) as session_id:
        call = context.gateway.stubs.asr.Transcribe()
        accepted = asyncio.Event()
        sender = asyncio.create_task(_send_audio(call, _record_config(context.settings, session_id, asked), audio,
                                                 accepted))
        sender.add_done_callback(lambda task: task.cancelled() or task.exception() is None or call.cancel())
        try:
            events = call.__aiter__()
            await anext(events)  # READY: the language was accepted
            accepted.set()
            if asked.stream:
                response = await _event_stream(request)
                async with _stream_errors(response):
                    streamed = shapes.StreamedText()
                    async for event in events:
                        final = event.kind == asr_pb.TranscriptEvent.FINAL
                        if final or event.kind == asr_pb.TranscriptEvent.PARTIAL:
                            delta = streamed.delta(event.text if final else event.committed_text, final)
                            if delta:
                                await response.write(shapes.sse({"type": "transcript.text.delta", "delta": delta}))
                    await sender
                    await response.write(shapes.sse({"type": "transcript.text.done", "text": streamed.text}))
                return response
            utterances = [shapes.Utterance(e.text, e.speech_start_s, e.speech_end_s, list(e.words))
                          async for e in events if e.kind == asr_pb.TranscriptEvent.FINAL]
            duration_s = await sender
        except grpc.aio.AioRpcError as e:
            # The call was cancelled because the audio failed (a file that does not decode): the audio's error.
            # Any other end is the asr's answer (a language it refuses).
            failed = sender.exception() if sender.done() and not sender.cancelled() else None
            if e.code() == grpc.StatusCode.CANCELLED and failed is not None:
                raise failed from None
            raise
        finally:
            call.cancel()
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
    language = asked.language or context.settings.asr.language or "en"
    body, content_type = shapes.transcription_body(asked, utterances, duration_s, language)
    if isinstance(body, dict):
        return web.json_response(body)
    return web.Response(text=body, content_type=content_type)


class UploadedAudio:
    """The upload's audio, decoded chunk by chunk on worker threads. Closing waits for a decode in progress
    (a request that ends early must not free FFmpeg's context under a decoding thread), and no decode
    starts after it."""

    def __init__(self, media: MediaAudio) -> None:
        self._media = media
        self._chunks: Any = media.chunks()  # a generator: closed with the file
        self._lock = threading.Lock()
        self._closed = False

    def next_chunk(self) -> Any:
        """The next chunk (None at the end, or once closed); damage FFmpeg cannot get past is the file's: a 400."""
        with self._lock:
            if self._closed:
                return None
            try:
                return next(self._chunks, None)
            except MediaError as e:
                raise HttpError(400, str(e), param="file", code="invalid_value") from None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._chunks.close()
            self._media.close()


@contextlib.asynccontextmanager
async def _uploaded_audio(upload: web.FileField) -> AsyncIterator[UploadedAudio]:
    """The upload opened by PyAV (from a file of its own: FFmpeg probes by seeking); a file it cannot read is a
    400 naming `file`."""
    suffix = os.path.splitext(upload.filename or "")[1][:10]
    with tempfile.NamedTemporaryFile(suffix=suffix) as copy:
        await asyncio.to_thread(_copy, upload.file, copy)
        try:
            media = await asyncio.to_thread(MediaAudio, copy.name)
        except MediaError as e:
            raise HttpError(400, str(e).replace(copy.name, upload.filename or "file"), param="file",
                            code="invalid_value") from None
        media.path = upload.filename or "file"  # (opened: its messages name the upload, not the copy)
        audio = UploadedAudio(media)
        try:
            yield audio
        finally:
            await asyncio.shield(asyncio.to_thread(audio.close))


def _copy(source: Any, target: Any) -> None:
    source.seek(0)
    while block := source.read(1 << 20):
        target.write(block)
    target.flush()


def _record_config(settings, session_id: str, asked: shapes.TranscriptionRequest) -> asr_pb.StreamConfig:
    """The asr stream of a transcription: 16 kHz PCM, heard as a caption stream hears speech (a transcript
    is a record, as a caption is): quieter speech begins an utterance (`caption_vad_threshold`, `caption_vad_gain_db`)
    and a sentence cut at a pause is heard whole (`caption_context_pause_ms`); docs/benchmarks, "Streamed finals"."""
    pcm16 = common.AudioFormat(encoding=common.AudioFormat.PCM_S16LE, sample_rate_hz=SAMPLE_RATE_HZ, channels=1,
                               sample_width_bytes=2)
    return asr_pb.StreamConfig(session_id=session_id, format=pcm16, language=asked.language,
                               vad_threshold=settings.caption_vad_threshold, vad_gain_db=settings.caption_vad_gain_db,
                               context_pause_ms=settings.caption_context_pause_ms, prompt=asked.prompt.strip())


async def _send_audio(call: Any, config: asr_pb.StreamConfig, audio: UploadedAudio, accepted: asyncio.Event) -> float:
    """The config, then, once the asr has `accepted` the config, the decoded audio as 16 kHz PCM,
    unpaced; its duration in seconds. Audio written after a refusal would race the asr's status: grpc's core
    can end such a call INTERNAL ("Failed execute_batch") instead of with the refusal."""
    await call.write(asr_pb.TranscribeRequest(config=config))
    await accepted.wait()
    samples = 0
    piece = int(AUDIO_PIECE_S * SAMPLE_RATE_HZ)
    while (chunk := await asyncio.to_thread(audio.next_chunk)) is not None:
        samples += chunk.size
        for start in range(0, chunk.size, piece):
            await call.write(asr_pb.TranscribeRequest(audio=float_to_pcm16(chunk[start:start + piece])))
    await call.done_writing()
    return samples / SAMPLE_RATE_HZ


# ---- speech ------------------------------------------------------------------------------------

async def speech(request: web.Request) -> web.StreamResponse:
    context = request.app[CONTEXT]
    body = json_of(await request.read())
    offer = await offer_of(request.app)
    asked = shapes.speech_request(body, offer.speech_models, offer.voices)
    call = context.gateway.stubs.tts.Synthesize(asked.synthesize_request())
    encoder: shapes.AudioEncoder | None = None
    try:
        events = call.__aiter__()
        event = await anext(events)  # a refused text or voice still gets its status
        encoder = shapes.AudioEncoder(asked.response_format, asked.speed)
        content_type = "" if asked.sse else shapes.SPEECH_CONTENT_TYPES[asked.response_format]
        response = await _event_stream(request, content_type)
        audio_s = 0.0

        async def send(data: bytes) -> None:
            if data:
                await response.write(shapes.sse(shapes.audio_delta(data)) if asked.sse else data)

        async with _stream_errors(response, sse=asked.sse):
            while True:
                if event.WhichOneof("event") == "audio":
                    audio_s += len(event.audio.pcm_s16le) / 2 / event.audio.sample_rate_hz
                    await send(encoder.encode(event.audio.pcm_s16le))
                event = await anext(events, None)
                if event is None:
                    break
            await send(encoder.finish())
            if asked.sse:
                usage = shapes.speech_usage(asked.text, audio_s / asked.speed)
                await response.write(shapes.sse(shapes.speech_event("done", usage=usage)))
        return response
    finally:
        call.cancel()  # a client gone mid-speech: tts stops at its next piece
        if encoder is not None:
            encoder.close()

