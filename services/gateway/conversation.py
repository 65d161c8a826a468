"""One live conversation: turn-taking carried out through narrow ports.

What the ASR hears, the client's playback reports and time passing go into the conversation's
turn-taking state machine (pipeline/turn_taking.py), which decides when a turn starts, is
confirmed, paused, resumed, interrupted or over. This class only carries those decisions out:
it hands each turn to the turn runner (llm and tts work, wherever it runs), reads the reply's
text and speech back, paces the audio ahead of playback, and records what the user heard. It
knows no transport and no store (services/gateway/ports.py); the gRPC `Converse` in
service.py and the Realtime WebSocket (realtime.py) are adapters onto it, the latter also driving
turns itself (typed words, commits, reply requests and cancels, truncates).
docs/architecture.md, "A live session", gives the order of events.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from pipeline.llm.prompts import Exchange
from pipeline.tts.phrases import PhraseCutter
from pipeline.turn_taking import (
    REQUESTED_UTTERANCE,
    Action,
    AnnounceFinal,
    AudioSent,
    CancelTurn,
    CaptionDone,
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
    ReplyCancelled,
    ReplyDone,
    ReplyRequested,
    ResumePlayback,
    ScoreEndOfTurn,
    SpeechStarted,
    StartCaption,
    StartTurn,
    Tick,
    TurnOver,
    TurnTaking,
    TurnTakingOptions,
    UserSaid,
    VoiceEnded,
    VoiceStarted,
    WordTimed,
    heard_text,
)
from services import session_config
from services.gateway import convert
from services.gateway.arrivals import AudioArrivalClock
from services.gateway.convert import Config, asr_pb, pb
from services.gateway.ports import (
    AsrStream,
    AsrStreamClosed,
    CancelReply,
    ClearAudio,
    ClientAudio,
    ClientInput,
    Clock,
    CommitAudio,
    EventSink,
    HeardUntil,
    InputCommitted,
    Reconfigure,
    ReplyPiece,
    RequestReply,
    SpeechEnd,
    TurnFailed,
    TurnRunner,
    TurnStarted,
    UserSpeech,
    UserText,
)
from services.server import limits, metrics, tracing
from services.server.stage_clock import StageClock
from services.settings import Settings

log = logging.getLogger(__name__)
END = object()  # the sink's last item: the conversation is over
TICK_S = 0.02  # timers of the turn-taking machine (held turns, playout, pauses) are this fine
# A stream's records are kept for its latest stretch only, so an hour-long stream holds no more than a
# short one: transcripts of its latest utterances (a turn reads its own at start and final), and the ids
# of its latest interrupted turns (whose queued speech, a few events behind, is dropped).
KEPT_UTTERANCES = 8
KEPT_UNHEARD_TURNS = 16
KIND = asr_pb.TranscriptEvent
# Turn detection off: a commit waits this long for the utterance still open to close (its final);
# past it the utterance's latest partial is taken.
COMMIT_WAIT_S = 2.0
NOTICES = (UserSpeech, InputCommitted, TurnStarted)  # sink items that are no gateway ServerEvent
SPOKEN = frozenset({"reply_text", "audio", "cue", "word", "viseme"})  # what of an interrupted turn is dropped


@dataclass
class TurnWork:
    """One reply being written and spoken (or one caption): its tasks, its held-back output, its times."""

    turn_id: str
    user_text: str
    transcript: Any  # the utterance's asr TranscriptEvent: its final (or the partial it started from)
    speech_end_unix_ms: int
    clock: StageClock = field(default_factory=lambda: StageClock("gateway"))
    instructions: str = ""  # this reply's own system prompt (RequestReply), empty for the session's
    reply_text: str = ""
    finish_reason: str = ""
    error: str = ""
    first_audio_sent_unix_ms: int = 0
    budget_missed: bool = False
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
    stop_workers: Callable[[], None] | None = None  # tells the turn's workers, wherever they run
    words: list[WordTimed] = field(default_factory=list)  # the reply's words on its timeline, as tts placed them

    def cancel(self) -> None:
        """Stop the turn here, and its llm and tts work wherever it runs (within a step or a piece)."""
        for task in self.tasks:
            task.cancel()
        # Dropped whether called or not: it closes over the turn (and the conversation), a cycle that
        # would wait for the cyclic collector instead of freeing the turn as soon as it is over.
        stop_workers, self.stop_workers = self.stop_workers, None
        if stop_workers is not None and not (self.llm_done and self.speech_done):
            stop_workers()


@dataclass(frozen=True)
class HeardReply:
    """A finished turn's exchange as the history holds it, and its words: a late truncate amends it."""

    user_text: str
    words: tuple[WordTimed, ...]
    heard_text: str  # as recorded ("": nothing recorded)
    cut_off: bool


@dataclass
class Ports:
    asr: AsrStream
    turns: TurnRunner
    sink: EventSink
    clock: Clock


class Conversation:
    """The state of one conversation. Drive it with `run(inputs)`; read what the client gets from `events()`."""

    def __init__(self, session_id: str, config: Any, audio_format: Any, settings: Settings, ports: Ports,
                 speech_notices: bool = False) -> None:
        self.session_id = session_id
        self.config = config
        self.settings = settings
        self.asr, self.turns, self.sink, self.clock = ports.asr, ports.turns, ports.sink, ports.clock
        self.arrivals = AudioArrivalClock(audio_format, self.clock)
        self.machine = TurnTaking(self._machine_options(settings.turn_taking),
                                  caption_mode=config.mode == Config.CAPTION)
        # The asr's voice and finals take turns (else only the client's commits and requests do).
        self.auto_turns = True
        self.speech_notices = speech_notices  # UserSpeech and InputCommitted go to the sink too
        self._controls: asyncio.Queue[ClientInput] = asyncio.Queue()  # client requests, carried out in order
        self._open_utterance: int | None = None  # speech started, its final not yet here
        self._uncommitted: list[str] = []  # turn detection off: finals not yet committed
        self._committed_early: collections.deque[int] = collections.deque(maxlen=KEPT_UTTERANCES)
        self.heard_replies: collections.OrderedDict[str, HeardReply] = collections.OrderedDict()
        self.work: dict[str, TurnWork] = {}
        self.finals: dict[int, Any] = {}  # the latest transcript of each recent utterance
        self.budget_misses = 0
        # turns interrupted or cancelled: their queued speech is dropped
        self.unheard: collections.deque[str] = collections.deque(maxlen=KEPT_UNHEARD_TURNS)
        self.degradations = 0
        self._lock = asyncio.Lock()  # one event through the machine at a time, its actions in order
        self._input_error: Exception | None = None
        # Tasks nothing else holds: cancels being told, prepares, a finished turn's tasks winding down.
        self._background: set[asyncio.Task] = set()
        self._expecting_backchannels = False
        self._words_to_prepare: str | None = None  # the newest partial's words, for the llm to prefill
        self._preparing_words = False
        self._provisional_words: dict[int, tuple[str, ...]] = {}  # caption mode: utterance -> committed words shown
        self._caption_slots = asyncio.Semaphore(max(1, settings.caption_turns_per_session))
        self._captions_end_s = -1.0  # caption mode: where the lines sent so far end (the next start after it)
        self._last_caption_placed: asyncio.Future | None = None  # caption mode: done once the newest turn's is placed
        self._requested_instructions = ""  # the system prompt of the reply the client asked for last (RequestReply)
        metrics.track_conversation(self)

    def now_s(self) -> float:
        return self.clock.now_s()

    def _machine_options(self, options: TurnTakingOptions) -> TurnTakingOptions:
        """The machine's options: the session's backchannels over `options`."""
        return dataclasses.replace(
            options, backchannels=session_config.backchannels(self.config, options.backchannels),
            backchannel_max_words=self.config.backchannel_max_words or options.backchannel_max_words)

    # -- the conversation's life -----------------------------------------------------------

    async def run(self, inputs: AsyncIterator[ClientInput]) -> None:
        """Until the client's input and the ASR stream end and the last turns play out; its end (or
        the error that ended it) goes to the sink."""
        ticker = asyncio.create_task(self._tick())
        controls = asyncio.create_task(self._carry_out_controls())
        if self.config.mode != Config.CAPTION:
            self._in_background(self.turns.prepare(""))  # the conversation so far, while the user starts
        try:
            forward = asyncio.create_task(self._forward(inputs))
            try:
                async for event in self.asr:
                    await self._on_transcript(event)
            except (Exception, asyncio.CancelledError):
                if self._input_error:  # bad client input ended the asr stream: say so, not "cancelled"
                    raise self._input_error from None
                raise
            finally:
                forward.cancel()
            await self.handle(ClientDone())
            while self.work:  # the last turns play out (the client has what it needs to play them)
                await self.clock.sleep(TICK_S)
            await self.sink.put(END)
        except BaseException as e:  # delivered to the client by events()
            await self.sink.put(e)
        finally:
            ticker.cancel()
            controls.cancel()

    async def events(self) -> AsyncIterator[Any]:
        """The client's events (gateway ServerEvents) in order until the end; raises what ended the
        conversation, or the sink's own failure (a client too slow to read)."""
        while (event := await self.sink.get()) is not END:
            if (failure := self.sink.failure()) is not None:
                raise failure
            if isinstance(event, BaseException):
                raise event
            if isinstance(event, NOTICES):
                yield event
                continue
            if event.turn_id in self.unheard and event.WhichOneof("event") in SPOKEN:
                continue  # a barge-in: no audio of the old turn after its interrupt
            yield event

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
            await self.clock.sleep(TICK_S)
            await self.handle(Tick())

    async def _forward(self, inputs: AsyncIterator[ClientInput]) -> None:
        """Client audio → asr, checked here so bad input fails the conversation with its own message;
        playback reports → the machine."""
        try:
            async for item in inputs:
                match item:
                    case PlaybackReported():
                        await self.handle(item)
                    case ClientAudio(data=data):
                        self.arrivals.received(data)
                        await self.asr.send_audio(data)
                    case Reconfigure():  # at once, in order with the audio: it decides what the next words do
                        self._reconfigure(item)
                    case _:  # a request: carried out in order, while the audio flows on (a commit waits for it)
                        self._controls.put_nowait(item)
            await self.asr.finish()
        except ValueError as e:
            self._input_error = e
            self.asr.cancel()
        except AsrStreamClosed:
            self.asr.cancel()  # asr ended the stream; its status reaches run()

    async def _on_transcript(self, event: Any) -> None:
        kind = event.kind
        if kind in (KIND.PARTIAL, KIND.FINAL) and event.speech_end_s:
            limits.check_utterance(self.settings.limits, event.speech_start_s, event.speech_end_s)
        if kind == KIND.VOICE_STARTED and self.auto_turns:
            await self.handle(VoiceStarted())
        elif kind == KIND.VOICE_ENDED and self.auto_turns:
            await self.handle(VoiceEnded())
        elif kind == KIND.SPEECH_STARTED:
            self._open_utterance = event.utterance_index
            self._notice(UserSpeech(event.utterance_index, True, event.speech_start_s))
            if self.auto_turns:
                await self.handle(SpeechStarted(event.utterance_index))
        elif kind == KIND.PARTIAL:
            await self.sink.put(pb.ServerEvent(transcript=convert.transcript(event, final=False)))
            self._keep_transcript(event)
            if self.config.mode != Config.CAPTION and not event.speech_ending and event.text.strip():
                self._prepare_words(event.text)
            if self.config.mode == Config.CAPTION:
                self._provisional_caption(event)
            # The pass at the first silence is the one the final reuses (asr_stream), so its words,
            # committed or not, are the final's if the silence lasts: the reply may start from them.
            stable = self.settings.preemptive_generation and event.speech_ending and bool(event.text.strip())
            if self.auto_turns:
                await self.handle(Partial(event.utterance_index, event.text, stable))
        elif kind == KIND.FINAL:
            self._keep_transcript(event)
            if self._open_utterance == event.utterance_index:
                self._open_utterance = None
            if self.auto_turns:
                words = tuple((w.text, w.probability) for w in event.words)
                await self.handle(Final(event.utterance_index, event.text, words))
            elif event.text.strip() and event.utterance_index not in self._committed_early:
                self._uncommitted.append(event.text.strip())
            self._notice(UserSpeech(event.utterance_index, False, event.speech_end_s, event.text.strip()))

    def _provisional_caption(self, partial: Any) -> None:
        """Caption mode: the utterance's committed words, each time they change (more of them, or, at the
        partial that hears the speech end, the final's words in their place)."""
        committed = list(partial.words[: partial.committed_words])
        shown = tuple(w.text for w in committed)
        if committed and shown != self._provisional_words.get(partial.utterance_index):
            self._provisional_words[partial.utterance_index] = shown
            caption = convert.provisional_caption(partial.utterance_index, committed, self.settings.captions)
            self.sink.put_nowait(pb.ServerEvent(caption=caption))

    def _notice(self, notice: UserSpeech | InputCommitted | TurnStarted) -> None:
        if self.speech_notices:
            self.sink.put_nowait(notice)

    def _keep_transcript(self, event: Any) -> None:
        self.finals[event.utterance_index] = event
        for old in [u for u in self.finals if u <= event.utterance_index - KEPT_UTTERANCES]:
            del self.finals[old]

    # -- the machine's decisions -----------------------------------------------------------

    async def handle(self, event: Event) -> None:
        async with self._lock:
            for action in self.machine.handle(event, self.now_s()):
                await self._act(action)

    async def _act(self, action: Action) -> None:
        match action:
            case StartTurn():
                await self._start_turn(action)
            case StartCaption():
                await self._start_caption(action)
            case ScoreEndOfTurn():
                self._score_end_of_turn(action)
            case AnnounceFinal():
                self._announce_final(action)
            case ConfirmTurn(turn_id=turn_id):
                if work := self.work.get(turn_id):
                    work.confirmed.set()
            case CancelTurn(turn_id=turn_id):
                if work := self.work.get(turn_id):
                    work.cancel()
            case PausePlayback():
                self._control(action.turn_id, pause=pb.Pause(at_s=action.at_s))
                self._expect_backchannels(True)
            case ResumePlayback():
                self._control(action.turn_id, resume=pb.Resume(from_s=action.from_s, reason=action.reason))
                self._expect_backchannels(False)
            case InterruptPlayback():
                self._control(action.turn_id, interrupt=pb.Interrupt(heard_until_s=action.heard_until_s,
                                                                     heard_text=action.heard_text))
                self._expect_backchannels(False)
            case RecordExchange():
                if action.heard_text.strip():
                    await self.turns.record(Exchange(action.user_text, action.heard_text.strip(), action.cut_off))
            case TurnOver():
                self._turn_over(action)

    def _expect_backchannels(self, expect: bool) -> None:
        """While the user speaks over the avatar, asr's whisper is prompted with the session's
        backchannels: it then writes a murmured "Mm-hmm." as such, not as "In a moment." (whisper
        tiny on the Piper voice), and the machine can tell it from an interruption."""
        if expect == self._expecting_backchannels:
            return
        self._expecting_backchannels = expect
        self._in_background(self.asr.expect_phrases(self.machine.options.backchannels if expect else ()))

    def _control(self, turn_id: str, **event: Any) -> None:
        """Playback control goes out at once, ahead of anything the turn has queued."""
        self.sink.put_nowait(pb.ServerEvent(turn_id=turn_id, **event))

    def _in_background(self, awaitable: Any) -> None:
        self._hold(asyncio.create_task(awaitable))

    def _hold(self, task: asyncio.Task) -> None:
        """Keep a task referenced until it is done: the event loop holds tasks only weakly, and a
        pending one collected with what it waits on never runs its `finally` (asyncio then logs
        "Task was destroyed but it is pending!"); `close` waits for them."""
        if not task.done():
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    # -- a turn's work ---------------------------------------------------------------------

    async def _open_work(self, turn_id: str, user_text: str, utterance: int, mode: str) -> TurnWork | None:
        """The turn's record (past the session's turn limit the conversation ends instead), its work."""
        if utterance == REQUESTED_UTTERANCE:  # asked for by the client: its budget runs from the request
            transcript, asked_ms = asr_pb.TranscriptEvent(kind=KIND.FINAL, text=user_text), self.clock.unix_ms()
        else:
            transcript = self.finals[utterance]
            asked_ms = self.arrivals.arrival_ms(transcript.speech_end_s)
        try:
            await self.turns.open(turn_id)
        except limits.LimitExceededError as e:  # the conversation's length: past it the stream ends
            self.sink.put_nowait(e)
            return None
        work = TurnWork(turn_id, user_text, transcript, asked_ms, mode=mode,
                        span=tracing.TurnSpan(self.session_id, turn_id, mode),
                        phrases=PhraseCutter(self.settings.phrases))
        work.clock.received()
        work.speech_done = mode == "caption"
        work.stop_workers = lambda: self._in_background(self.turns.cancel(work.turn_id, work.llm_queued))
        self.work[turn_id] = work
        return work

    async def _start_turn(self, action: StartTurn) -> None:
        self._notice(TurnStarted(action.turn_id, action.utterance == REQUESTED_UTTERANCE))
        work = await self._open_work(action.turn_id, action.user_text, action.utterance, "dialogue")
        if work is not None and action.utterance == REQUESTED_UTTERANCE:
            work.instructions, self._requested_instructions = self._requested_instructions, ""
        if work is not None:
            work.tasks.append(asyncio.create_task(self._run_turn(work), context=work.span.context()))

    async def _run_turn(self, work: TurnWork) -> None:
        """The turn's llm and tts work is started (wherever it runs); the reply's text and speech come
        back each item once, and go out paced once the turn is confirmed."""
        await self.turns.start_speech(work.turn_id, convert.speak_request(
            self.config, self.session_id, work.turn_id, work.speech_end_unix_ms))
        sender = asyncio.create_task(self._send_paced(work))
        self._hold(sender)
        try:
            await asyncio.gather(self._pump_reply(work), self._pump_speech(work))
            await work.outbox.put(END)
            await sender
            await self.handle(ReplyDone(work.turn_id, work.finish_reason))
        except asyncio.CancelledError:
            work.finish_reason = work.finish_reason or "cancelled"
            raise
        except TurnFailed as e:  # the turn fails, the conversation goes on
            log.warning("turn %s failed: %s", work.turn_id, e)
            work.finish_reason, work.error = "error", str(e)
            await self.handle(ReplyDone(work.turn_id, "error"))
        finally:
            sender.cancel()

    async def _reply_pieces(self, work: TurnWork, what: str) -> AsyncIterator[ReplyPiece]:
        """The one reader of a turn's token log, for replies and captions: the text gathered, the
        end's finish reason and llm times kept; an end with an error fails the turn."""
        async for piece in self.turns.reply(work.turn_id):
            work.reply_text += piece.text
            if piece.first:
                work.prefix_cached_tokens = piece.cached_tokens
            if piece.end:
                work.llm_done = True
                work.finish_reason = piece.finish_reason
                if piece.times is not None:
                    work.stage_times.append(piece.times)
                if piece.finish_reason == "error":
                    raise TurnFailed(piece.error or f"llm: the {what} failed")
            yield piece

    async def _pump_reply(self, work: TurnWork) -> None:
        """The reply is queued at once, beside its end-of-turn score (asked first: the llm runs the
        score before the reply's prefill, which then reuses what the score prefilled)."""
        work.llm_queued = True
        request = convert.reply_request(self.config, self.session_id, work.turn_id, work.user_text,
                                        work.speech_end_unix_ms, "dialogue")
        if work.instructions:
            request.system_prompt = work.instructions
        await self.turns.start_reply(work.turn_id, request)
        async for piece in self._reply_pieces(work, "reply"):
            if not work.first_phrase_unix_ms and (work.phrases.feed(piece.text) or piece.end):
                work.first_phrase_unix_ms = self.clock.unix_ms()
            if piece.text:
                await work.outbox.put(pb.ServerEvent(turn_id=work.turn_id, reply_text=pb.ReplyText(
                    text_delta=piece.text, accepted_tokens=piece.accepted)))

    async def _pump_speech(self, work: TurnWork) -> None:
        """The reply's speech: each chunk, word and cue once, however many tts workers had a hand in it."""
        async for item in self.turns.speech(work.turn_id):
            if isinstance(item, SpeechEnd):
                work.speech_done = True
                if item.finish_reason == "error":
                    raise TurnFailed(item.error or "tts: the speech failed")
                continue
            kind = item.WhichOneof("event")
            if kind == "audio":
                await work.outbox.put(pb.ServerEvent(turn_id=work.turn_id, audio=item.audio))
            elif kind in ("cue", "word"):
                cue = convert.speech_cue(getattr(item, kind))
                if kind == "word":
                    word = WordTimed(work.turn_id, cue.text, cue.start_s, cue.end_s)
                    work.words.append(word)
                    await self.handle(word)
                await work.outbox.put(pb.ServerEvent(turn_id=work.turn_id, **{kind: cue}))
            elif kind == "viseme":  # on the audio's timeline, just before the chunk it starts in
                await work.outbox.put(pb.ServerEvent(turn_id=work.turn_id, viseme=item.viseme))
            elif kind == "times":
                work.stage_times.append(item.times)

    async def _send_paced(self, work: TurnWork) -> None:
        """The turn's output, once it is confirmed; audio at most `audio_lead_s` ahead of playback."""
        await work.confirmed.wait()
        visemes: list[Any] = []  # held for the audio chunk they start in: they go out with it, or not at all
        while (event := await work.outbox.get()) is not END:
            if event.WhichOneof("event") == "viseme":
                visemes.append(event)
            elif event.WhichOneof("event") == "audio":
                while self.machine.may_send_until_s(work.turn_id, self.now_s()) <= event.audio.start_s:
                    await self.clock.sleep(TICK_S)
                if not work.first_audio_sent_unix_ms:
                    work.first_audio_sent_unix_ms = self.clock.unix_ms()
                work.clock.emitted()
                for viseme in visemes:
                    await self.sink.put(viseme)
                visemes.clear()
                await self.sink.put(event)
                end_s = event.audio.start_s + len(event.audio.pcm_s16le) / 2 / event.audio.sample_rate_hz
                await self.handle(AudioSent(work.turn_id, end_s))
            else:
                work.clock.emitted()
                await self.sink.put(event)
        for viseme in visemes:  # after the last chunk (a phrase's silent tail): at the end
            await self.sink.put(viseme)

    def _score_end_of_turn(self, action: ScoreEndOfTurn) -> None:
        work = self.work.get(action.turn_id)
        if work is None:
            return
        threshold = self.machine.options.end_of_turn_threshold
        if threshold <= 0 or threshold > 1:
            return  # silence alone decides (at once, or after incomplete_wait_s): the machine needs no score
        work.tasks.append(asyncio.create_task(self._end_of_turn(work, action), context=work.span.context()))

    async def _end_of_turn(self, work: TurnWork, action: ScoreEndOfTurn) -> None:
        asked_ms = self.clock.unix_ms()
        try:
            probability = await self.turns.end_of_turn(action.user_text)
        finally:
            work.end_of_turn_ms = self.clock.unix_ms() - asked_ms
        await self.handle(EndOfTurnScored(action.turn_id, probability))

    def _prepare_words(self, text: str) -> None:
        """Ask llm to prefill a partial's words: one call at a time, the newest words next (a partial
        comes every ~200 ms; those overtaken by a newer one are never sent). llm prefills the session's
        conversation as the stream starts (the first turn's score would otherwise prefill the persona),
        and the words heard so far while the user speaks (the turn's score and reply then prefill only
        the words said since); a failure costs only that time."""
        self._words_to_prepare = text
        if not self._preparing_words:
            self._preparing_words = True
            self._in_background(self._prepare_newest_words())

    async def _prepare_newest_words(self) -> None:
        try:
            while (text := self._words_to_prepare) is not None:
                self._words_to_prepare = None
                await self.turns.prepare(text)
        finally:
            self._preparing_words = False

    def _announce_final(self, action: AnnounceFinal) -> None:
        work = self.work.get(action.turn_id)
        final = self.finals.get(action.utterance)
        if work is None or final is None:
            return
        work.transcript = final
        work.speech_end_unix_ms = self.arrivals.arrival_ms(final.speech_end_s)
        if final.HasField("times"):
            work.stage_times.insert(0, final.times)
        self.sink.put_nowait(pb.ServerEvent(turn_id=work.turn_id, transcript=convert.transcript(final, final=True)))

    def _turn_over(self, over: TurnOver) -> None:
        work = self.work.pop(over.turn_id, None)
        if work is None:
            return
        work.cancel()
        for task in work.tasks:  # no longer reachable through self.work: held while they wind down
            self._hold(task)
        work.clock.emitted()
        voice_ms = work.first_audio_sent_unix_ms - work.speech_end_unix_ms if work.first_audio_sent_unix_ms else None
        work.budget_missed = voice_ms is not None and voice_ms > self.config.budget_ms
        self.budget_misses += work.budget_missed
        self.degradations += sum(len(s.degradations) for s in work.stage_times)
        if over.finish_reason in ("interrupted", "cancelled"):
            self.unheard.append(over.turn_id)
        if work.mode == "dialogue":
            self.heard_replies[over.turn_id] = HeardReply(work.user_text, tuple(work.words), over.heard_text.strip(),
                                                          over.cut_off)
            while len(self.heard_replies) > KEPT_UNHEARD_TURNS:
                self.heard_replies.popitem(last=False)
        report = convert.turn_report(work, over, self.config, self.budget_misses, self.degradations)
        metrics.observe_turn(report, work.first_phrase_unix_ms)
        work.span.end(finish_reason=over.finish_reason, voice_to_voice_ms=voice_ms, budget_missed=work.budget_missed)
        self.sink.put_nowait(pb.ServerEvent(turn_id=work.turn_id, report=report))

    # -- the client's requests (a protocol with client-driven turns) -------------------------

    async def _carry_out_controls(self) -> None:
        """The client's requests in the order it made them; one that fails is logged, the conversation goes on."""
        while True:
            item = await self._controls.get()
            try:
                await self._carry_out(item)
            except Exception as e:  # noqa: BLE001 - a history amend with the store away, say
                log.warning("session %s: %s failed: %s", self.session_id, type(item).__name__, e)

    async def _carry_out(self, item: ClientInput) -> None:
        match item:
            case UserText(text=text):
                await self.handle(UserSaid(text))
            case CommitAudio():
                await self._commit()
            case ClearAudio():
                self._uncommitted.clear()
                if self._open_utterance is not None:
                    self._committed_early.append(self._open_utterance)
            case RequestReply(instructions=instructions):
                self._requested_instructions = instructions
                await self.handle(ReplyRequested())
            case CancelReply():
                await self.handle(ReplyCancelled())
            case HeardUntil():
                await self._heard_until(item)

    def _reconfigure(self, item: Reconfigure) -> None:
        self.config, self.auto_turns = item.config, item.auto_turns
        self.turns.configure(item.config)
        self.machine.options = self._machine_options(item.turn_taking)

    async def _commit(self) -> None:
        """Turn detection off: the speech so far becomes the user's words (an utterance still open is
        waited for up to COMMIT_WAIT_S, then taken as its latest partial has it)."""
        waited_s = 0.0
        while self._open_utterance is not None and waited_s < COMMIT_WAIT_S:
            await self.clock.sleep(TICK_S)
            waited_s += TICK_S
        words = list(self._uncommitted)
        if (open_utterance := self._open_utterance) is not None:
            if (partial := self.finals.get(open_utterance)) is not None and partial.text.strip():
                words.append(partial.text.strip())
            self._committed_early.append(open_utterance)  # its final, later, is not taken again
        self._uncommitted.clear()
        text = " ".join(words)
        self._notice(InputCommitted(text))
        if text:
            await self.handle(UserSaid(text))

    async def _heard_until(self, item: HeardUntil) -> None:
        """A reply still playing ends where the client stopped it; one over has its history amended to
        the words heard there (the machine recorded its own estimate at the interruption)."""
        current = self.machine.turn
        if current is not None and current.turn_id == item.turn_id:
            await self.handle(PlaybackReported(item.turn_id, item.heard_until_s))
            await self.handle(ReplyCancelled())
            return
        reply = self.heard_replies.get(item.turn_id)
        if reply is None:
            return
        heard = heard_text(list(reply.words), item.heard_until_s)
        if heard == reply.heard_text:
            return
        # An interrupted reply stays cut off however much of what was spoken the client heard; a finished one
        # is cut off where the client heard less than all of it.
        cut_off = reply.cut_off or heard != heard_text(list(reply.words), float("inf"))
        await self.turns.amend(Exchange(reply.user_text, reply.heard_text, reply.cut_off) if reply.heard_text else None,
                               Exchange(reply.user_text, heard, cut_off) if heard else None)
        self.heard_replies[item.turn_id] = dataclasses.replace(reply, heard_text=heard, cut_off=cut_off)

    # -- caption mode ----------------------------------------------------------------------

    async def _start_caption(self, action: StartCaption) -> None:
        work = await self._open_work(action.turn_id, action.text, action.utterance, "caption")
        if work is None:
            return
        final = work.transcript
        if final.HasField("times"):
            work.stage_times.append(final.times)
        self.sink.put_nowait(pb.ServerEvent(turn_id=work.turn_id, transcript=convert.transcript(final, final=True)))
        earlier_placed, placed = self._last_caption_placed, asyncio.get_running_loop().create_future()
        self._last_caption_placed = placed
        work.tasks.append(asyncio.create_task(self._run_caption(work, earlier_placed, placed),
                                              context=work.span.context()))

    async def _run_caption(self, work: TurnWork, earlier_placed: asyncio.Future | None,
                           placed: asyncio.Future) -> None:
        """The transcript cleaned by the llm, each caption word placed on the input's timeline; the
        turn ends through the machine (CaptionDone). Utterances are cleaned side by side but placed in
        the order they were spoken (`earlier_placed`, then `placed`): a later one cleaned first would
        otherwise take the timeline first and push the earlier one's cues after its own."""
        try:
            await self._clean_and_place_caption(work, earlier_placed)
        finally:
            if not placed.done():
                placed.set_result(None)
        await self.handle(CaptionDone(work.turn_id, work.finish_reason or "eos"))

    async def _clean_and_place_caption(self, work: TurnWork, earlier_placed: asyncio.Future | None) -> None:
        try:
            async with self._caption_slots:
                work.llm_queued = True
                await self.turns.start_reply(work.turn_id, convert.reply_request(
                    self.config, self.session_id, work.turn_id, work.user_text, work.speech_end_unix_ms, "caption"))
                async for _ in self._reply_pieces(work, "caption"):
                    pass
            if earlier_placed is not None:
                await asyncio.shield(earlier_placed)
            # a caption cut at its token limit would lose the words after the cut: the transcript says them all
            cut = work.finish_reason == "length"
            text = " ".join((work.user_text if cut else work.reply_text).split()) or work.user_text
            caption = convert.caption(text, list(work.transcript.words), self.config, self.settings.captions,
                                      self._captions_end_s + self.settings.captions.min_gap_s)
            if caption.lines:
                self._captions_end_s = max(self._captions_end_s, caption.lines[-1].end_s)
            caption.utterance_index = work.transcript.utterance_index
            self._provisional_words.pop(caption.utterance_index, None)
            work.clock.emitted()
            self.sink.put_nowait(pb.ServerEvent(turn_id=work.turn_id, caption=caption))
        except TurnFailed as e:
            work.finish_reason, work.error = "error", str(e)
