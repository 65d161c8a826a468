"""A Conversation wired to in-memory fakes of its ports (Pipecat's style of pipeline test): push
what the ASR hears and what the client reports, move a virtual clock, assert what comes out. No
Redis, no models, no servers: the transport-free core of the gateway, in milliseconds a test.
tests/e2e/test_conversation.py drives the same object through the real stack."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from pipeline.audio import PcmFormat, wav_bytes
from pipeline.turn_taking import PlaybackReported
from services.gateway import convert
from services.gateway.arrivals import AudioArrivalClock
from services.gateway.conversation import KEPT_UNHEARD_TURNS, KEPT_UTTERANCES, Conversation, Ports
from services.gateway.convert import Config, asr_pb, common, llm_pb, pb, tts_pb
from services.gateway.ports import AsrStreamClosed, ClientAudio, ReplyPiece, SpeechEnd, TurnFailed
from services.server.limits import LimitExceededError
from services.settings import Settings

KIND = asr_pb.TranscriptEvent
PCM16K = common.AudioFormat(encoding=common.AudioFormat.PCM_S16LE, sample_rate_hz=16_000, channels=1,
                            sample_width_bytes=2)
REPLY_RATE = 16_000
CHUNK_S = 0.5


async def settle(rounds: int = 30) -> None:
    """Let every task that can run, run."""
    for _ in range(rounds):
        await asyncio.sleep(0)


class FakeClock:
    """Virtual time: sleepers wake only when the test advances the clock."""

    def __init__(self) -> None:
        self.t = 0.0
        self._sleepers: list[tuple[float, int, asyncio.Future]] = []
        self._order = itertools.count()

    def now_s(self) -> float:
        return self.t

    EPOCH_MS = 1_700_000_000_000

    def unix_ms(self) -> int:
        return self.EPOCH_MS + round(self.t * 1000)

    async def sleep(self, seconds: float) -> None:
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.t + seconds, next(self._order), future))
        await future

    async def advance(self, seconds: float, step_s: float = 0.01) -> None:
        end = self.t + seconds
        while self.t < end - 1e-9:
            self.t = min(end, self.t + step_s)
            while self._sleepers and self._sleepers[0][0] <= self.t + 1e-9:
                _, _, future = heapq.heappop(self._sleepers)
                if not future.done():
                    future.set_result(None)
            await settle()


class FakeAsr:
    """The ASR stream: the test says what it hears; what the conversation writes is kept."""

    def __init__(self) -> None:
        self.heard: asyncio.Queue = asyncio.Queue()
        self.audio: list[bytes] = []
        self.expected_phrases: list[tuple[str, ...]] = []
        self.finished = self.cancelled = False

    async def send_audio(self, chunk: bytes) -> None:
        if self.finished or self.cancelled:
            raise AsrStreamClosed("asr stream over")
        self.audio.append(chunk)

    async def expect_phrases(self, phrases: tuple[str, ...]) -> None:
        self.expected_phrases.append(tuple(phrases))

    async def finish(self) -> None:
        self.finished = True
        self.heard.put_nowait(None)

    def cancel(self) -> None:
        self.cancelled = True
        self.heard.put_nowait(asyncio.CancelledError())

    async def __aiter__(self) -> AsyncIterator[Any]:
        while (event := await self.heard.get()) is not None:
            if isinstance(event, BaseException):
                raise event
            yield event


def words(text: str, start_s: float = 1.0, probability: float = 0.9) -> list:
    return [common.Word(text=w, start_s=start_s + 0.3 * i, end_s=start_s + 0.3 * i + 0.25, probability=probability)
            for i, w in enumerate(text.split())]


def final(utterance: int, text: str, probability: float = 0.9, start_s: float = 1.0) -> Any:
    ws = words(text, start_s, probability=probability)
    return asr_pb.TranscriptEvent(kind=KIND.FINAL, utterance_index=utterance, text=text, words=ws,
                                  speech_start_s=ws[0].start_s if ws else 0.0, speech_end_s=ws[-1].end_s if ws else 0.0,
                                  stability=1.0)


def kind_only(kind: int, utterance: int = 0) -> Any:
    return asr_pb.TranscriptEvent(kind=kind, utterance_index=utterance)


class FakeTurns:
    """The turn runner: each reply is `reply_words`, spoken as CHUNK_S chunks, one word each."""

    def __init__(self, reply_words: tuple[str, ...] = ("Sure,", "it", "is", "noon", "now.")) -> None:
        self.reply_words = reply_words
        self.opened: list[str] = []
        self.replies: dict[str, Any] = {}
        self.speeches: dict[str, Any] = {}
        self.cancelled: list[tuple[str, bool]] = []
        self.history: list = []
        self.prepared: list[str] = []
        self.end_of_turn_probability = 1.0
        self.fail_reply: str = ""  # an error the llm ends the log with
        self.refuse_turns = False
        self.log_stalls = False
        self.clock: FakeClock | None = None  # when set, each chunk takes 0.4 s to synthesize
        self.caption_times_s: list[float] = []  # how long each caption reply takes, in the order they start

    async def open(self, turn_id: str) -> None:
        if self.refuse_turns:
            raise LimitExceededError("max_turns_per_session", "this session has had its turns")
        self.opened.append(turn_id)

    async def start_reply(self, turn_id: str, request: Any) -> None:
        self.replies[turn_id] = request

    async def start_speech(self, turn_id: str, request: Any) -> None:
        self.speeches[turn_id] = request

    async def reply(self, turn_id: str) -> AsyncIterator[ReplyPiece]:
        if self.log_stalls:
            raise TurnFailed("DEADLINE_EXCEEDED: no entry in the token log for 10 s")
        if self.fail_reply:
            yield ReplyPiece("", 0, first=True, end=True, finish_reason="error", error=self.fail_reply)
            return
        request = self.replies[turn_id]
        pieces = (["The", "meeting", "is", "at", "10."] if request.task == llm_pb.ReplyRequest.CAPTION
                  else list(self.reply_words))
        if request.task == llm_pb.ReplyRequest.CAPTION and self.caption_times_s and self.clock is not None:
            await self.clock.sleep(self.caption_times_s.pop(0))
        for i, word in enumerate(pieces):
            await asyncio.sleep(0)
            yield ReplyPiece(("" if i == 0 else " ") + word, 1, first=i == 0, cached_tokens=7 if i == 0 else 0)
        yield ReplyPiece("", 0, end=True, finish_reason="eos", times=common.StageTimes(stage="llm"))

    async def speech(self, turn_id: str) -> AsyncIterator[Any]:
        for i, word in enumerate(self.reply_words):
            if self.clock is not None:
                await self.clock.sleep(0.4)
            start = i * CHUNK_S
            yield tts_pb.SpeechEvent(word=common.CaptionCue(start_s=start, end_s=start + 0.4, text=word))
            yield tts_pb.SpeechEvent(audio=common.AudioChunk(
                pcm_s16le=bytes(int(2 * REPLY_RATE * CHUNK_S)), sample_rate_hz=REPLY_RATE, start_s=start,
                chunk_index=i))
        yield tts_pb.SpeechEvent(times=common.StageTimes(stage="tts"))
        yield SpeechEnd("eos")

    async def cancel(self, turn_id: str, reply_started: bool) -> None:
        self.cancelled.append((turn_id, reply_started))

    async def record(self, exchange) -> None:
        self.history.append(exchange)

    async def prepare(self, user_text: str) -> None:
        self.prepared.append(user_text)

    async def end_of_turn(self, user_text: str) -> float:
        return self.end_of_turn_probability


class FakeSink(asyncio.Queue):
    def failure(self) -> BaseException | None:
        return None


class Client:
    """The transport's side: input pushed, events drained as a gRPC stream would."""

    def __init__(self, conversation: Conversation) -> None:
        self.conversation = conversation
        self.inputs: asyncio.Queue = asyncio.Queue()
        self.events: list = []
        self.sent_at_s: list[float] = []  # the virtual time each event reached the client
        self.error: BaseException | None = None
        self.ended = False

    async def _inputs(self) -> AsyncIterator[Any]:
        while (item := await self.inputs.get()) is not None:
            yield item

    async def _drain(self) -> None:
        try:
            async for event in self.conversation.events():
                self.events.append(event)
                self.sent_at_s.append(self.conversation.now_s())
        except BaseException as e:  # noqa: BLE001 - what the transport would turn into a status
            self.error = e
        self.ended = True

    def of(self, kind: str, turn_id: str | None = None) -> list:
        return [getattr(e, kind) for e in self.events
                if e.WhichOneof("event") == kind and (turn_id is None or e.turn_id == turn_id)]

    def kinds(self, turn_id: str) -> list[str]:
        return [e.WhichOneof("event") for e in self.events if e.turn_id == turn_id]


class Wired:
    def __init__(self, config: Any = None, turns: FakeTurns | None = None, audio_format: Any = PCM16K) -> None:
        self.clock, self.asr, self.turns, self.sink = FakeClock(), FakeAsr(), turns or FakeTurns(), FakeSink()
        self.turns.clock = self.clock
        self.config = config or pb.SessionConfig(budget_ms=800, mode=Config.DIALOGUE)
        self.conversation = Conversation("session-1", self.config, audio_format, Settings(),
                                         Ports(self.asr, self.turns, self.sink, self.clock))
        self.client = Client(self.conversation)
        self.tasks = [asyncio.create_task(self.conversation.run(self.client._inputs())),
                      asyncio.create_task(self.client._drain())]

    async def hear(self, *events: Any, then_s: float = 0.05) -> None:
        for event in events:
            self.asr.heard.put_nowait(event)
        await self.clock.advance(then_s)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.conversation.close()

    def turn_ids(self) -> list[str]:
        return list(self.turns.opened)


@pytest.fixture
async def wired():
    made: list[Wired] = []

    def make(**kwargs) -> Wired:
        made.append(Wired(**kwargs))
        return made[-1]

    yield make
    for w in made:
        await w.close()


async def test_a_dialogue_turn_is_written_spoken_heard_and_reported(wired):
    w = wired()
    w.client.inputs.put_nowait(ClientAudio(bytes(PcmFormat(16_000, 1, 2).bytes_per_s * 5 // 2)))  # 2.5 s
    await w.clock.advance(0.1)
    await w.hear(kind_only(KIND.SPEECH_STARTED), final(0, "What time is it?"))
    [turn] = w.turn_ids()
    assert w.turns.replies[turn].user_text == "What time is it?"
    assert w.turns.replies[turn].task == llm_pb.ReplyRequest.DIALOGUE and w.turns.speeches[turn].turn_id == turn
    await w.clock.advance(3.5)  # five 0.5 s chunks play out
    kinds = w.client.kinds(turn)
    assert kinds[0] == "transcript" and kinds[-1] == "report"
    assert kinds.count("audio") == 5 and kinds.count("word") == 5 and "reply_text" in kinds
    assert "".join(t.text_delta for t in w.client.of("reply_text", turn)) == "Sure, it is noon now."
    [report] = w.client.of("report", turn)
    assert (report.finish_reason, report.heard_text, report.cut_off) == ("eos", "Sure, it is noon now.", False)
    assert report.prefix_cached_tokens == 7 and sorted(s.stage for s in report.stages) == ["gateway", "llm", "tts"]
    # the budget runs from when the end of speech arrived (in the first 10 ms, in one chunk) to the first audio sent
    assert report.speech_end_unix_ms - FakeClock.EPOCH_MS == 10
    assert 0 < report.first_audio_sent_unix_ms - report.speech_end_unix_ms < 800 and not report.budget_missed
    [exchange] = w.turns.history
    assert (exchange.user, exchange.assistant, exchange.cut_off) == ("What time is it?", "Sure, it is noon now.", False)
    assert not w.turns.cancelled  # the workers finished on their own: nothing to tell them
    assert not w.conversation.work


async def test_audio_goes_out_no_more_than_the_lead_ahead_of_playback(wired):
    w = wired()
    await w.hear(final(0, "Tell me a story."))
    await w.clock.advance(3.0)
    sent = [(at, e.audio.start_s) for at, e in zip(w.client.sent_at_s, w.client.events, strict=True)
            if e.WhichOneof("event") == "audio"]
    assert len(sent) == 5
    first_s = sent[0][0]
    for at, start_s in sent:  # playout runs from the first chunk sent; audio_lead_s = 1.0
        assert start_s < at - first_s + 1.0 + 1e-6
    assert sent[-1][0] - first_s >= 2.0 - 1.0  # the last chunk (at 2.0 s) waited for playback


async def test_barge_in_pauses_at_once_then_interrupts_keeping_what_was_heard(wired):
    w = wired()
    await w.hear(final(0, "What time is it?"))
    [old] = w.turn_ids()
    await w.clock.advance(1.4)  # "Sure, it" heard (0.0-0.4, 0.5-0.9), "is" playing, the rest being spoken
    await w.hear(kind_only(KIND.VOICE_STARTED))
    [pause] = w.client.of("pause", old)
    assert 0.9 < pause.at_s < 1.3
    assert w.asr.expected_phrases[-1] == w.conversation.machine.options.backchannels  # whisper prompted
    await w.hear(kind_only(KIND.SPEECH_STARTED, 1), final(1, "Stop, tell me about Paris instead."))
    [interrupt] = w.client.of("interrupt", old)
    assert interrupt.heard_text == "Sure, it" and interrupt.heard_until_s == pytest.approx(pause.at_s, abs=0.02)
    [report] = w.client.of("report", old)
    assert (report.finish_reason, report.heard_text, report.cut_off, report.interrupts) == (
        "interrupted", "Sure, it", True, 1)
    assert [(e.assistant, e.cut_off) for e in w.turns.history] == [("Sure, it", True)]
    assert (old, True) in w.turns.cancelled  # the llm and tts work is told to stop
    kinds = [e.WhichOneof("event") for e in w.client.events if e.turn_id == old]
    assert "audio" not in kinds[kinds.index("interrupt"):]  # nothing of the old turn after the interrupt
    new = w.turn_ids()[-1]
    assert new != old and w.turns.replies[new].user_text == "Stop, tell me about Paris instead."
    assert w.asr.expected_phrases[-1] == ()


async def test_a_backchannel_resumes_playback_and_the_reply_goes_on(wired):
    w = wired()
    await w.hear(final(0, "What time is it?"))
    [turn] = w.turn_ids()
    await w.clock.advance(1.0)
    await w.hear(kind_only(KIND.VOICE_STARTED), kind_only(KIND.SPEECH_STARTED, 1), final(1, "Mm-hmm."))
    assert len(w.client.of("pause", turn)) == 1
    [resume] = w.client.of("resume", turn)
    assert resume.reason == "backchannel" and not w.client.of("interrupt")
    assert w.turn_ids() == [turn]  # no new turn for a murmur
    await w.clock.advance(3.0)
    [report] = w.client.of("report", turn)
    assert (report.finish_reason, report.pauses, report.resumes, report.heard_text) == (
        "eos", 1, 1, "Sure, it is noon now.")


async def test_a_cough_pauses_then_resumes_as_noise(wired):
    w = wired()
    await w.hear(final(0, "What time is it?"))
    [turn] = w.turn_ids()
    await w.clock.advance(1.0)
    await w.hear(kind_only(KIND.VOICE_STARTED))
    await w.hear(kind_only(KIND.VOICE_ENDED))
    assert len(w.client.of("pause", turn)) == 1
    assert [r.reason for r in w.client.of("resume", turn)] == ["noise"]
    assert not w.client.of("interrupt") and w.turn_ids() == [turn]


async def test_unsure_words_over_the_avatar_are_noise_not_an_interruption(wired):
    w = wired()
    await w.hear(final(0, "What time is it?"))
    [turn] = w.turn_ids()
    await w.clock.advance(1.0)
    await w.hear(kind_only(KIND.VOICE_STARTED), final(1, "And in a moment", probability=0.2))
    assert [r.reason for r in w.client.of("resume", turn)] == ["noise"] and not w.client.of("interrupt")


async def test_a_caption_turn_cleans_the_transcript_and_places_it_on_the_input_timeline(wired):
    w = wired(config=pb.SessionConfig(budget_ms=800, mode=Config.CAPTION, caption_formats=[Config.WEBVTT]))
    await w.hear(kind_only(KIND.SPEECH_STARTED), final(0, "um the meeting is at ten"))
    [turn] = w.turn_ids()
    assert w.turns.replies[turn].task == llm_pb.ReplyRequest.CAPTION and not w.turns.speeches  # no tts
    await w.clock.advance(0.2)
    assert w.client.kinds(turn) == ["transcript", "caption", "report"]
    [caption] = w.client.of("caption", turn)
    assert caption.text == "The meeting is at 10."
    assert caption.cues and caption.cues[0].start_s >= 1.0 and caption.webvtt.startswith("WEBVTT")
    [report] = w.client.of("report", turn)
    assert (report.mode, report.finish_reason, report.error) == ("caption", "eos", "")
    assert not w.conversation.work and not w.conversation.machine.captions  # over through the machine


async def test_captions_cleaned_out_of_order_are_placed_in_the_order_spoken(wired):
    """Two utterances cleaned side by side, the later one first (a file sent unpaced): each caption still
    sits on its own words' times, and they reach the client in the order spoken."""
    turns = FakeTurns()
    turns.caption_times_s = [1.0, 0.0]
    w = wired(config=pb.SessionConfig(mode=Config.CAPTION), turns=turns)
    await w.hear(kind_only(KIND.SPEECH_STARTED), final(0, "the meeting is at ten", start_s=1.0),
                 kind_only(KIND.SPEECH_STARTED, 1), final(1, "the meeting is at ten", start_s=4.0))
    await w.clock.advance(1.5)
    captions = [c for c in w.client.of("caption") if not c.provisional]
    assert [c.utterance_index for c in captions] == [0, 1]
    assert captions[0].lines[0].start_s == pytest.approx(1.0)
    assert captions[1].lines[0].start_s == pytest.approx(4.0)


def partial(utterance: int, text: str, committed: int) -> Any:
    ws = words(text)
    return asr_pb.TranscriptEvent(kind=KIND.PARTIAL, utterance_index=utterance, text=text, words=ws,
                                  committed_words=committed, speech_start_s=ws[0].start_s, speech_end_s=ws[-1].end_s,
                                  committed_text=" ".join(text.split()[:committed]))


async def test_live_captions_show_committed_words_until_the_cleaned_caption_replaces_them(wired):
    w = wired(config=pb.SessionConfig(mode=Config.CAPTION))
    await w.hear(kind_only(KIND.SPEECH_STARTED), partial(0, "um the meeting", 0), partial(0, "um the meeting is", 2),
                 partial(0, "um the meeting is at", 2), partial(0, "um the meeting is at ten", 4))
    live = [c for c in w.client.of("caption") if c.provisional]
    assert [c.text for c in live] == ["um the", "um the meeting is"]  # each time the committed words change
    assert all(c.utterance_index == 0 for c in live) and live[1].cues[2].start_s == pytest.approx(1.6)
    await w.hear(final(0, "um the meeting is at ten"))
    await w.clock.advance(0.2)
    cleaned = [c for c in w.client.of("caption") if not c.provisional]
    assert [c.text for c in cleaned] == ["The meeting is at 10."] and cleaned[0].utterance_index == 0


async def test_a_failed_caption_is_reported_and_the_conversation_goes_on(wired):
    turns = FakeTurns()
    turns.fail_reply = "llm: the prompt is too long"
    w = wired(config=pb.SessionConfig(mode=Config.CAPTION), turns=turns)
    await w.hear(final(0, "the meeting is at ten"), final(1, "bring the slides"))
    reports = w.client.of("report")
    assert [(r.finish_reason, r.error) for r in reports] == [("error", "llm: the prompt is too long")] * 2
    assert not w.client.of("caption") and not w.client.ended


async def test_a_reply_whose_log_stalls_fails_the_turn_not_the_conversation(wired):
    turns = FakeTurns()
    turns.log_stalls = True
    w = wired(turns=turns)
    await w.hear(final(0, "What time is it?"))
    await w.clock.advance(0.5)
    [report] = w.client.of("report")
    assert report.finish_reason == "error" and report.error.startswith("DEADLINE_EXCEEDED")
    assert not w.client.ended and not w.turns.history


async def test_the_client_leaving_mid_reply_lets_the_turn_play_out_then_ends(wired):
    w = wired()
    await w.hear(final(0, "What time is it?"))
    [turn] = w.turn_ids()
    await w.clock.advance(0.3)
    w.client.inputs.put_nowait(None)  # the client closed its side
    await w.clock.advance(0.5)
    assert w.asr.finished  # asr's stream ends after the last audio (the fake's at once)
    await w.clock.advance(2.0)  # the reply is spoken (0.4 s a chunk) and sent at once: nobody listens
    assert w.client.ended and w.client.error is None
    [report] = w.client.of("report", turn)
    assert report.finish_reason == "eos" and len(w.client.of("audio", turn)) == 5


async def test_a_closed_stream_cancels_its_turn_and_tells_the_workers(wired):
    w = wired()
    await w.hear(final(0, "What time is it?"))
    [turn] = w.turn_ids()
    await w.clock.advance(0.2)
    await w.close()
    await settle()
    assert w.turns.cancelled == [(turn, True)] and not w.conversation.work


async def test_playback_reports_move_the_heard_position(wired):
    w = wired()
    await w.hear(final(0, "What time is it?"))
    [turn] = w.turn_ids()
    await w.clock.advance(1.5)
    w.client.inputs.put_nowait(PlaybackReported(turn, 0.45))  # the client's speaker is behind
    await w.clock.advance(0.05)
    await w.hear(kind_only(KIND.VOICE_STARTED), final(1, "Wait, what about tomorrow?"))
    [interrupt] = w.client.of("interrupt", turn)
    assert interrupt.heard_text == "Sure," and interrupt.heard_until_s == pytest.approx(0.5, abs=0.05)


async def test_client_audio_reaches_the_asr_and_bad_audio_ends_the_conversation_with_its_message(wired):
    w = wired(audio_format=common.AudioFormat(encoding=common.AudioFormat.WAV))
    header = wav_bytes(b"", 16_000, 1)
    w.client.inputs.put_nowait(ClientAudio(header + bytes(1280)))
    await w.clock.advance(0.05)
    assert w.asr.audio == [header + bytes(1280)] and not w.client.ended
    assert w.conversation.arrivals.reader.format == PcmFormat(16_000, 1, 2)

    w = wired(audio_format=common.AudioFormat(encoding=common.AudioFormat.WAV))
    w.client.inputs.put_nowait(ClientAudio(b"ID3\x04" + bytes(60)))  # an MP3, declared WAV
    await w.clock.advance(0.05)
    assert w.client.ended and isinstance(w.client.error, ValueError) and "WAV" in str(w.client.error)
    assert w.asr.cancelled and not w.asr.audio  # nothing of it reached the asr


def test_only_audio_and_playback_reports_follow_the_start_message():
    assert convert.client_input(pb.ClientMessage(audio=b"\x00\x00")) == ClientAudio(b"\x00\x00")
    assert convert.client_input(pb.ClientMessage(playback=pb.Playback(turn_id="t", played_until_s=1.5))) == \
        PlaybackReported("t", 1.5)
    with pytest.raises(ValueError, match="only audio and playback"):
        convert.client_input(pb.ClientMessage(start=pb.StreamStart(session_id="s")))


async def test_past_the_sessions_turn_limit_the_conversation_ends_with_the_limit(wired):
    turns = FakeTurns()
    turns.refuse_turns = True
    w = wired(turns=turns)
    await w.hear(final(0, "What time is it?"))
    assert w.client.ended and isinstance(w.client.error, LimitExceededError)


async def test_a_long_conversation_keeps_only_its_latest_transcripts_and_interrupted_turns(wired):
    w = wired()
    for utterance in range(200):  # finals with no words: transcribed, no turn to start
        await w.conversation._on_transcript(asr_pb.TranscriptEvent(kind=KIND.FINAL, utterance_index=utterance))
    assert sorted(w.conversation.finals) == list(range(200 - KEPT_UTTERANCES, 200))
    for n in range(100):
        w.conversation.unheard.append(f"turn-{n}")
    assert list(w.conversation.unheard) == [f"turn-{n}" for n in range(100 - KEPT_UNHEARD_TURNS, 100)]


def test_the_arrival_clock_keeps_the_last_two_minutes_of_a_two_hour_stream():
    chunk = bytes(PcmFormat(16_000, 1, 2).bytes_per_s * 40 // 1000)  # 40 ms
    clock = AudioArrivalClock(PCM16K, FakeClock())
    real = AudioArrivalClock(PCM16K, _WallClock())
    before = int(time.time() * 1000)
    for _ in range(2 * 3600 * 25):
        clock.received(chunk)
        real.received(chunk)
    assert len(clock._ends_s) == len(clock._arrivals_ms) <= 2 * 120 * 25 + 1
    assert clock._ends_s[-1] == pytest.approx(7200.0)
    # an utterance that just ended maps to when its audio came, as before the bound
    assert before <= real.arrival_ms(7199.5) <= int(time.time() * 1000)
    assert real.arrival_ms(7199.5) >= real.arrival_ms(7100.0)


class _WallClock:
    def unix_ms(self) -> int:
        return int(time.time() * 1000)

