"""The OpenAI Realtime API of `specvox up`, spoken to by real clients: the `openai` SDK's GA
(`realtime.connect()`) and beta (`beta.realtime.connect()`) connections here, Pipecat's
`OpenAIRealtimeLLMService` and LiveKit Agents' `RealtimeModel` as scripts in the clients' own
environment (tests/clients/, `make clients`). Real services, real speech streamed at real-time pace
as a microphone would, the session's history read from Valkey as the llm reads it."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from openai import AsyncOpenAI

from pipeline import g711
from pipeline.audio import float_to_pcm16
from tests.session_history import history

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
CLIENTS_PYTHON = ROOT / ".venv-clients" / "bin" / "python"
RATE = 24_000
CHUNK_MS = 40
# a reply heard whole: to its end, or to the session's token limit (max_output_tokens)
ANSWERED = ("completed", "incomplete")
HEARD_SLACK_MS = 50  # pipeline/turn_taking.HEARD_WORD_SLACK_S: a word counts as heard once played, less this


def client(stack) -> AsyncOpenAI:
    base = stack["http"]
    return AsyncOpenAI(api_key=os.environ.get("SPECVOX_AUTH__API_KEY", "unused"), base_url=f"http://{base}/v1",
                       websocket_base_url=f"ws://{base}/v1")


class Mic:
    """A microphone at real-time pace: what it is given to say, else silence, in 40 ms appends."""

    def __init__(self, send: Callable[[bytes], Any], encode: Callable[[bytes], bytes] = lambda pcm: pcm,
                 rate_hz: int = RATE) -> None:
        self.send, self.encode, self.rate_hz = send, encode, rate_hz
        self.queue: list[tuple[bytes, asyncio.Event]] = []
        self.task: asyncio.Task | None = None

    def say(self, samples: np.ndarray) -> asyncio.Event:
        said = asyncio.Event()
        self.queue.append((float_to_pcm16(samples), said))
        return said

    async def run(self) -> None:
        chunk_bytes = self.rate_hz * 2 * CHUNK_MS // 1000
        start, sent = time.monotonic(), 0
        while True:
            if self.queue:
                pcm, said = self.queue[0]
                piece, rest = pcm[:chunk_bytes], pcm[chunk_bytes:]
                self.queue[0] = (rest, said)
                if not rest:
                    self.queue.pop(0)
                    said.set()
            else:
                piece = bytes(chunk_bytes)
            await self.send(self.encode(piece))
            sent += 1
            await asyncio.sleep(max(0.0, start + sent * CHUNK_MS / 1000 - time.monotonic()))

    def __enter__(self) -> Mic:
        self.task = asyncio.create_task(self.run())
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self.task is not None
        self.task.cancel()


class Events:
    """Every server event the connection receives, in order, as the SDK parses them (and raw)."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.raw: list[dict] = []
        self.at: list[float] = []
        self.changed = asyncio.Event()
        self.task = asyncio.create_task(self._receive())

    async def _receive(self) -> None:
        while True:
            data = await self.connection.recv_bytes()
            self.connection.parse_event(data)  # the SDK's own parse of every event
            self.raw.append(json.loads(data))
            self.at.append(time.monotonic())
            self.changed.set()

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.raw if e["type"] == kind]

    def types(self) -> list[str]:
        return [e["type"] for e in self.raw]

    async def until(self, found: Callable[[], Any], timeout_s: float = 90.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while not (result := found()):
            if self.task.done():
                self.task.result()
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"timed out; events so far: {self.types()[-40:]}"
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), remaining)
            except TimeoutError:
                pass
        return result

    def close(self) -> None:
        self.task.cancel()


async def ask_for_a_story(connection: Any, events: Events) -> str:
    """A session with extension events (the reply's word cues) and room for a long reply; its id."""
    created = await events.until(lambda: events.of("session.created"))
    await connection.session.update(session={"type": "realtime", "max_output_tokens": 96,
                                             "specvox": {"extension_events": True}})
    return created[0]["session"]["id"]


async def story_interrupted(events: Events, mic: Mic, speech, after_s: float) -> list[dict]:
    """A long story asked for, then a question said over it `after_s` into its audio; the cancelled response."""
    mic.say(speech("Tell me a long story about a brave little dragon.", RATE))
    await events.until(lambda: events.of("response.output_audio.delta"))
    await asyncio.sleep(after_s)
    mic.say(speech("Stop, what is the capital of Spain?", RATE))
    return await events.until(lambda: [e for e in events.of("response.done")
                                       if e["response"]["status"] == "cancelled"])


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def heard_words(words: list[dict], audio_end_ms: int) -> str:
    return " ".join(w["text"] for w in words if w["end_ms"] - HEARD_SLACK_MS <= audio_end_ms)


async def test_the_ga_sdk_speaks_a_question_and_hears_the_answer(stack, speech):
    async with client(stack).realtime.connect(model="gpt-realtime") as connection:
        events = Events(connection)
        try:
            await events.until(lambda: events.of("session.created"))
            await connection.session.update(session={"type": "realtime", "max_output_tokens": 32})
            await events.until(lambda: events.of("session.updated"))
            with Mic(lambda pcm: connection.input_audio_buffer.append(audio=b64(pcm))) as mic:
                mic.say(speech("What is the capital of France?", RATE))
                await events.until(lambda: events.of("response.done"))
        finally:
            events.close()
    types = events.types()
    order = ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
             "input_audio_buffer.committed", "conversation.item.input_audio_transcription.completed",
             "response.created", "response.output_item.added", "response.content_part.added",
             "response.output_audio.delta", "response.output_audio.done", "response.output_audio_transcript.done",
             "response.output_item.done", "response.done"]
    positions = [types.index(kind) for kind in order]
    assert positions == sorted(positions), types
    [transcript] = events.of("conversation.item.input_audio_transcription.completed")
    assert "capital" in transcript["transcript"].lower()
    [done] = events.of("response.done")
    assert done["response"]["status"] in ANSWERED, done
    said = "".join(e["delta"] for e in events.of("response.output_audio_transcript.delta"))
    assert said and done["response"]["output"][0]["content"][0]["transcript"] == said
    audio = b"".join(base64.b64decode(e["delta"]) for e in events.of("response.output_audio.delta"))
    seconds = len(audio) / 2 / RATE
    assert seconds > 0.5 and np.abs(np.frombuffer(audio, "<i2")).max() > 1000  # 24 kHz speech, not silence


async def test_a_barge_in_cancels_the_response_and_the_truncate_leaves_the_heard_words_in_the_history(stack, speech):
    async with client(stack).realtime.connect(model="gpt-realtime") as connection:
        events = Events(connection)
        try:
            session_id = await ask_for_a_story(connection, events)
            with Mic(lambda pcm: connection.input_audio_buffer.append(audio=b64(pcm))) as mic:
                cancelled = await story_interrupted(events, mic, speech, after_s=1.5)
                # The client stops playing at speech_started (as Pipecat does) and says where: here, at the
                # end of the reply's second word (its loudspeaker runs late), less than the server reckoned.
                first_response = cancelled[0]["response"]["id"]
                words = [e for e in events.of("specvox.word") if e["response_id"] == first_response]
                audio_end_ms = words[1]["end_ms"]
                item_id = cancelled[0]["response"]["output"][0]["id"]
                await connection.conversation.item.truncate(item_id=item_id, content_index=0,
                                                            audio_end_ms=audio_end_ms)
                truncated = await events.until(lambda: events.of("conversation.item.truncated"))
                await events.until(lambda: [e for e in events.of("response.done")
                                            if e["response"]["status"] in ANSWERED])
                await connection.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=10**7)
                clamped = await events.until(lambda: events.of("conversation.item.truncated")[1:])
        finally:
            events.close()
    assert cancelled[0]["response"]["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
    types = events.types()
    interrupting = [i for i, t in enumerate(types) if t == "input_audio_buffer.speech_started"][1]
    assert interrupting < types.index("response.done")  # the user's speech, then the cancelled response
    assert truncated[0]["audio_end_ms"] == audio_end_ms
    assert 0 < clamped[0]["audio_end_ms"] < 10**7 and not events.of("error")  # past the audio sent: clamped
    past = await history(stack, session_id)
    # the first truncate said "The story" (two words) was heard: the history holds those words, cut off;
    # the clamped one said all the audio sent was heard: what the server's words reach there
    assert "dragon" in past[0].user.lower() and "spain" in past[1].user.lower()
    assert past[0].cut_off and past[0].assistant.startswith(heard_words(words, audio_end_ms)), past
    assert len(past[0].assistant.split()) >= 2


async def test_a_truncate_after_the_barge_in_amends_the_history(stack, speech):
    """The amendment alone: the reply interrupted, then the client's truncate names less than the server
    reckoned heard; the history is cut back to it."""
    async with client(stack).realtime.connect(model="gpt-realtime") as connection:
        events = Events(connection)
        try:
            session_id = await ask_for_a_story(connection, events)
            with Mic(lambda pcm: connection.input_audio_buffer.append(audio=b64(pcm))) as mic:
                cancelled = await story_interrupted(events, mic, speech, after_s=2.0)
                report = await events.until(lambda: [e for e in events.of("specvox.turn.report")
                                                     if e["response_id"] == cancelled[0]["response"]["id"]])
                response = cancelled[0]["response"]
                words = [e for e in events.of("specvox.word") if e["response_id"] == response["id"]]
                await connection.conversation.item.truncate(item_id=response["output"][0]["id"], content_index=0,
                                                            audio_end_ms=words[1]["end_ms"])
                await events.until(lambda: events.of("conversation.item.truncated"))
                await events.until(lambda: [e for e in events.of("response.done")
                                            if e["response"]["status"] in ANSWERED])
        finally:
            events.close()
    reckoned = report[0]["report"]["heard_text"]
    expected = heard_words(words, words[1]["end_ms"])
    assert len(reckoned.split()) > len(expected.split())  # the server had reckoned more heard
    past = await history(stack, session_id)
    assert (past[0].assistant, past[0].cut_off) == (expected, True), past


async def test_a_backchannel_over_the_reply_never_reaches_a_strict_client_and_the_response_completes(stack, speech):
    async with client(stack).realtime.connect(model="gpt-realtime") as connection:
        events = Events(connection)
        try:
            await events.until(lambda: events.of("session.created"))
            await connection.session.update(session={"type": "realtime", "max_output_tokens": 64,
                                                     "specvox": {"extension_events": True}})
            with Mic(lambda pcm: connection.input_audio_buffer.append(audio=b64(pcm))) as mic:
                mic.say(speech("Can you tell me how to plant a tree in my garden?", RATE))
                await events.until(lambda: events.of("response.output_audio.delta"))
                await asyncio.sleep(1.0)
                mic.say(speech("Yeah.", RATE))
                [done] = await events.until(lambda: events.of("response.done"))
        finally:
            events.close()
    assert done["response"]["status"] in ANSWERED, done
    assert len(events.of("input_audio_buffer.speech_started")) == 1  # the question's: "yeah" took no turn
    assert [e["reason"] for e in events.of("specvox.playback.resumed")] == ["backchannel"]
    assert len(events.of("specvox.playback.paused")) == 1


async def test_the_beta_sdk_speaks_g711_both_ways(stack, speech):
    async with client(stack).beta.realtime.connect(model="gpt-4o-realtime-preview") as connection:
        events = Events(connection)
        try:
            await events.until(lambda: events.of("session.created"))
            await connection.session.update(session={"input_audio_format": "g711_ulaw",
                                                     "output_audio_format": "g711_ulaw",
                                                     "max_response_output_tokens": 32})
            [updated] = await events.until(lambda: events.of("session.updated"))
            with Mic(lambda data: connection.input_audio_buffer.append(audio=b64(data)),
                     lambda pcm: g711.encode(pcm, "mulaw"), rate_hz=8_000) as mic:
                mic.say(speech("What is the capital of Italy?", 8_000))
                await events.until(lambda: events.of("response.done"))
        finally:
            events.close()
    assert (updated["session"]["input_audio_format"], updated["session"]["output_audio_format"]) == (
        "g711_ulaw", "g711_ulaw")
    types = events.types()
    assert "conversation.item.created" in types and "conversation.item.added" not in types
    assert "response.audio.delta" in types and "response.audio_transcript.delta" in types
    [transcript] = events.of("conversation.item.input_audio_transcription.completed")
    assert "italy" in transcript["transcript"].lower()
    assert events.of("response.done")[0]["response"]["status"] in ANSWERED
    audio = b"".join(base64.b64decode(e["delta"]) for e in events.of("response.audio.delta"))
    pcm = np.frombuffer(g711.decode(audio, "mulaw"), "<i2")
    assert len(audio) / 8_000 > 0.5 and np.abs(pcm).max() > 1000  # 8 kHz µ-law speech


async def test_turn_detection_off_the_client_commits_and_asks(stack, speech):
    async with client(stack).realtime.connect(model="gpt-realtime") as connection:
        events = Events(connection)
        try:
            await events.until(lambda: events.of("session.created"))
            await connection.session.update(session={"type": "realtime", "max_output_tokens": 24,
                                                     "audio": {"input": {"turn_detection": None}}})
            await events.until(lambda: events.of("session.updated"))
            with Mic(lambda pcm: connection.input_audio_buffer.append(audio=b64(pcm))) as mic:
                said = mic.say(speech("What is two plus two?", RATE))
                await said.wait()
                await connection.input_audio_buffer.commit()
                await connection.response.create(response={"metadata": {"ask": "sum"}})
                await events.until(lambda: events.of("response.done"))
        finally:
            events.close()
    assert not events.of("input_audio_buffer.speech_started")  # no server VAD
    [transcript] = events.of("conversation.item.input_audio_transcription.completed")
    assert "two" in transcript["transcript"].lower() or "2" in transcript["transcript"]
    [created] = events.of("response.created")
    assert created["response"]["metadata"] == {"ask": "sum"}
    assert events.of("response.done")[0]["response"]["status"] in ANSWERED


async def test_bad_frames_get_openai_errors_and_the_connection_goes_on(stack):
    async with client(stack).realtime.connect(model="gpt-realtime") as connection:
        events = Events(connection)
        try:
            await events.until(lambda: events.of("session.created"))
            await connection.send_raw("{not json")
            await connection.send_raw(json.dumps({"type": "input_audio_buffer.pour", "event_id": "evt_1"}))
            await connection.send_raw(json.dumps({"type": "session.update", "event_id": "evt_2", "session": {
                "type": "realtime", "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16_000}}}}}))
            await connection.send_raw(json.dumps({"type": "session.update", "event_id": "evt_3", "session": {
                "type": "realtime", "audio": {"output": {"voice": "no-such-voice"}}}}))
            await connection.send_raw(json.dumps({"type": "input_audio_buffer.append", "audio": "A" * (5 << 20)}))
            await connection.send_raw(json.dumps({"type": "conversation.item.truncate", "event_id": "evt_4",
                                                  "item_id": "item_nope", "content_index": 0, "audio_end_ms": 10}))
            errors = await events.until(lambda: len(events.of("error")) >= 6 and events.of("error"))
            await connection.session.update(session={"type": "realtime", "instructions": "Be brief."})
            [updated] = await events.until(lambda: events.of("session.updated"))
        finally:
            events.close()
    codes = [(e["error"]["code"], e["error"]["event_id"]) for e in errors]
    assert codes == [("invalid_json", None), ("invalid_value", "evt_1"), ("invalid_value", "evt_2"),
                     ("invalid_value", "evt_3"), ("message_too_large", None), ("item_not_found", "evt_4")]
    assert all(e["error"]["type"] == "invalid_request_error" and e["error"]["message"] for e in errors)
    assert updated["session"]["instructions"] == "Be brief."


def run_client(script: str, stack, *args: str, timeout_s: float = 240) -> dict:
    """A client script in the clients' environment (`make clients`), its JSON result."""
    if not CLIENTS_PYTHON.exists():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{CLIENTS_PYTHON} is missing: CI must build it (make clients)")
        pytest.skip("the clients' environment is not built (make clients)")
    done = subprocess.run([str(CLIENTS_PYTHON), str(ROOT / "tests" / "clients" / script),
                           f"ws://{stack['http']}/v1/realtime", *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def speech_file(speech, tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / f"{name}.pcm"
    path.write_bytes(float_to_pcm16(speech(text, RATE)))
    return str(path)


async def test_pipecat_realtime_service_holds_two_turns_and_a_barge_in(stack, speech, tmp_path):
    files = [speech_file(speech, tmp_path, name, text) for name, text in (
        ("one", "My name is Anna and I play tennis."), ("two", "Tell me a long story about a brave little dragon."),
        ("three", "Stop, what sport do I play?"))]
    result = await asyncio.to_thread(run_client, "pipecat_realtime.py", stack, *files)
    assert result["errors"] == [], result
    assert "tennis" in result["transcripts"][0].lower()
    statuses = [(r["status"], r["reason"]) for r in result["responses"]]
    answered = [s for s in statuses if s in (("completed", None), ("incomplete", "max_output_tokens"))]
    assert len(answered) >= 2 and ("cancelled", "turn_detected") in statuses, result
    assert result["truncated"], result  # Pipecat truncated the interrupted reply where it stopped playing
    past = await history(stack, result["session_id"])
    assert any(h.cut_off for h in past) and "tennis" in past[0].user.lower()


async def test_livekit_realtime_model_answers_a_spoken_question_and_a_generate_reply(stack, speech, tmp_path):
    """LiveKit's RealtimeSession on its own: its AgentSession needs a LiveKit server and room (WebRTC) to
    carry the audio, which is no part of the Realtime API (tests/clients/livekit_realtime.py says more)."""
    async with client(stack).realtime.connect(model="gpt-realtime") as connection:
        voice = (await connection.recv()).session.audio.output.voice  # session.created: the gateway's voice
    question = speech_file(speech, tmp_path, "question", "What is the capital of France?")
    result = await asyncio.to_thread(run_client, "livekit_realtime.py", stack, voice, question)
    assert result["errors"] == [], result
    assert "capital" in result["user"].lower() and result["generations"] == 2 and result["audio_s"] > 0.5, result
    assert result["reply_metadata_ok"], result  # generate_reply: response.created carried LiveKit's client_event_id


async def test_a_connection_takes_the_session_it_names(stack):
    import grpc
    from websockets.exceptions import InvalidStatus

    from services.protos import load

    gw, gw_grpc = load("gateway")
    async with grpc.aio.insecure_channel(stack["gateway"]) as channel:
        session = await gw_grpc.GatewayStub(channel).CreateSession(gw.CreateSessionRequest(
            config=gw.SessionConfig(system_prompt="You are a pirate.", max_reply_tokens=40)))
    async with client(stack).realtime.connect(model="gpt-realtime",
                                              extra_query={"session_id": session.session_id}) as connection:
        created = await connection.recv()
    assert created.session.id == session.session_id and created.session.instructions == "You are a pirate."
    assert created.session.max_output_tokens == 40
    with pytest.raises(InvalidStatus) as refused:  # an unknown session: refused before the upgrade
        async with client(stack).realtime.connect(model="gpt-realtime", extra_query={"session_id": "nope"}):
            pass
    assert refused.value.response.status_code == 404
    import aiohttp

    async with aiohttp.ClientSession() as http, http.get(f"http://{stack['http']}/v1/realtime") as response:
        body = await response.json()
    assert response.status == 400 and body["error"]["code"] == "websocket_required"  # no upgrade: no session made


async def test_a_caption_connection_gets_captions_of_the_speech_and_no_response(stack, speech):
    """`?mode=caption` makes the connection's session a caption one (the Realtime API has no field for a
    mode): the speaker's words come back as opt-in `specvox.caption` events, and no response is made."""
    async with client(stack).realtime.connect(model="gpt-realtime", extra_query={"mode": "caption"}) as connection:
        events = Events(connection)
        try:
            await events.until(lambda: events.of("session.created"))
            await connection.send({"type": "session.update", "session": {
                "type": "realtime", "specvox": {"extension_events": True}}})
            await events.until(lambda: events.of("session.updated"))
            with Mic(lambda pcm: connection.input_audio_buffer.append(audio=b64(pcm))) as mic:
                mic.say(speech("What is the capital of France?", RATE))
                await events.until(lambda: [e for e in events.of("specvox.caption") if not e.get("provisional")])
        finally:
            events.close()
    final = [e for e in events.of("specvox.caption") if not e.get("provisional")][0]
    assert "capital" in json.dumps(final).lower(), final
    assert not events.of("response.created"), events.types()


async def test_an_unknown_mode_is_refused_before_the_upgrade(stack):
    import aiohttp

    upgrade = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
               "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}
    async with aiohttp.ClientSession() as http, \
            http.get(f"http://{stack['http']}/v1/realtime?mode=karaoke", headers=upgrade) as r:
        body = await r.json()
    assert r.status == 400 and body["error"]["param"] == "mode", body
