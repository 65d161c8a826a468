"""The gateway: the session API for avatar backends.

One `Converse` stream is one conversation. The client's audio goes to asr; what asr hears,
the client's playback reports and time passing go into the conversation's turn-taking state
machine (pipeline/turn_taking.py), which decides when a turn starts, is confirmed, paused,
resumed, interrupted or over. This module only carries those decisions out: it converts
protobuf, hands each turn to llm and tts through their Redis work queues (any worker takes it;
the reply comes back from the turn's token log and speech stream, each item once), paces the
reply's audio ahead of playback, and writes what the user heard into the session's history.
docs/architecture.md, "A live session", gives the order of events.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
from google.protobuf import json_format

from pipeline.audio import AudioStreamReader, PcmFormat
from pipeline.captions import (
    Cue,
    align_caption,
    caption_lines,
    cues_from_words,
    srt_document,
    webvtt_block,
    webvtt_document,
)
from pipeline.llm.prompts import Exchange
from pipeline.tts.phrases import PhraseCutter
from pipeline.turn_taking import (
    Action,
    AnnounceFinal,
    AudioSent,
    CancelTurn,
    ClientDone,
    ConfirmTurn,
    EndOfTurnScored,
    Event,
    Final,
    InterruptPlayback,
    Partial,
    PausePlayback,
    PlaybackReported,
    RecordExchange,
    ReplyDone,
    ResumePlayback,
    ScoreEndOfTurn,
    SpeechStarted,
    StartCaption,
    StartTurn,
    Tick,
    TurnOver,
    TurnTaking,
    VoiceEnded,
    VoiceStarted,
    WordTimed,
)
from services import session_config
from services.grpc_server import Service, StageClock, message_options, service_main, status_on_error
from services.protos import load, load_common
from services.redis_store import (
    REDIS_DOWN,
    TokenEntry,
    TokenStreamTimeout,
    TokenStreamWriter,
    now_ms,
    read_speech_stream,
    read_token_stream,
)
from services.runtime import RedisContext, open_redis
from services.server import limits, logs, metrics, tracing
from services.server.auth import INTERNAL_TENANT, TENANT
from services.server.limits import EventQueue
from services.settings import Settings
from services.store.work_queue import WorkQueue, turn_work

pb, pb_grpc = load("gateway")
asr_pb, asr_grpc = load("asr")
llm_pb, llm_grpc = load("llm")
tts_pb, tts_grpc = load("tts")
common = load_common()
log = logging.getLogger(__name__)
END = object()
PREPARE_TIMEOUT_S = 5.0  # llm's prefill of a session's conversation at its start (a stream's close waits for it)
TICK_S = 0.02  # timers of the turn-taking machine (held turns, playout, pauses) are this fine
# A stream's records are kept for its latest stretch only, so an hour-long stream holds no more than a
# short one: the arrival times of its latest audio (asked for the end of an utterance just transcribed),
# transcripts of its latest utterances (a turn reads its own at start and final), and the ids of its
# latest interrupted turns (whose queued speech, a few events behind, is dropped).
KEPT_AUDIO_S = 120.0
KEPT_UTTERANCES = 8
KEPT_UNHEARD_TURNS = 16
KIND = asr_pb.TranscriptEvent
Config = pb.SessionConfig
SPOKEN = frozenset({"reply_text", "audio", "cue", "word"})


class TurnFailed(Exception):
    """A stage ended the turn's log with an error (its request refused, or given up on)."""


# A turn fails on these and the conversation goes on: a stage's error, a log that stalled (no
# worker took the turn), Redis out of reach past its deadline.
TURN_FAILURES = (TurnFailed, TokenStreamTimeout, *REDIS_DOWN)


def _failure(error: BaseException) -> str:
    if isinstance(error, TokenStreamTimeout):
        return f"DEADLINE_EXCEEDED: {error}"
    if isinstance(error, TurnFailed):
        return str(error)
    return f"UNAVAILABLE: {error}"


class AudioArrivalClock:
    """Maps a time in the input audio to when the gateway received it (Unix ms).

    It keeps the last KEPT_AUDIO_S of audio: a stream open for an hour would otherwise hold two list
    entries per chunk (~6 MB an hour at 40 ms chunks)."""

    def __init__(self, fmt) -> None:
        declared = PcmFormat(fmt.sample_rate_hz, fmt.channels or 1, fmt.sample_width_bytes or 2)
        self.reader = AudioStreamReader(fmt.encoding, declared)
        self._audio_bytes = 0
        self._ends_s: list[float] = []
        self._arrivals_ms: list[int] = []

    def received(self, chunk: bytes) -> None:
        self._audio_bytes += len(self.reader.feed(chunk))
        if self.reader.format is not None:
            end_s = self._audio_bytes / self.reader.format.bytes_per_s
            self._ends_s.append(end_s)
            self._arrivals_ms.append(now_ms())
            if self._ends_s[0] < end_s - 2 * KEPT_AUDIO_S:  # dropped in halves: amortised O(1) a chunk
                cut = bisect.bisect_left(self._ends_s, end_s - KEPT_AUDIO_S)
                del self._ends_s[:cut], self._arrivals_ms[:cut]

    def arrival_ms(self, audio_s: float) -> int:
        i = bisect.bisect_left(self._ends_s, audio_s - 1e-6)
        return self._arrivals_ms[min(i, len(self._arrivals_ms) - 1)] if self._arrivals_ms else 0


@dataclass
class Stubs:
    asr: asr_grpc.AsrStub
    llm: llm_grpc.LlmStub
    tts: tts_grpc.TtsStub


@dataclass
class TurnWork:
    """One reply being written and spoken: its calls, its held-back output, its times."""

    turn_id: str
    user_text: str
    transcript: asr_pb.TranscriptEvent  # the utterance's final (or the partial it started from)
    speech_end_unix_ms: int
    clock: StageClock = field(default_factory=lambda: StageClock("gateway"))
    reply_text: str = ""
    finish_reason: str = ""
    error: str = ""
    first_audio_sent_unix_ms: int = 0
    stage_times: list = field(default_factory=list)
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)  # ServerEvents waiting to go out
    confirmed: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task] = field(default_factory=list)
    prefix_cached_tokens: int = 0
    mode: str = "dialogue"
    end_of_turn_ms: int = 0
    span: tracing.TurnSpan | None = None  # the turn's trace span; its context carries the ids logged
    first_phrase_unix_ms: int = 0  # when the reply text held a first phrase, as tts cuts it (metrics)
    phrases: PhraseCutter | None = None
    llm_done: bool = False  # the token log ended
    speech_done: bool = False  # the speech stream ended (or the turn has none: caption mode)
    llm_queued: bool = False  # the llm work is on its queue (else nothing will end the token log)
    stop_workers: Callable[[], None] | None = None  # tells the turn's workers through Redis

    def cancel(self) -> None:
        """Stop the turn here, and its llm and tts work wherever it runs (within a step or a piece)."""
        for task in self.tasks:
            task.cancel()
        # Dropped whether called or not: it closes over the turn (and the conversation), a cycle that
        # would wait for the cyclic collector instead of freeing the turn as soon as it is over.
        stop_workers, self.stop_workers = self.stop_workers, None
        if stop_workers is not None and not (self.llm_done and self.speech_done):
            stop_workers()


class Conversation:
    """The state of one Converse stream; events for the client go through `events`."""

    def __init__(self, servicer: GatewayServicer, start, config: Config) -> None:
        self.servicer = servicer
        self.settings = servicer.settings
        self.start = start
        self.config = config
        self.session_id = start.session_id
        self.arrivals = AudioArrivalClock(start.format)
        self.events = EventQueue(self.settings.limits.max_queued_events)  # bounded: a slow client is cut off
        options = self.settings.turn_taking
        self.machine = TurnTaking(dataclasses.replace(
            options, backchannels=session_config.backchannels(config, options.backchannels),
            backchannel_max_words=config.backchannel_max_words or options.backchannel_max_words,
        ), caption_mode=config.mode == Config.CAPTION)
        self.work: dict[str, TurnWork] = {}
        self.finals: dict[int, asr_pb.TranscriptEvent] = {}  # the latest transcript of each recent utterance
        self.budget_misses = 0
        # turns interrupted or cancelled: their queued speech is dropped
        self.unheard: collections.deque[str] = collections.deque(maxlen=KEPT_UNHEARD_TURNS)
        self.degradations = 0
        self._lock = asyncio.Lock()  # one event through the machine at a time, its actions in order
        self._input_error: Exception | None = None
        # Tasks nothing else holds: cancel keys being set, prepares, a finished turn's tasks winding down.
        self._background: set[asyncio.Task] = set()
        self._t0 = time.monotonic()
        self._asr_call = None
        self._asr_writes = asyncio.Lock()  # a gRPC stream takes one write at a time: audio, contexts
        self._expecting_backchannels = False
        self._context_writes: set[asyncio.Task] = set()
        self._words_to_prepare: str | None = None  # the newest partial's words, for the llm to prefill
        self._preparing_words = False
        metrics.track_conversation(self)

    def now_s(self) -> float:
        return time.monotonic() - self._t0

    async def run(self, client_messages: AsyncIterator) -> None:
        ticker = asyncio.create_task(self._tick())
        if self.config.mode != Config.CAPTION:
            self._in_background(self._prepare())
        try:
            call = self._asr_call = self.servicer.stubs.asr.Transcribe()
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
            await self.handle(ClientDone())
            while self.work:  # the last turns play out (the client has what it needs to play them)
                await asyncio.sleep(TICK_S)
            await self.events.put(END)
        except BaseException as e:  # delivered to the client's stream by Converse
            await self.events.put(e)
        finally:
            ticker.cancel()

    async def close(self) -> None:
        """The stream is over (or the client went away): nothing of it keeps running."""
        for work in list(self.work.values()):
            work.cancel()
            await asyncio.gather(*work.tasks, return_exceptions=True)
            work.span.end(finish_reason="closed")
        self.work.clear()
        await asyncio.gather(*self._background, return_exceptions=True)  # the workers are told before we go

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            await self.handle(Tick())

    async def _forward_audio(self, client_messages: AsyncIterator, call) -> None:
        """Client audio → asr, checked here so bad input fails the conversation with its own message;
        playback reports → the machine."""
        fmt = self.start.format
        try:
            await call.write(asr_pb.TranscribeRequest(config=asr_pb.StreamConfig(
                session_id=self.session_id, language=self.config.language, format=fmt)))
            async for message in client_messages:
                kind = message.WhichOneof("payload")
                if kind == "playback":
                    await self.handle(PlaybackReported(message.playback.turn_id, message.playback.played_until_s))
                    continue
                if kind != "audio":
                    raise ValueError("only audio and playback reports may follow the start message")
                self.arrivals.received(message.audio)
                async with self._asr_writes:
                    await call.write(asr_pb.TranscribeRequest(audio=message.audio))
            async with self._asr_writes:
                await call.done_writing()
        except (ValueError, grpc.aio.AioRpcError) as e:
            if not isinstance(e, grpc.aio.AioRpcError):
                self._input_error = e
            call.cancel()
        except asyncio.InvalidStateError:
            pass  # asr already ended the call; its status reaches run()

    async def _on_transcript(self, event: asr_pb.TranscriptEvent) -> None:
        kind = event.kind
        if kind in (KIND.PARTIAL, KIND.FINAL) and event.speech_end_s:
            limits.check_utterance(self.settings.limits, event.speech_start_s, event.speech_end_s)
        if kind == KIND.VOICE_STARTED:
            await self.handle(VoiceStarted())
        elif kind == KIND.VOICE_ENDED:
            await self.handle(VoiceEnded())
        elif kind == KIND.SPEECH_STARTED:
            await self.handle(SpeechStarted(event.utterance_index))
        elif kind == KIND.PARTIAL:
            await self.events.put(pb.ServerEvent(transcript=_transcript(event, final=False)))
            self._keep_transcript(event)
            if self.config.mode != Config.CAPTION and not event.speech_ending and event.text.strip():
                self._prepare_words(event.text)
            # The pass at the first silence is the one the final reuses (asr_stream), so its words,
            # committed or not, are the final's if the silence lasts: the reply may start from them.
            stable = self.settings.preemptive_generation and event.speech_ending and bool(event.text.strip())
            await self.handle(Partial(event.utterance_index, event.text, stable))
        elif kind == KIND.FINAL:
            self._keep_transcript(event)
            words = tuple((w.text, w.probability) for w in event.words)
            await self.handle(Final(event.utterance_index, event.text, words))

    def _keep_transcript(self, event: asr_pb.TranscriptEvent) -> None:
        self.finals[event.utterance_index] = event
        for old in [u for u in self.finals if u <= event.utterance_index - KEPT_UTTERANCES]:
            del self.finals[old]

    async def handle(self, event: Event) -> None:
        async with self._lock:
            for action in self.machine.handle(event, self.now_s()):
                await self._act(action)

    async def _act(self, action: Action) -> None:
        if isinstance(action, StartTurn | StartCaption):
            try:  # the conversation's length: past it the stream ends (from whichever task acts)
                await limits.count_turn(self.servicer.redis.client, self.settings.limits, self.session_id,
                                        self.settings.session_ttl_s)
            except limits.LimitExceededError as e:
                self.events.put_nowait(e)
                return
        if isinstance(action, StartTurn):
            await self._start_turn(action)
        elif isinstance(action, ScoreEndOfTurn):
            self._score_end_of_turn(action)
        elif isinstance(action, AnnounceFinal):
            self._announce_final(action)
        elif isinstance(action, ConfirmTurn):
            if work := self.work.get(action.turn_id):
                work.confirmed.set()
        elif isinstance(action, CancelTurn):
            if work := self.work.get(action.turn_id):
                work.cancel()
        elif isinstance(action, PausePlayback):
            self._control(action.turn_id, pause=pb.Pause(at_s=action.at_s))
            self._expect_backchannels(True)
        elif isinstance(action, ResumePlayback):
            self._control(action.turn_id, resume=pb.Resume(from_s=action.from_s, reason=action.reason))
            self._expect_backchannels(False)
        elif isinstance(action, InterruptPlayback):
            self._control(action.turn_id, interrupt=pb.Interrupt(heard_until_s=action.heard_until_s,
                                                                 heard_text=action.heard_text))
            self._expect_backchannels(False)
        elif isinstance(action, RecordExchange):
            if action.heard_text.strip():
                await self.servicer.redis.sessions.append(
                    self.session_id, Exchange(action.user_text, action.heard_text.strip(), action.cut_off))
        elif isinstance(action, TurnOver):
            self._turn_over(action)
        elif isinstance(action, StartCaption):
            await self._start_caption(action)

    def _expect_backchannels(self, expect: bool) -> None:
        """While the user speaks over the avatar, asr's whisper is prompted with the session's
        backchannels: it then writes a murmured "Mm-hmm." as such, not as "In a moment." (whisper
        tiny on the Piper voice), and the machine can tell it from an interruption."""
        if expect == self._expecting_backchannels or self._asr_call is None:
            return
        self._expecting_backchannels = expect
        phrases = self.machine.options.backchannels if expect else ()
        request = asr_pb.TranscribeRequest(context=asr_pb.Context(expected_phrases=phrases))
        task = asyncio.create_task(self._write_asr(request))
        self._context_writes.add(task)
        task.add_done_callback(self._context_writes.discard)

    async def _write_asr(self, request) -> None:
        async with self._asr_writes:
            with contextlib.suppress(asyncio.InvalidStateError, grpc.aio.AioRpcError):  # the call has ended
                await self._asr_call.write(request)

    def _control(self, turn_id: str, **event) -> None:
        """Playback control goes out at once, ahead of anything the turn has queued."""
        self.events.put_nowait(pb.ServerEvent(turn_id=turn_id, **event))

    # -- a dialogue turn -------------------------------------------------------------------

    async def _open_work(self, turn_id: str, user_text: str, utterance: int, mode: str) -> TurnWork:
        """A turn's Redis record (llm and tts check it), the session's expiry pushed ahead, its work."""
        transcript = self.finals[utterance]
        await self.servicer.redis.turns.create(self.session_id, turn_id)
        await self.servicer.redis.sessions.touch(self.session_id)
        work = TurnWork(turn_id, user_text, transcript, self.arrivals.arrival_ms(transcript.speech_end_s), mode=mode,
                        span=tracing.TurnSpan(self.session_id, turn_id, mode),
                        phrases=PhraseCutter(self.settings.phrases))
        work.clock.received()
        work.speech_done = mode == "caption"
        work.stop_workers = lambda: self._in_background(self._stop_workers(work))
        self.work[turn_id] = work
        return work

    async def _stop_workers(self, work: TurnWork) -> None:
        """The turn's cancel key, which its workers see at their next step or piece; a turn cancelled
        before its llm work was queued gets its token log ended here, so a tts worker tailing it stops."""
        redis = self.servicer.redis
        try:
            await redis.turns.cancel(work.turn_id)
            if not work.llm_queued:
                await TokenStreamWriter(redis.client, work.turn_id, self.settings.token_stream_ttl_s).append(
                    TokenEntry(0, (), "", 0, now_ms(), end=True, finish_reason="cancelled"))
        except REDIS_DOWN as e:  # its workers stop at their own timeouts instead
            log.warning("turn %s: could not tell its workers it is cancelled: %s", work.turn_id, e)

    def _in_background(self, awaitable) -> None:
        self._hold(asyncio.create_task(awaitable))

    def _hold(self, task: asyncio.Task) -> None:
        """Keep a task referenced until it is done: the event loop holds tasks only weakly, and a
        pending one collected with what it waits on never runs its `finally` (asyncio then logs
        "Task was destroyed but it is pending!"); `close` waits for them."""
        if not task.done():
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _start_turn(self, action: StartTurn) -> None:
        work = await self._open_work(action.turn_id, action.user_text, action.utterance, "dialogue")
        work.tasks.append(asyncio.create_task(self._run_turn(work), context=work.span.context()))

    def _budget(self, work: TurnWork):
        budget_ms = self.config.budget_ms
        return common.TurnBudget(budget_ms=budget_ms, speech_end_unix_ms=work.speech_end_unix_ms,
                                 deadline_unix_ms=work.speech_end_unix_ms + budget_ms)

    async def _run_turn(self, work: TurnWork) -> None:
        """The turn's work goes on the llm and tts queues (any worker may take it); the reply's text
        comes back from its token log, its speech from its speech stream, each item once."""
        c = self.config
        request = llm_pb.ReplyRequest(
            session_id=self.session_id, turn_id=work.turn_id, user_text=work.user_text,
            task=llm_pb.ReplyRequest.DIALOGUE, defer_history=True, max_new_tokens=c.max_reply_tokens,
            drafter=c.drafter, system_prompt=c.system_prompt, budget=self._budget(work))
        if c.HasField("sampling"):
            request.sampling.CopyFrom(c.sampling)
        await self._enqueue("tts", work, tts_pb.SpeakTurnRequest(
            session_id=self.session_id, turn_id=work.turn_id, sample_rate_hz=c.reply_sample_rate_hz,
            voice=c.voice, budget=self._budget(work)))
        sender = asyncio.create_task(self._send_paced(work))
        self._hold(sender)
        try:
            await asyncio.gather(self._pump_reply(work, request), self._pump_speech(work))
            await work.outbox.put(END)
            await sender
            await self.handle(ReplyDone(work.turn_id, work.finish_reason))
        except asyncio.CancelledError:
            work.finish_reason = work.finish_reason or "cancelled"
            raise
        except TURN_FAILURES as e:  # the turn fails, the conversation goes on
            log.warning("turn %s failed: %s", work.turn_id, e)
            work.finish_reason, work.error = "error", _failure(e)
            await self.handle(ReplyDone(work.turn_id, "error"))
        finally:
            sender.cancel()

    async def _enqueue(self, stage: str, work: TurnWork, request) -> None:
        """Hand a stage the turn's work, with the turn's trace context (its span is the work's parent)."""
        await self.servicer.queues[stage].add(turn_work(work.turn_id, request, **tracing.carrier()))

    async def _pump_reply(self, work: TurnWork, request) -> None:
        """The reply is queued at once, beside its end-of-turn score (asked first: the llm runs the
        score before the reply's prefill, which then reuses what the score prefilled)."""
        work.llm_queued = True
        await self._enqueue("llm", work, request)
        await self._read_reply(work)

    async def _read_reply(self, work: TurnWork) -> None:
        """The reply's text from its token log (each seq once, whichever worker wrote it)."""
        async for entry in read_token_stream(self.servicer.redis.client, work.turn_id, self.settings.token_timeout_s):
            work.reply_text += entry.text
            if entry.seq == 0:
                work.prefix_cached_tokens = int(entry.extra.get("cached", 0))
            if not work.first_phrase_unix_ms and (work.phrases.feed(entry.text) or entry.end):
                work.first_phrase_unix_ms = now_ms()
            if entry.text:
                await work.outbox.put(pb.ServerEvent(turn_id=work.turn_id, reply_text=pb.ReplyText(
                    text_delta=entry.text, accepted_tokens=entry.accepted)))
            if entry.end:
                _reply_ended(work, entry, "reply")

    async def _pump_speech(self, work: TurnWork) -> None:
        """The reply's speech from its speech stream: each chunk, word and cue once, by (phrase, index),
        however many tts workers had a hand in it. It may wait for the whole reply's first phrase."""
        wait_s = 2 * self.settings.token_timeout_s
        async for entry in read_speech_stream(self.servicer.redis.client, work.turn_id, wait_s):
            if entry.kind == "end":
                work.speech_done = True
                if entry.data.get("finish_reason") == "error":
                    raise TurnFailed(entry.data.get("error") or "tts: the speech failed")
                continue
            if not entry.event:
                continue  # a phrase's bookkeeping (begun, done): for a tts worker resuming it
            event = tts_pb.SpeechEvent.FromString(entry.event)
            kind = event.WhichOneof("event")
            if kind == "audio":
                await work.outbox.put(pb.ServerEvent(turn_id=work.turn_id, audio=event.audio))
            elif kind in ("cue", "word"):
                cue = common.CaptionCue()
                cue.CopyFrom(getattr(event, kind))
                cue.webvtt = webvtt_block(Cue(cue.start_s, cue.end_s, cue.text))
                if kind == "word":
                    await self.handle(WordTimed(work.turn_id, cue.text, cue.start_s, cue.end_s))
                await work.outbox.put(pb.ServerEvent(turn_id=work.turn_id, **{kind: cue}))
            elif kind == "times":
                work.stage_times.append(event.times)

    async def _send_paced(self, work: TurnWork) -> None:
        """The turn's output, once it is confirmed; audio at most `audio_lead_s` ahead of playback."""
        await work.confirmed.wait()
        while (event := await work.outbox.get()) is not END:
            if event.WhichOneof("event") == "audio":
                while self.machine.may_send_until_s(work.turn_id, self.now_s()) <= event.audio.start_s:
                    await asyncio.sleep(TICK_S)
                if not work.first_audio_sent_unix_ms:
                    work.first_audio_sent_unix_ms = now_ms()
                work.clock.emitted()
                await self.events.put(event)
                end_s = event.audio.start_s + len(event.audio.pcm_s16le) / 2 / event.audio.sample_rate_hz
                await self.handle(AudioSent(work.turn_id, end_s))
            else:
                work.clock.emitted()
                await self.events.put(event)

    def _score_end_of_turn(self, action: ScoreEndOfTurn) -> None:
        work = self.work.get(action.turn_id)
        if work is None:
            return
        if self.settings.turn_taking.end_of_turn_threshold <= 0:
            return  # silence alone decides: the machine confirms without a score
        work.tasks.append(asyncio.create_task(self._end_of_turn(work, action), context=work.span.context()))

    async def _prepare(self, user_text: str = "") -> None:
        """llm prefills the session's conversation while the user starts to speak (the first turn's
        score would otherwise prefill the persona), and the words heard so far while they speak (the
        turn's score and reply then prefill only the words said since); a failure costs only that time."""
        try:
            await self.servicer.stubs.llm.Prepare(llm_pb.PrepareRequest(
                session_id=self.session_id, system_prompt=self.config.system_prompt, user_text=user_text),
                timeout=PREPARE_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            log.info("llm could not prepare session %s: %s", self.session_id, e.details())

    def _prepare_words(self, text: str) -> None:
        """Ask llm to prefill a partial's words: one call at a time, the newest words next (a partial
        comes every ~200 ms; those overtaken by a newer one are never sent)."""
        self._words_to_prepare = text
        if not self._preparing_words:
            self._preparing_words = True
            self._in_background(self._prepare_newest_words())

    async def _prepare_newest_words(self) -> None:
        try:
            while (text := self._words_to_prepare) is not None:
                self._words_to_prepare = None
                await self._prepare(text)
        finally:
            self._preparing_words = False

    async def _end_of_turn(self, work: TurnWork, action: ScoreEndOfTurn) -> None:
        asked_ms = now_ms()
        try:
            score = await self.servicer.stubs.llm.EndOfTurn(llm_pb.EndOfTurnRequest(
                session_id=self.session_id, user_text=action.user_text, system_prompt=self.config.system_prompt))
            probability = score.probability
        except grpc.aio.AioRpcError as e:  # without a score the turn ends at the silence, as before
            log.warning("end-of-turn score failed, taking the turn as complete: %s", e.details())
            probability = 1.0
        finally:
            work.end_of_turn_ms = now_ms() - asked_ms
        await self.handle(EndOfTurnScored(action.turn_id, probability))

    def _announce_final(self, action: AnnounceFinal) -> None:
        work = self.work.get(action.turn_id)
        final = self.finals.get(action.utterance)
        if work is None or final is None:
            return
        work.transcript = final
        work.speech_end_unix_ms = self.arrivals.arrival_ms(final.speech_end_s)
        if final.HasField("times"):
            work.stage_times.insert(0, final.times)
        self.events.put_nowait(pb.ServerEvent(turn_id=work.turn_id, transcript=_transcript(final, final=True)))

    def _turn_over(self, over: TurnOver) -> None:
        work = self.work.pop(over.turn_id, None)
        if work is None:
            return
        work.cancel()
        for task in work.tasks:  # no longer reachable through self.work: held while they wind down
            self._hold(task)
        work.clock.emitted()
        voice_ms = work.first_audio_sent_unix_ms - work.speech_end_unix_ms if work.first_audio_sent_unix_ms else None
        missed = voice_ms is not None and voice_ms > self.config.budget_ms
        degradations = [pb.Degradation(name=name, stage=s.stage) for s in work.stage_times for name in s.degradations]
        self.budget_misses += missed
        self.degradations += len(degradations)
        counts = over.counts
        if over.finish_reason in ("interrupted", "cancelled"):
            self.unheard.append(over.turn_id)
        report = pb.TurnReport(
            transcript=work.user_text, reply_text=work.reply_text.strip(), speech_end_s=work.transcript.speech_end_s,
            speech_end_unix_ms=work.speech_end_unix_ms, first_audio_sent_unix_ms=work.first_audio_sent_unix_ms,
            stages=[*work.stage_times, work.clock.to_proto(common.StageTimes)], budget_ms=self.config.budget_ms,
            finish_reason=over.finish_reason, error=work.error, preemption=over.preemption,
            preemptions_kept=counts.preemptions_kept, preemptions_dropped=counts.preemptions_dropped,
            heard_text=over.heard_text, cut_off=over.cut_off, budget_missed=missed, degradations=degradations,
            pauses=over.pauses, resumes=over.resumes, interrupts=over.interrupts, session_pauses=counts.pauses,
            session_resumes=counts.resumes, session_interrupts=counts.interrupts,
            session_budget_misses=self.budget_misses, session_degradations=self.degradations,
            end_of_turn_probability=over.end_of_turn_probability, mode=work.mode,
            prefix_cached_tokens=work.prefix_cached_tokens, end_of_turn_ms=work.end_of_turn_ms,
        )
        metrics.observe_turn(report, work.first_phrase_unix_ms)
        work.span.end(finish_reason=over.finish_reason, voice_to_voice_ms=voice_ms, budget_missed=missed)
        self.events.put_nowait(pb.ServerEvent(turn_id=work.turn_id, report=report))

    # -- caption mode ----------------------------------------------------------------------

    async def _start_caption(self, action: StartCaption) -> None:
        work = await self._open_work(action.turn_id, action.text, action.utterance, "caption")
        final = work.transcript
        if final.HasField("times"):
            work.stage_times.append(final.times)
        self.events.put_nowait(pb.ServerEvent(turn_id=work.turn_id, transcript=_transcript(final, final=True)))
        work.tasks.append(asyncio.create_task(self._run_caption(work), context=work.span.context()))

    async def _run_caption(self, work: TurnWork) -> None:
        """The transcript cleaned by the LLM, each caption word placed on the input's timeline."""
        try:
            request = llm_pb.ReplyRequest(session_id=self.session_id, turn_id=work.turn_id, user_text=work.user_text,
                                          task=llm_pb.ReplyRequest.CAPTION, drafter=self.config.drafter,
                                          max_new_tokens=self.config.max_reply_tokens, budget=self._budget(work))
            work.llm_queued = True
            await self._enqueue("llm", work, request)
            async for entry in read_token_stream(self.servicer.redis.client, work.turn_id,
                                                 self.settings.token_timeout_s):
                work.reply_text += entry.text
                if entry.end:
                    _reply_ended(work, entry, "caption")
            text = " ".join(work.reply_text.split()) or work.user_text
            words = list(work.transcript.words)
            cues = align_caption(text, words)
            lines = caption_lines(cues)
            formats = set(self.config.caption_formats)
            caption = pb.Caption(
                text=text, cues=[_cue(c) for c in cues], lines=[_cue(c) for c in lines],
                webvtt=webvtt_document(lines) if Config.WEBVTT in formats else "",
                srt=srt_document(lines) if Config.SRT in formats else "")
            work.clock.emitted()
            self.events.put_nowait(pb.ServerEvent(turn_id=work.turn_id, caption=caption))
        except TURN_FAILURES as e:
            work.finish_reason, work.error = "error", _failure(e)
        self._turn_over(TurnOver(work.turn_id, work.finish_reason or "eos", "", False, "", -1.0, 0, 0, 0,
                                 self.machine.counts))


def _reply_ended(work: TurnWork, entry: TokenEntry, what: str) -> None:
    """The token log's end entry: the turn's finish reason and the llm's times; an error fails the turn."""
    work.llm_done = True
    work.finish_reason = entry.finish_reason
    if "times" in entry.extra:
        work.stage_times.append(json_format.Parse(entry.extra["times"], common.StageTimes()))
    if entry.finish_reason == "error":
        raise TurnFailed(entry.extra.get("error") or f"llm: the {what} failed")


def _cue(c: Cue):
    return common.CaptionCue(start_s=c.start_s, end_s=c.end_s, text=c.text, webvtt=webvtt_block(c))


def _transcript(event: asr_pb.TranscriptEvent, final: bool) -> pb.Transcript:
    cues = [_cue(c) for c in cues_from_words(event.words)] if final else []
    return pb.Transcript(
        is_final=final, text=event.text, words=event.words, speech_start_s=event.speech_start_s,
        speech_end_s=event.speech_end_s, committed_text=event.committed_text,
        tentative_text=event.tentative_text, stability=event.stability,
        utterance_index=event.utterance_index, cues=cues,
    )


class GatewayServicer(pb_grpc.GatewayServicer):
    def __init__(self, settings: Settings, redis: RedisContext, stubs: Stubs) -> None:
        self.settings = settings
        self.redis = redis
        self.stubs = stubs  # asr's stream, llm's EndOfTurn score, llm's and tts's Capabilities
        # Producers only: turns go on the stages' queues, whichever worker takes them.
        self.queues = {stage: WorkQueue(redis.client, stage, f"gateway-{stage}", settings.work)
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

    async def CreateSession(self, request, context: grpc.aio.ServicerContext):
        async with status_on_error(context, "gateway"):
            config = pb.SessionConfig()
            config.CopyFrom(request.config)
            config.system_prompt = config.system_prompt or request.system_prompt
            resolved = session_config.resolve(config, await self.choices(), self.settings.turn_budget_ms)
            self._cap_reply_tokens(config.max_reply_tokens, resolved)
            session_id = await self.redis.sessions.create(resolved.system_prompt, session_config.to_json(resolved),
                                                          owner=TENANT.get())
            await limits.hold_session(self.redis.client, self.settings.limits, TENANT.get(), session_id,
                                      self.settings.session_ttl_s)
            return pb.Session(session_id=session_id, config=resolved)

    def _cap_reply_tokens(self, asked: int, resolved) -> None:
        """Past limits.max_reply_tokens an ask is refused and a default is capped."""
        limits.check_reply_tokens(self.settings.limits, asked)
        cap = self.settings.limits.max_reply_tokens
        if cap and resolved.max_reply_tokens > cap:
            resolved.max_reply_tokens = cap

    async def Converse(self, request_iterator, context: grpc.aio.ServicerContext) -> AsyncIterator:
        async with status_on_error(context, "gateway"):
            start = await _first_start(request_iterator)
            logs.bind(session_id=start.session_id)
            tenant = TENANT.get()  # a session is the tenant's that made it (the cluster's credential: any)
            session = await self.redis.sessions.require(start.session_id,
                                                        owner=None if tenant == INTERNAL_TENANT else tenant)
            stored = session_config.from_json(session.get("config", ""))
            config = session_config.resolve(session_config.merged(stored, start.overrides), await self.choices(),
                                            self.settings.turn_budget_ms)
            self._cap_reply_tokens(start.overrides.max_reply_tokens, config)
            await limits.renew_session(self.redis.client, self.settings.limits, TENANT.get(), start.session_id,
                                       self.settings.session_ttl_s)
            conversation = Conversation(self, start, config)
            yield pb.ServerEvent(ready=pb.StreamReady(session_id=start.session_id, config=config))
            runner = asyncio.create_task(conversation.run(request_iterator))
            conversation.events.on_overflow = runner.cancel  # nothing more is made for a client that stopped reading
            try:
                while (event := await conversation.events.get()) is not END:
                    if conversation.events.overflowed:
                        raise conversation.events.error()
                    if isinstance(event, BaseException):
                        raise event
                    if event.turn_id in conversation.unheard and event.WhichOneof("event") in SPOKEN:
                        continue  # a barge-in: no audio of the old turn after its interrupt
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


async def build(settings: Settings) -> Service:
    """The gateway for run_service: its Redis and its channels to asr, llm and tts (TLS and the
    service credential from the settings, services/server/hooks.py)."""
    from services.server.hooks import internal_channel

    redis = await open_redis(settings)
    options = message_options(settings.max_message_bytes)
    channels = {name: internal_channel(settings, name, options) for name in ("asr", "llm", "tts")}
    stubs = Stubs(asr_grpc.AsrStub(channels["asr"]), llm_grpc.LlmStub(channels["llm"]),
                  tts_grpc.TtsStub(channels["tts"]))
    servicer = GatewayServicer(settings, redis, stubs)

    async def close() -> None:
        for channel in channels.values():
            await channel.close()
        await redis.close()

    return Service("gateway", lambda server: pb_grpc.add_GatewayServicer_to_server(servicer, server), close=close,
                   redis=redis.client)


if __name__ == "__main__":
    service_main(build)
