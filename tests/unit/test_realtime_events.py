"""The Realtime API converter (services/gateway/realtime_events.py) on a real Conversation wired to the
in-memory fakes of tests/unit/test_conversation_ports.py, in virtual time: client events in, the server
events out checked against the `openai` SDK's own typed models of both dialects (GA and beta), and in
the order the API gives them. tests/e2e/test_realtime.py drives the same through the real stack and
real clients."""

from __future__ import annotations

import base64
import json
import typing
from typing import Any

import numpy as np
import pytest
from openai.types.beta.realtime import RealtimeServerEvent as BetaServerEvent
from openai.types.realtime import RealtimeServerEvent

from pipeline import g711
from services import session_config
from services.gateway import realtime_session as rs
from services.gateway.convert import Config, pb
from services.gateway.ports import ClientAudio, CommitAudio, HeardUntil, Reconfigure, RequestReply, UserText
from services.gateway.realtime_events import RealtimeConverter
from services.gateway.realtime_session import RealtimeError
from services.settings import Settings
from tests.unit.test_conversation_ports import KIND, FakeTurns, Wired, final, kind_only, partial


def _by_type(union: Any) -> dict[str, Any]:
    """The SDK's model of each server event, by its `type` (a union tried whole reports every member's errors)."""
    members = typing.get_args(typing.get_args(union)[0])
    return {typing.get_args(m.model_fields["type"].annotation)[0]: m for m in members}


SHAPES = {"ga": _by_type(RealtimeServerEvent), "beta": _by_type(BetaServerEvent)}


def check_shape(event: dict, dialect: str) -> None:
    models = SHAPES[dialect]
    assert event["type"] in models, f"{event['type']} is no {dialect} server event"
    models[event["type"]].model_validate(event)
MODEL = {"ga": "", "beta": "gpt-4o-realtime-preview"}  # beta's SDK model names its models; a client sends one
CHOICES = session_config.Choices(drafters=("ngram",), voices=("joe", "amy"), default_drafter="ngram",
                                 default_voice="joe", max_new_tokens=256)
SETTINGS = Settings()


class Turns(FakeTurns):
    """The fake turn runner with the two calls only a Realtime client makes."""

    def __init__(self) -> None:
        super().__init__()
        self.configured: list = []

    def configure(self, config: Any) -> None:
        self.configured.append(config)

    async def amend(self, old, new) -> None:
        index = max(i for i, e in enumerate(self.history) if e == old) if old else None
        if index is None:
            self.history.append(new)
        elif new is None:
            del self.history[index]
        else:
            self.history[index] = new


class Realtime:
    """A Realtime client's view: client events in, every server event out (checked against the SDK's models)."""

    def __init__(self, w: Wired, dialect: rs.Dialect = "ga") -> None:
        self.w = w
        self.w.conversation.speech_notices = True
        config = session_config.resolve(self.w.config, CHOICES, 800)
        self.converter = RealtimeConverter(
            rs.initial("sess_1", config, SETTINGS.asr, MODEL[dialect]), dialect, CHOICES.voices, SETTINGS.asr,
            SETTINGS.turn_taking, config, lambda c: session_config.resolve(c, CHOICES, 800))
        self.dialect = dialect
        self.out: list[dict] = list(self.converter.session_created())
        self.inputs: list = []
        self._seen = 0

    def send(self, **event: Any) -> list[dict]:
        inputs, answers = self.converter.client_event(json.dumps(event))
        for item in inputs:
            self.inputs.append(item)
            self.w.client.inputs.put_nowait(item)
        self.out += answers
        return answers

    def events(self) -> list[dict]:
        for event in self.w.client.events[self._seen:]:
            self.out += self.converter.conversation_event(event)
        self._seen = len(self.w.client.events)
        for event in self.out:
            if not event["type"].startswith("specvox."):
                check_shape(event, self.dialect)  # the SDK's own model of the event
        return self.out

    def types(self) -> list[str]:
        return [e["type"] for e in self.events()]

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events() if e["type"] == kind]


@pytest.fixture
async def realtime():
    made: list[Realtime] = []

    def make(dialect: rs.Dialect = "ga") -> Realtime:
        config = pb.SessionConfig(budget_ms=800, mode=Config.DIALOGUE, voice="joe")
        made.append(Realtime(Wired(config=config, turns=Turns()), dialect))
        return made[-1]

    yield make
    for r in made:
        await r.w.close()


async def test_a_voice_turn_reads_as_the_apis_events_in_order(realtime):
    r = realtime()
    await r.w.hear(kind_only(KIND.SPEECH_STARTED), partial(0, "What time is it", 2), final(0, "What time is it?"))
    await r.w.clock.advance(3.5)
    types = [t for t in r.types() if not t.startswith("response.output_audio")]
    assert types[:12] == [
        "session.created", "conversation.created", "input_audio_buffer.speech_started",
        "conversation.item.input_audio_transcription.delta", "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed", "conversation.item.added", "conversation.item.done",
        "conversation.item.input_audio_transcription.completed", "response.created", "response.output_item.added",
        "conversation.item.added"]
    assert types[12] == "response.content_part.added"
    assert r.types()[-6:] == ["response.output_audio.done", "response.output_audio_transcript.done",
                              "response.content_part.done", "response.output_item.done", "conversation.item.done",
                              "response.done"]
    [done] = r.of("response.done")
    assert done["response"]["status"] == "completed"
    assert done["response"]["output"][0]["content"][0]["transcript"] == "Sure, it is noon now."
    [completed] = r.of("conversation.item.input_audio_transcription.completed")
    assert completed["transcript"] == "What time is it?"
    audio = b"".join(base64.b64decode(e["delta"]) for e in r.of("response.output_audio.delta"))
    assert len(audio) == 2 * 24_000 * 5 // 2  # 2.5 s of 16 kHz reply audio, as audio/pcm's 24 kHz
    assert "".join(e["delta"] for e in r.of("response.output_audio_transcript.delta")) == "Sure, it is noon now."


async def test_the_beta_dialect_names_its_events_its_own_way(realtime):
    r = realtime("beta")
    await r.w.hear(kind_only(KIND.SPEECH_STARTED), final(0, "What time is it?"))
    await r.w.clock.advance(3.5)
    types = r.types()
    assert "conversation.item.created" in types and "conversation.item.added" not in types
    assert "conversation.item.done" not in types
    assert "response.audio.delta" in types and "response.audio_transcript.delta" in types
    assert r.out[0]["session"]["input_audio_format"] == "pcm16"


async def test_a_barge_in_cancels_the_response_and_a_late_truncate_amends_the_history(realtime):
    r = realtime()
    await r.w.hear(kind_only(KIND.SPEECH_STARTED), final(0, "What time is it?"))
    await r.w.clock.advance(1.4)  # "Sure, it" heard
    await r.w.hear(kind_only(KIND.VOICE_STARTED), kind_only(KIND.SPEECH_STARTED, 1))
    started = r.of("input_audio_buffer.speech_started")
    assert len(started) == 1  # over the reply: paused, nothing said to the client yet
    await r.w.hear(final(1, "Stop, tell me about Paris instead."))
    types = r.types()
    assert len(r.of("input_audio_buffer.speech_started")) == 2
    [done] = [e for e in r.of("response.done") if e["response"]["status"] == "cancelled"]
    assert done["response"]["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
    assert types.index("input_audio_buffer.speech_started", types.index("response.created")) < types.index(
        "response.done")
    assert [(e.assistant, e.cut_off) for e in r.w.turns.history] == [("Sure, it", True)]
    item_id = done["response"]["output"][0]["id"]
    # the client had played 0.45 s when it stopped (its speaker is behind): "Sure," only
    r.send(type="conversation.item.truncate", item_id=item_id, content_index=0, audio_end_ms=450)
    await r.w.clock.advance(0.05)
    assert [(e.assistant, e.cut_off) for e in r.w.turns.history] == [("Sure,", True)]
    [truncated] = r.of("conversation.item.truncated")
    assert truncated["audio_end_ms"] == 450
    # past the audio sent: clamped, answered, never an error
    r.send(type="conversation.item.truncate", item_id=item_id, content_index=0, audio_end_ms=600_000)
    await r.w.clock.advance(0.05)
    assert r.of("conversation.item.truncated")[-1]["audio_end_ms"] < 600_000 and not r.of("error")
    assert r.w.turns.history[-1].assistant.startswith("Sure, it")


async def test_a_backchannel_never_reaches_a_strict_client_and_the_response_completes(realtime):
    r = realtime()
    await r.w.hear(kind_only(KIND.SPEECH_STARTED), final(0, "What time is it?"))
    await r.w.clock.advance(1.0)
    await r.w.hear(kind_only(KIND.VOICE_STARTED), kind_only(KIND.SPEECH_STARTED, 1), final(1, "Mm-hmm."))
    await r.w.clock.advance(3.0)
    assert len(r.of("input_audio_buffer.speech_started")) == 1
    assert [d["response"]["status"] for d in r.of("response.done")] == ["completed"]
    assert not [t for t in r.types() if t.startswith("specvox.")]  # extension events: off by default


async def test_turn_detection_off_commit_and_response_create_drive_the_turn(realtime):
    r = realtime()
    r.send(type="session.update", session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
    await r.w.clock.advance(0.05)
    [updated] = r.of("session.updated")
    assert updated["session"]["audio"]["input"]["turn_detection"] is None
    assert isinstance(r.inputs[0], Reconfigure) and not r.inputs[0].auto_turns
    await r.w.hear(kind_only(KIND.SPEECH_STARTED), final(0, "What time is it?"))
    assert not r.w.turn_ids() and not r.of("input_audio_buffer.speech_started")  # no server VAD
    r.send(type="input_audio_buffer.commit")
    r.send(type="response.create", response={"metadata": {"client_event_id": "abc"}})
    await r.w.clock.advance(0.1)
    [committed] = r.of("conversation.item.input_audio_transcription.completed")
    assert committed["transcript"] == "What time is it?"
    [turn] = r.w.turn_ids()
    assert r.w.turns.replies[turn].user_text == "What time is it?"
    await r.w.clock.advance(3.5)
    [created] = r.of("response.created")
    assert created["response"]["metadata"] == {"client_event_id": "abc"}
    assert r.of("response.done")[0]["response"]["metadata"] == {"client_event_id": "abc"}


async def test_a_commit_waits_for_the_open_utterance(realtime):
    r = realtime()
    r.send(type="session.update", session={"audio": {"input": {"turn_detection": None}}})
    await r.w.hear(kind_only(KIND.SPEECH_STARTED), partial(0, "Tell me", 1))
    r.send(type="input_audio_buffer.commit")
    r.send(type="response.create")
    await r.w.clock.advance(0.3)
    assert not r.w.turn_ids()  # waiting for the final
    await r.w.hear(final(0, "Tell me a joke."))
    [turn] = r.w.turn_ids()
    assert r.w.turns.replies[turn].user_text == "Tell me a joke."


async def test_a_text_item_and_response_create_answer_the_text(realtime):
    r = realtime()
    answers = r.send(type="conversation.item.create", item={
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hello."}]})
    assert [a["type"] for a in answers] == ["conversation.item.added", "conversation.item.done"]
    r.send(type="response.create")
    await r.w.clock.advance(0.1)
    [turn] = r.w.turn_ids()
    assert r.w.turns.replies[turn].user_text == "Say hello."
    with pytest.raises(RealtimeError) as e:  # one response at a time
        r.send(type="response.create")
    assert e.value.code == "conversation_already_has_active_response"
    item_id = answers[0]["item"]["id"]
    assert r.send(type="conversation.item.retrieve", item_id=item_id)[0]["item"]["content"][0]["text"] == "Say hello."
    assert r.send(type="conversation.item.delete", item_id=item_id)[0]["type"] == "conversation.item.deleted"
    with pytest.raises(RealtimeError, match="not found"):
        r.send(type="conversation.item.retrieve", item_id=item_id)
    await r.w.clock.advance(3.5)
    r.events()


async def test_response_cancel_ends_it_as_client_cancelled(realtime):
    r = realtime()
    with pytest.raises(RealtimeError) as e:
        r.send(type="response.cancel")
    assert e.value.code == "response_cancel_not_active"
    r.send(type="conversation.item.create", item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "Count to ten."}]})
    r.send(type="response.create")
    await r.w.clock.advance(1.2)
    r.send(type="response.cancel")
    await r.w.clock.advance(0.1)
    [done] = r.of("response.done")
    assert done["response"]["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
    assert not r.of("input_audio_buffer.speech_started")


async def test_session_update_maps_onto_the_session_config_and_echoes_it_whole(realtime):
    r = realtime()
    r.send(type="session.update", session={
        "type": "realtime", "instructions": "Be brief.",
        "audio": {"input": {"format": {"type": "audio/pcmu"},
                            "turn_detection": {"type": "server_vad", "silence_duration_ms": 650}},
                  "output": {"format": {"type": "audio/pcma"}, "voice": "amy"}},
        "max_output_tokens": 64, "specvox": {"extension_events": True}})
    [reconfigure] = [i for i in r.inputs if isinstance(i, Reconfigure)]
    config = reconfigure.config
    assert (config.system_prompt, config.voice, config.reply_sample_rate_hz, config.max_reply_tokens) == (
        "Be brief.", "amy", 8000, 64)
    # server_vad: silence alone, 650 ms of it (the asr's 150 ms, then 0.5 s more)
    assert reconfigure.turn_taking.end_of_turn_threshold > 1
    assert reconfigure.turn_taking.incomplete_wait_s == pytest.approx(0.5)
    [updated] = r.of("session.updated")
    session = updated["session"]
    assert session["audio"]["input"]["format"] == {"type": "audio/pcmu"}
    assert session["audio"]["output"] == {"format": {"type": "audio/pcma"}, "voice": "amy", "speed": 1.0}
    assert session["audio"]["input"]["turn_detection"]["silence_duration_ms"] == 650
    assert session["instructions"] == "Be brief." and session["max_output_tokens"] == 64
    # G.711 in: 8 kHz µ-law becomes 24 kHz PCM for the conversation
    tone = (np.sin(np.arange(8000) / 8000 * 2 * np.pi * 440) * 8000).astype("<i2").tobytes()
    r.send(type="input_audio_buffer.append", audio=base64.b64encode(g711.encode(tone, "mulaw")).decode())
    [audio] = [i for i in r.inputs if isinstance(i, ClientAudio)]
    assert abs(len(audio.data) // 2 - 24_000) < 1000  # less the resampler's delay


async def test_beta_session_update_takes_beta_names(realtime):
    r = realtime("beta")
    r.send(type="session.update", session={"input_audio_format": "g711_ulaw", "output_audio_format": "g711_alaw",
                                           "voice": "amy", "turn_detection": None, "temperature": 0.8})
    session = r.of("session.updated")[0]["session"]
    assert (session["input_audio_format"], session["output_audio_format"], session["turn_detection"]) == (
        "g711_ulaw", "g711_alaw", None)
    assert r.inputs[0].config.sampling.temperature == pytest.approx(0.8)


@pytest.mark.parametrize(("frame", "code"), [
    ("{not json", "invalid_json"),
    ('["a list"]', "invalid_event"),
    ('{"type": "input_audio_buffer.pour"}', "invalid_value"),
    ('{"type": "input_audio_buffer.append", "audio": "%%%"}', "invalid_value"),
    ('{"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/flac"}}}}}',
     "invalid_value"),
    ('{"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}}',
     "invalid_value"),
    ('{"type": "session.update", "session": {"audio": {"output": {"voice": "alloy"}}}}', "invalid_value"),
    ('{"type": "session.update", "session": {"tools": [{"type": "function", "name": "f"}]}}', "unsupported_value"),
    ('{"type": "session.update", "session": {"colour": "blue"}}', "unknown_parameter"),
    ('{"type": "conversation.item.truncate", "item_id": "nope", "content_index": 0, "audio_end_ms": 5}',
     "item_not_found"),
    ('{"type": "input_audio_buffer.commit"}', "invalid_value"),  # turn detection is on
])
async def test_bad_client_events_are_refused_with_an_openai_error_and_change_nothing(realtime, frame, code):
    r = realtime()
    before = r.converter.session
    with pytest.raises(RealtimeError) as e:
        r.converter.client_event(frame)
    assert e.value.code == code and r.converter.session is before
    error = r.converter.error_event(e.value, "evt_client_1")
    check_shape(error, "ga")
    assert error["error"]["event_id"] == "evt_client_1" and error["error"]["type"] == "invalid_request_error"


async def test_extension_events_carry_words_reports_and_speculative_statistics_when_asked(realtime):
    r = realtime()
    r.send(type="session.update", session={"specvox": {"extension_events": True}})
    await r.w.hear(kind_only(KIND.SPEECH_STARTED), final(0, "What time is it?"))
    await r.w.clock.advance(3.5)
    words = [e["text"] for e in r.of("specvox.word")]
    assert words == ["Sure,", "it", "is", "noon", "now."]
    [report] = r.of("specvox.turn.report")
    assert report["report"]["finish_reason"] == "eos"
    assert report["speculative"]["accepted_tokens"] == 5


def test_g711_output_is_encoded_at_8_khz():
    from services.gateway.realtime_events import _output_audio

    pcm = (np.sin(np.arange(16_000) / 16_000 * 2 * np.pi * 300) * 9000).astype("<i2").tobytes()  # 1 s at 16 kHz
    out = _output_audio(pcm, 16_000, rs.PCMU)
    assert len(out) == 8000  # one byte a sample, resampled to 8 kHz
    back = np.frombuffer(g711.decode(out, "mulaw"), "<i2")
    assert np.abs(back).max() > 6000


async def test_inputs_in_order_commit_request_and_heard(realtime):
    r = realtime()
    r.send(type="session.update", session={"audio": {"input": {"turn_detection": None}}})
    r.send(type="input_audio_buffer.commit")
    r.send(type="response.create")
    assert [type(i) for i in r.inputs[1:]] == [CommitAudio, RequestReply]
    assert not any(isinstance(i, (HeardUntil, UserText)) for i in r.inputs)


async def test_a_responses_own_instructions_are_its_reply_s_system_prompt_and_only_its(realtime):
    """response.create{response.instructions}: that reply's llm request carries them as its system prompt; the
    next voice turn's has the session's again. Instructions that are no string are refused."""
    r = realtime()
    r.send(type="conversation.item.create", item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "Hello there"}]})
    r.send(type="response.create", response={"instructions": "Answer like a pirate."})
    await r.w.clock.advance(3.5)
    [asked] = r.w.turn_ids()
    assert r.w.turns.replies[asked].system_prompt == "Answer like a pirate."
    await r.w.hear(kind_only(KIND.SPEECH_STARTED), final(0, "What time is it?"))
    await r.w.clock.advance(3.5)
    voiced = r.w.turn_ids()[-1]
    assert voiced != asked and r.w.turns.replies[voiced].system_prompt == r.w.config.system_prompt
    r.events()
    await r.w.clock.advance(3.5)
    r.send(type="conversation.item.create", item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "And now?"}]})
    r.send(type="response.create", response={"instructions": None})  # as LiveKit sends it: the session's
    await r.w.clock.advance(3.5)
    assert len(r.w.turn_ids()) == 3 and r.w.turns.replies[r.w.turn_ids()[-1]].system_prompt == r.w.config.system_prompt
    with pytest.raises(RealtimeError) as e:
        r.send(type="response.create", response={"instructions": 7})
    assert (e.value.code, e.value.param) == ("invalid_type", "response.instructions")


async def test_a_reply_being_spoken_can_be_truncated_and_retrieved(realtime):
    r = realtime()
    await r.w.hear(kind_only(KIND.SPEECH_STARTED), final(0, "What time is it?"))
    await r.w.clock.advance(0.6)
    [delta] = r.of("response.output_audio.delta")[:1]
    assert r.send(type="conversation.item.retrieve", item_id=delta["item_id"])[0]["item"]["role"] == "assistant"
    [truncated] = r.send(type="conversation.item.truncate", item_id=delta["item_id"], content_index=0,
                         audio_end_ms=450)
    assert truncated["audio_end_ms"] == 450
    await r.w.clock.advance(0.1)
    [done] = r.of("response.done")
    assert done["response"]["status_details"]["reason"] == "client_cancelled"
    assert [(e.assistant, e.cut_off) for e in r.w.turns.history] == [("Sure,", True)]


async def test_specvox_settings_ride_in_the_sessions_extension_object(realtime):
    r = realtime()
    assert r.out[0]["session"]["specvox"]["choices"] == {"voices": ["joe", "amy"], "drafters": []}
    r.send(type="session.update", session={"specvox": {"extension_events": True, "drafter": "ngram",
                                                       "budget_ms": 600}})
    [reconfigure] = [i for i in r.inputs if isinstance(i, Reconfigure)]
    assert (reconfigure.config.drafter, reconfigure.config.budget_ms) == ("ngram", 600)
    with pytest.raises(RealtimeError) as e:  # the conversation's mode is the session's, for good
        r.send(type="session.update", session={"specvox": {"mode": "caption"}})
    assert e.value.param == "session.specvox.mode"
    with pytest.raises(RealtimeError, match="unknown drafter"):
        r.send(type="session.update", session={"specvox": {"drafter": "oracle"}})


async def test_visemes_and_captions_go_out_as_extension_events(realtime):
    from services.gateway.convert import common

    r = realtime()
    r.send(type="session.update", session={"specvox": {"extension_events": True}})
    out = r.converter.conversation_event(pb.ServerEvent(turn_id="t1", viseme=common.Viseme(
        start_s=0.1, end_s=0.25, id="PP", azure_id=21, weight=0.8)))
    [viseme] = [e for e in out if e["type"] == "specvox.viseme"]
    assert (viseme["id"], viseme["start_ms"], viseme["end_ms"]) == ("PP", 100, 250)
    assert viseme["response_id"] == r.converter.responses["t1"].response_id
    caption = pb.Caption(text="The meeting is at 10.", lines=[common.CaptionCue(start_s=1.0, end_s=2.5,
                                                                                  text="The meeting is at 10.")])
    [line] = r.converter.conversation_event(pb.ServerEvent(turn_id="t2", caption=caption))
    assert line["type"] == "specvox.caption" and line["lines"][0] == {"text": "The meeting is at 10.",
                                                                      "start_ms": 1000, "end_ms": 2500}


async def test_a_failed_turn_is_told_as_a_failed_response_and_the_connection_goes_on(realtime):
    r = realtime()
    r.w.turns.fail_reply = "llm: the prompt is too long"
    await r.w.hear(kind_only(KIND.SPEECH_STARTED), final(0, "What time is it?"))
    await r.w.clock.advance(0.5)
    [done] = r.of("response.done")
    assert done["response"]["status"] == "failed"
    assert done["response"]["status_details"]["error"]["message"] == "llm: the prompt is too long"
    [completed] = r.of("conversation.item.input_audio_transcription.completed")
    assert 0 < completed["usage"]["seconds"] < 2  # the utterance's own length


async def test_create_response_false_commits_each_utterance_and_waits_for_response_create(realtime):
    r = realtime()
    r.send(type="session.update", session={"audio": {"input": {"turn_detection": {
        "type": "server_vad", "create_response": False, "interrupt_response": False}}}})
    [reconfigure] = [i for i in r.inputs if isinstance(i, Reconfigure)]
    assert not reconfigure.turn_taking.start_turns and not reconfigure.turn_taking.interruptions
    echoed = r.of("session.updated")[0]["session"]["audio"]["input"]["turn_detection"]
    assert (echoed["create_response"], echoed["interrupt_response"]) == (False, False)
    await r.w.clock.advance(0.02)
    await r.w.hear(kind_only(KIND.SPEECH_STARTED), final(0, "What time is it?"))
    assert not r.w.turn_ids()
    assert r.of("conversation.item.input_audio_transcription.completed")[0]["transcript"] == "What time is it?"
    r.send(type="response.create")
    await r.w.clock.advance(0.1)
    [turn] = r.w.turn_ids()
    assert r.w.turns.replies[turn].user_text == "What time is it?"
