"""The gateway: the session API for avatar backends.

One `Converse` stream is one conversation: the client's audio goes to asr; each
final transcript starts a turn, whose reply is written by llm (to the turn's Redis
stream) and spoken by tts (from that stream) at the same time. Speech from the
user while a turn runs cancels it (barge-in).

Preemptive generation (`preemptive_generation`, on by default): a partial whose words
are all committed and after which silence has begun starts the turn before the final
arrives. The turn's output is held back until the final confirms it: the same text
(normalised) keeps the turn, any other text cancels it and starts a new one.

A user who speaks again before any of the reply's audio went out was pausing, not done:
the turn is cancelled as in a barge-in, and its words begin the next turn's text, so the
reply answers all that was said (Pipecat's user aggregator and LiveKit's turn handling
gather a user's turn across pauses alike). A short end-of-speech silence then costs a
restarted reply, not a lost half of a sentence.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from pipeline.asr_stream import normalised_text
from pipeline.audio import AudioStreamReader, PcmFormat
from pipeline.captions import Cue, cues_from_words, webvtt_block
from pipeline.llm.prompts import Exchange
from services.grpc_server import StageClock, message_options, serve, status_on_error
from services.protos import load
from services.redis_store import now_ms
from services.runtime import RedisContext, open_redis
from services.settings import Settings

pb, pb_grpc = load("gateway")
asr_pb, asr_grpc = load("asr")
llm_pb, llm_grpc = load("llm")
tts_pb, tts_grpc = load("tts")
log = logging.getLogger(__name__)
END = object()
SPOKEN = frozenset({"reply_text", "audio", "cue", "word"})  # a cancelled turn's events still queued are dropped


class AudioArrivalClock:
    """Maps a time in the input audio to when the gateway received it (Unix ms)."""

    def __init__(self, fmt: pb.AudioFormat) -> None:
        declared = PcmFormat(fmt.sample_rate_hz, fmt.channels or 1, fmt.sample_width_bytes or 2)
        self.reader = AudioStreamReader(fmt.encoding, declared)
        self._audio_bytes = 0
        self._ends_s: list[float] = []
        self._arrivals_ms: list[int] = []

    def received(self, chunk: bytes) -> None:
        self._audio_bytes += len(self.reader.feed(chunk))
        if self.reader.format is not None:
            self._ends_s.append(self._audio_bytes / self.reader.format.bytes_per_s)
            self._arrivals_ms.append(now_ms())

    def arrival_ms(self, audio_s: float) -> int:
        i = bisect.bisect_left(self._ends_s, audio_s - 1e-6)
        return self._arrivals_ms[min(i, len(self._arrivals_ms) - 1)] if self._arrivals_ms else 0


@dataclass
class Stubs:
    asr: asr_grpc.AsrStub
    llm: llm_grpc.LlmStub
    tts: tts_grpc.TtsStub


@dataclass
class Turn:
    """One user utterance and the reply to it."""

    turn_id: str
    transcript: asr_pb.TranscriptEvent
    speech_end_unix_ms: int
    said_before: str = ""  # the user's words of earlier turns that got no reply they heard
    clock: StageClock = field(default_factory=lambda: StageClock("gateway"))
    reply_text: str = ""
    finish_reason: str = ""
    error: str = ""
    first_audio_sent_unix_ms: int = 0
    stage_times: list = field(default_factory=list)
    preemption: str = ""  # "", or "kept" / "dropped" for a turn started from a partial
    confirmed: asyncio.Event = field(default_factory=asyncio.Event)  # its output may go out
    task: asyncio.Task | None = None
    reported: bool = False

    @property
    def user_text(self) -> str:
        """What the reply answers: the words said before it went unanswered, then this utterance."""
        return " ".join(t for t in (self.said_before, self.transcript.text.strip()) if t)

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    @property
    def awaiting_final(self) -> bool:
        return not self.confirmed.is_set() and self.running


@dataclass
class PreemptionCounts:
    kept: int = 0  # the final said what the turn was started from
    dropped: int = 0  # it did not: the early turn was cancelled


class Conversation:
    """The state of one Converse stream; events for the client go through `events`."""

    def __init__(self, servicer: GatewayServicer, start: pb.StreamStart) -> None:
        self.servicer = servicer
        self.start = start
        self.arrivals = AudioArrivalClock(start.format)
        self.events: asyncio.Queue = asyncio.Queue()
        self.turn: Turn | None = None
        self.preemptions = PreemptionCounts()
        self.cancelled_turns: set[str] = set()
        self.unanswered = ""  # the user's words since the last reply audio they heard
        self._input_error: Exception | None = None

    async def run(self, client_messages: AsyncIterator) -> None:
        try:
            call = self.servicer.stubs.asr.Transcribe()
            forward = asyncio.create_task(self._forward_audio(client_messages, call))
            try:
                async for event in call:
                    await self._on_transcript(event)
            except (grpc.aio.AioRpcError, asyncio.CancelledError):
                if self._input_error:  # bad client input ended the asr call: say so, not "cancelled"
                    raise self._input_error from None
                raise
            finally:
                forward.cancel()
            if self.turn and self.turn.task:
                await self.turn.task
            await self.events.put(END)
        except BaseException as e:  # delivered to the client's stream by Converse
            await self.events.put(e)

    async def _forward_audio(self, client_messages: AsyncIterator, call) -> None:
        """Client audio → asr, checked here so bad input fails the conversation with its own message."""
        fmt = self.start.format
        try:
            await call.write(asr_pb.TranscribeRequest(config=asr_pb.StreamConfig(
                session_id=self.start.session_id, language=self.start.language,
                format=asr_pb.AudioFormat(encoding=fmt.encoding, sample_rate_hz=fmt.sample_rate_hz,
                                          channels=fmt.channels, sample_width_bytes=fmt.sample_width_bytes),
            )))
            async for message in client_messages:
                if message.WhichOneof("payload") != "audio":
                    raise ValueError("only audio may follow the start message")
                self.arrivals.received(message.audio)
                await call.write(asr_pb.TranscribeRequest(audio=message.audio))
            await call.done_writing()
        except (ValueError, grpc.aio.AioRpcError) as e:
            if not isinstance(e, grpc.aio.AioRpcError):
                self._input_error = e
            call.cancel()
        except asyncio.InvalidStateError:
            pass  # asr already ended the call; its status reaches run()

    async def _on_transcript(self, event: asr_pb.TranscriptEvent) -> None:
        kind = event.kind
        if kind == asr_pb.TranscriptEvent.SPEECH_STARTED:
            turn = self.turn
            if turn and turn.running and turn.confirmed.is_set() and not turn.first_audio_sent_unix_ms:
                self.unanswered = turn.user_text  # a pause: these words go on into the next turn
            await self._cancel_turn()  # barge-in
        elif kind == asr_pb.TranscriptEvent.PARTIAL:
            await self.events.put(pb.ServerEvent(transcript=_transcript(event, final=False)))
            if self._may_preempt(event):
                await self._start_turn(event, preemptive=True)
        elif kind == asr_pb.TranscriptEvent.FINAL:
            await self._on_final(event)

    def _may_preempt(self, partial: asr_pb.TranscriptEvent) -> bool:
        """Every word committed, silence begun, and no early turn for this utterance yet."""
        if not (self.servicer.settings.preemptive_generation and partial.speech_ending):
            return False
        if partial.tentative_text.strip() or not partial.committed_text.strip():
            return False
        return not (self.turn and self.turn.awaiting_final)

    async def _on_final(self, event: asr_pb.TranscriptEvent) -> None:
        turn = self.turn
        if turn and turn.awaiting_final and turn.transcript.utterance_index == event.utterance_index:
            if event.text.strip() and normalised_text(event.text) == normalised_text(turn.transcript.text):
                self.preemptions.kept += 1
                turn.preemption, turn.transcript = "kept", event
                turn.speech_end_unix_ms = self.arrivals.arrival_ms(event.speech_end_s)
                turn.stage_times.append(_stage(event.times))
                turn.clock.emitted()  # the final first, then the output held back for it
                await self.events.put(pb.ServerEvent(turn_id=turn.turn_id, transcript=_transcript(event, final=True)))
                turn.confirmed.set()
                return
            self.preemptions.dropped += 1
            turn.preemption = "dropped"
        if event.text.strip():
            await self._start_turn(event, preemptive=False)
        else:
            await self._cancel_turn()

    async def _start_turn(self, event: asr_pb.TranscriptEvent, preemptive: bool) -> None:
        await self._cancel_turn()
        turn_id = await self.servicer.redis.turns.create(self.start.session_id)
        turn = Turn(turn_id, event, self.arrivals.arrival_ms(event.speech_end_s), said_before=self.unanswered)
        turn.clock.received()
        if not preemptive:
            turn.stage_times.append(_stage(event.times))
            turn.confirmed.set()
            await self._send(turn, transcript=_transcript(event, final=True))
        turn.task = asyncio.create_task(self._run_turn(turn))
        self.turn = turn

    async def _cancel_turn(self) -> None:
        turn = self.turn
        if turn and turn.task and turn.running:
            self.cancelled_turns.add(turn.turn_id)  # what it queued for the client is dropped too
            turn.task.cancel()
            await asyncio.gather(turn.task, return_exceptions=True)
            if not turn.reported:  # cancelled before it ran a line: it still gets its report
                turn.finish_reason = "cancelled"
                self._put_report(turn)

    async def _run_turn(self, turn: Turn) -> None:
        stubs, session_id = self.servicer.stubs, self.start.session_id
        llm_call = stubs.llm.Reply(llm_pb.ReplyRequest(
            session_id=session_id, turn_id=turn.turn_id, user_text=turn.user_text,
            task=llm_pb.ReplyRequest.DIALOGUE, defer_history=True))
        tts_call = stubs.tts.SpeakTurn(tts_pb.SpeakTurnRequest(
            session_id=session_id, turn_id=turn.turn_id, sample_rate_hz=self.start.reply_sample_rate_hz))
        try:
            await asyncio.gather(self._pump_reply(turn, llm_call), self._pump_speech(turn, tts_call))
        except asyncio.CancelledError:
            turn.finish_reason = "cancelled"
            raise
        except grpc.aio.AioRpcError as e:  # the turn fails, the conversation goes on
            log.warning("turn %s failed: %s", turn.turn_id, e.details())
            turn.finish_reason, turn.error = "error", f"{e.code().name}: {e.details()}"
        finally:
            llm_call.cancel()
            tts_call.cancel()
            turn.clock.emitted()
            self._put_report(turn)

    async def _remember(self, turn: Turn) -> None:
        """The exchange joins the session's history once the final confirmed the turn: a dropped
        early turn, even one whose reply had already ended, never does (llm was told to defer)."""
        await turn.confirmed.wait()  # then turn.transcript is the final
        if turn.reply_text.strip():
            await self.servicer.redis.sessions.append(self.start.session_id,
                                                      Exchange(turn.user_text, turn.reply_text.strip()))

    async def _pump_reply(self, turn: Turn, call) -> None:
        async for step in call:
            turn.reply_text += step.text_delta
            if step.text_delta:
                await self._send(turn, reply_text=pb.ReplyText(text_delta=step.text_delta,
                                                               accepted_tokens=step.accepted))
            if step.end:
                turn.finish_reason = step.finish_reason
                turn.stage_times.append(_stage(step.times))
        await self._remember(turn)

    async def _pump_speech(self, turn: Turn, call) -> None:
        async for event in call:
            kind = event.WhichOneof("event")
            if kind == "audio":
                await turn.confirmed.wait()
                if not turn.first_audio_sent_unix_ms:
                    turn.first_audio_sent_unix_ms, self.unanswered = now_ms(), ""  # the user hears a reply
                a = event.audio
                await self._send(turn, audio=pb.AudioChunk(
                    pcm_s16le=a.pcm_s16le, sample_rate_hz=a.sample_rate_hz, start_s=a.start_s))
            elif kind in ("cue", "word"):
                c = getattr(event, kind)
                block = webvtt_block(Cue(c.start_s, c.end_s, c.text))
                await self._send(turn, **{kind: pb.CaptionCue(start_s=c.start_s, end_s=c.end_s, text=c.text,
                                                               webvtt=block)})
            elif kind == "times":
                turn.stage_times.append(_stage(event.times))

    async def _send(self, turn: Turn, **event) -> None:
        await turn.confirmed.wait()  # an early turn speaks only once the final confirms it
        turn.clock.emitted()
        await self.events.put(pb.ServerEvent(turn_id=turn.turn_id, **event))

    def _put_report(self, turn: Turn) -> None:
        turn.reported = True
        self.events.put_nowait(pb.ServerEvent(turn_id=turn.turn_id, report=self._report(turn)))

    def _report(self, turn: Turn) -> pb.TurnReport:
        return pb.TurnReport(
            transcript=turn.user_text,
            reply_text=turn.reply_text.strip(),
            speech_end_s=turn.transcript.speech_end_s,
            speech_end_unix_ms=turn.speech_end_unix_ms,
            first_audio_sent_unix_ms=turn.first_audio_sent_unix_ms,
            stages=[*turn.stage_times, turn.clock.to_proto(pb.StageTimes)],
            budget_ms=self.servicer.settings.turn_budget_ms,
            finish_reason=turn.finish_reason,
            error=turn.error,
            preemption=turn.preemption,
            preemptions_kept=self.preemptions.kept,
            preemptions_dropped=self.preemptions.dropped,
        )


def _transcript(event: asr_pb.TranscriptEvent, final: bool) -> pb.Transcript:
    words = [pb.Word(text=w.text, start_s=w.start_s, end_s=w.end_s) for w in event.words]
    cues = [pb.CaptionCue(start_s=c.start_s, end_s=c.end_s, text=c.text, webvtt=webvtt_block(c))
            for c in cues_from_words(event.words)] if final else []
    return pb.Transcript(
        is_final=final, text=event.text, words=words, speech_start_s=event.speech_start_s,
        speech_end_s=event.speech_end_s, committed_text=event.committed_text,
        tentative_text=event.tentative_text, stability=event.stability,
        utterance_index=event.utterance_index, cues=cues,
    )


def _stage(times) -> pb.StageTimes:
    return pb.StageTimes(stage=times.stage, first_in_unix_ms=times.first_in_unix_ms,
                         last_in_unix_ms=times.last_in_unix_ms, first_out_unix_ms=times.first_out_unix_ms,
                         last_out_unix_ms=times.last_out_unix_ms)


class GatewayServicer(pb_grpc.GatewayServicer):
    def __init__(self, settings: Settings, redis: RedisContext, stubs: Stubs) -> None:
        self.settings = settings
        self.redis = redis
        self.stubs = stubs
        self.preemptions = PreemptionCounts()  # over all conversations, since the server started

    async def CreateSession(self, request, context: grpc.aio.ServicerContext):
        async with status_on_error(context, "gateway"):
            if len(request.system_prompt) > 8_000:
                raise ValueError("system_prompt is longer than 8000 characters")
            return pb.Session(session_id=await self.redis.sessions.create(request.system_prompt))

    async def Converse(self, request_iterator, context: grpc.aio.ServicerContext) -> AsyncIterator:
        async with status_on_error(context, "gateway"):
            start = await _first_start(request_iterator)
            await self.redis.sessions.require(start.session_id)
            conversation = Conversation(self, start)
            yield pb.ServerEvent(ready=pb.StreamReady(session_id=start.session_id))
            runner = asyncio.create_task(conversation.run(request_iterator))
            try:
                while (event := await conversation.events.get()) is not END:
                    if isinstance(event, BaseException):
                        raise event
                    if event.turn_id in conversation.cancelled_turns and event.WhichOneof("event") in SPOKEN:
                        continue  # a barge-in: the user no longer hears this turn
                    yield event
            finally:
                runner.cancel()
                await conversation._cancel_turn()
                self.preemptions.kept += conversation.preemptions.kept
                self.preemptions.dropped += conversation.preemptions.dropped


async def _first_start(request_iterator) -> pb.StreamStart:
    async for message in request_iterator:
        if message.WhichOneof("payload") != "start":
            raise ValueError("the first message of a Converse stream must be its start message")
        return message.start
    raise ValueError("the stream ended before its start message")


async def run(settings: Settings) -> None:
    redis = await open_redis(settings)
    options = message_options(settings.max_message_bytes)
    channels = {name: grpc.aio.insecure_channel(settings.address(name), options=options)
                for name in ("asr", "llm", "tts")}
    stubs = Stubs(asr_grpc.AsrStub(channels["asr"]), llm_grpc.LlmStub(channels["llm"]),
                  tts_grpc.TtsStub(channels["tts"]))
    servicer = GatewayServicer(settings, redis, stubs)

    async def close() -> None:
        for channel in channels.values():
            await channel.close()
        await redis.close()

    await serve(
        "gateway",
        lambda server: pb_grpc.add_GatewayServicer_to_server(servicer, server),
        [pb.DESCRIPTOR.services_by_name["Gateway"].full_name],
        f"{settings.host}:{settings.gateway_port}",
        settings.max_message_bytes,
        on_stop=close,
    )
