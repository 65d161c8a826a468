"""Preemptive turns in the gateway: transcript events pushed into a Conversation, events out.

Real Valkey; llm and tts are stand-ins that answer at once, so what is tested is the
gateway's decision: keep the early turn when the final says the same, drop it otherwise,
and let nothing of an early turn reach the client before the final confirms it.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.gateway_service import Conversation, Stubs, asr_pb, llm_pb, pb, tts_pb
from services.redis_store import SessionStore, TurnStore, connect
from services.settings import Settings

TEXT = "What is the capital of France?"


class FakeCall:
    """An answered server stream: async-iterable, cancellable."""

    def __init__(self, items: list) -> None:
        self.items = items

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        for item in self.items:
            await asyncio.sleep(0)
            yield item

    def cancel(self) -> None:
        pass


class FakeLlm:
    def Reply(self, request):  # noqa: N802 - the gRPC method's name
        assert request.defer_history  # the gateway, not llm, records the exchange once it is confirmed
        return FakeCall([llm_pb.ReplyStep(text_delta=f"Reply to: {request.user_text}", accepted=1, end=True,
                                          finish_reason="eos")])


class FakeTts:
    speaks = False  # True: each turn's reply sends one audio chunk

    def SpeakTurn(self, request):  # noqa: N802
        audio = tts_pb.SpeechEvent(audio=tts_pb.AudioChunk(pcm_s16le=b"\0\0" * 160, sample_rate_hz=16_000))
        return FakeCall([audio] if self.speaks else [])


@pytest.fixture
async def conversation(redis_url):
    redis = connect(redis_url)
    session_id = await SessionStore(redis).create("")
    context = SimpleNamespace(turns=TurnStore(redis), sessions=SessionStore(redis))

    def make(preemptive: bool = True, speaks: bool = False) -> Conversation:
        tts = FakeTts()
        tts.speaks = speaks
        servicer = SimpleNamespace(settings=Settings(preemptive_generation=preemptive), redis=context,
                                   stubs=Stubs(asr=None, llm=FakeLlm(), tts=tts))
        start = pb.StreamStart(session_id=session_id, format=pb.AudioFormat(
            encoding=pb.AudioFormat.PCM_S16LE, sample_rate_hz=16_000, channels=1, sample_width_bytes=2))
        return Conversation(servicer, start)

    make.history = lambda: context.sessions.history(session_id)  # type: ignore[attr-defined]
    yield make
    await redis.aclose()


def partial(text: str, ending: bool = True) -> asr_pb.TranscriptEvent:
    return asr_pb.TranscriptEvent(kind=asr_pb.TranscriptEvent.PARTIAL, text=text, committed_text=text,
                                  stability=1.0, speech_ending=ending, utterance_index=0, speech_end_s=1.5)


def final(text: str, utterance: int = 0) -> asr_pb.TranscriptEvent:
    return asr_pb.TranscriptEvent(kind=asr_pb.TranscriptEvent.FINAL, text=text, committed_text=text,
                                  stability=1.0, utterance_index=utterance, speech_end_s=1.5 + utterance)


def speech_started(utterance: int) -> asr_pb.TranscriptEvent:
    return asr_pb.TranscriptEvent(kind=asr_pb.TranscriptEvent.SPEECH_STARTED, utterance_index=utterance)


async def drain(conversation: Conversation) -> list:
    if conversation.turn and conversation.turn.task:
        await asyncio.wait_for(asyncio.shield(conversation.turn.task), 5)
    events = []
    while not conversation.events.empty():
        events.append(conversation.events.get_nowait())
    return events


def kinds(events: list) -> list[str]:
    return [e.WhichOneof("event") for e in events]


async def test_an_early_turn_is_held_until_the_final_confirms_it(conversation):
    talk = conversation()
    await talk._on_transcript(partial(TEXT))
    assert talk.turn is not None and talk.turn.awaiting_final
    await asyncio.sleep(0.05)  # the early turn runs, its output waits
    assert kinds([talk.events.get_nowait() for _ in range(talk.events.qsize())]) == ["transcript"]
    await talk._on_transcript(final("what is the capital of france"))  # same words
    events = await drain(talk)
    assert kinds(events) == ["transcript", "reply_text", "report"]
    assert events[0].transcript.is_final and events[0].transcript.cues == []  # no word timings given
    report = events[-1].report
    assert report.preemption == "kept" and report.finish_reason == "eos"
    assert (report.preemptions_kept, report.preemptions_dropped) == (1, 0)
    assert len({e.turn_id for e in events}) == 1
    history = await conversation.history()
    assert [(h.user, h.assistant) for h in history] == [("what is the capital of france", f"Reply to: {TEXT}")]


async def test_an_early_turn_the_final_contradicts_is_dropped_and_replaced(conversation):
    talk = conversation()
    await talk._on_transcript(partial("What is the capital"))
    early = talk.turn
    await talk._on_transcript(final(TEXT))
    events = await drain(talk)
    dropped = [e for e in events if e.turn_id == early.turn_id]
    assert kinds(dropped) == ["report"]  # nothing else of the dropped turn reached the client
    assert dropped[0].report.preemption == "dropped" and dropped[0].report.finish_reason == "cancelled"
    kept = [e for e in events if e.turn_id not in ("", early.turn_id)]
    assert kinds(kept) == ["transcript", "reply_text", "report"]
    assert kept[1].reply_text.text_delta == f"Reply to: {TEXT}"
    assert (kept[-1].report.preemptions_kept, kept[-1].report.preemptions_dropped) == (0, 1)


async def test_no_early_turn_without_silence_or_when_turned_off(conversation):
    for talk, event in ((conversation(), partial(TEXT, ending=False)), (conversation(preemptive=False), partial(TEXT))):
        await talk._on_transcript(event)
        assert talk.turn is None
        await talk._on_transcript(final(TEXT))
        report = (await drain(talk))[-1].report
        assert report.preemption == "" and report.finish_reason == "eos"


async def test_a_dropped_early_turn_whose_reply_had_ended_leaves_no_history(conversation):
    talk = conversation()
    await talk._on_transcript(partial("What is the capital"))
    early = talk.turn
    await asyncio.sleep(0.05)  # llm has written the whole early reply; the gateway holds it for the final
    assert early.awaiting_final and await conversation.history() == ()
    await talk._on_transcript(final(TEXT))
    await drain(talk)
    assert early.preemption == "dropped"
    history = await conversation.history()
    assert [(h.user, h.assistant) for h in history] == [(TEXT, f"Reply to: {TEXT}")]


async def test_words_said_on_before_any_reply_audio_begin_the_next_turn(conversation):
    """A pause long enough to end an utterance, then more words: one reply to all of it."""
    talk = conversation(preemptive=False)
    await talk._on_transcript(final("Good morning to you,"))
    first = talk.turn
    await talk._on_transcript(speech_started(1))  # before any of the reply's audio went out
    await talk._on_transcript(final("my friend.", utterance=1))
    events = await drain(talk)
    reports = [e.report for e in events if e.WhichOneof("event") == "report"]
    assert [r.finish_reason for r in reports] == ["cancelled", "eos"]
    assert reports[0].transcript == "Good morning to you,"
    assert reports[1].transcript == "Good morning to you, my friend."
    replies = [e.reply_text.text_delta for e in events
               if e.turn_id != first.turn_id and e.WhichOneof("event") == "reply_text"]
    assert replies == ["Reply to: Good morning to you, my friend."]
    history = await conversation.history()
    assert [h.user for h in history] == ["Good morning to you, my friend."]


async def test_after_the_reply_was_heard_the_next_turn_is_the_new_words_alone(conversation):
    talk = conversation(preemptive=False, speaks=True)
    await talk._on_transcript(final(TEXT))
    await drain(talk)  # the reply's audio went out
    await talk._on_transcript(speech_started(1))
    await talk._on_transcript(final("And of Spain?", utterance=1))
    events = await drain(talk)
    assert [e.report.transcript for e in events if e.WhichOneof("event") == "report"] == ["And of Spain?"]
    history = await conversation.history()
    assert [h.user for h in history] == [TEXT, "And of Spain?"]
