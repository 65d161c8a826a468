"""A live session through `specvox up`: real services, real Valkey, real speech, a real player.

The reference client speaks a script in real time and plays each reply as a loudspeaker
would, reporting its position; the tests check what the user experiences: a second turn
built on the first, a barge-in (pause, then interrupt, and only the heard words in the
history), a backchannel and a cough (pause, then resume), a budget too small to meet,
a client that goes away, caption mode, and session configs that are refused.
"""

from __future__ import annotations

import asyncio
import html
from itertools import pairwise

import grpc
import numpy as np
import pytest
import webvtt

from pipeline.audio import PcmFormat, float_to_pcm16
from services.client import ClientOptions, Say, converse_script
from services.protos import load, load_common
from services.store.client import connect
from services.store.turn_log import read_token_stream
from tests.grpc_status import expect_status
from tests.session_history import history

pytestmark = pytest.mark.e2e
gw, gw_grpc = load("gateway")
common = load_common()
FMT = PcmFormat(16_000, 1, 2)
ANSWERED = ("eos", "length", "stop")


def pcm(samples: np.ndarray) -> bytes:
    return float_to_pcm16(samples)


async def talk(stack, says: list[Say], **config) -> list:
    options = ClientOptions(chunk_ms=40, wait_for_replies=True, trailing_silence_s=0.5,
                            config=gw.SessionConfig(**config))
    return await asyncio.wait_for(converse_script(stack["gateway"], says, FMT, options), 150)


def answered(turns: list) -> list:
    return [t for t in turns if t.report and t.report["finish_reason"] in ANSWERED]


def session_of(turns: list) -> str:
    return turns[0].report["session_id"]


async def test_a_second_turn_builds_on_the_first(stack, speech):
    turns = await talk(stack, [Say(pcm(speech("My name is Anna and I play tennis."))),
                               Say(pcm(speech("What sport do I play?")), gap_s=0.3)], max_reply_tokens=24)
    first, second = answered(turns)
    assert "tennis" in first.transcript.lower() and "sport" in second.transcript.lower()
    assert first.report["heard_text"] and not first.report["cut_off"]
    # The second prompt is the first conversation extended: llm prefilled only what is new.
    assert second.report["prefix_cached_tokens"] > len(first.report["transcript"].split())
    past = await history(stack, first.report["session_id"])
    assert [h.user for h in past] == [first.report["transcript"], second.report["transcript"]]
    assert past[0].assistant == first.report["heard_text"] and not past[0].cut_off


async def test_barge_in_pauses_then_interrupts_and_only_the_heard_words_are_remembered(stack, speech):
    turns = await talk(stack, [
        Say(pcm(speech("Tell me a long story about a brave little dragon."))),
        Say(pcm(speech("Stop, what is the capital of Spain?")), barge_in_after_s=1.2),
    ], max_reply_tokens=96)
    spoken_over = next(t for t in turns if t.report and t.report["finish_reason"] == "interrupted")
    assert spoken_over.pauses_unix_ms and spoken_over.interrupt
    assert spoken_over.pauses_unix_ms[0] <= spoken_over.interrupt["unix_ms"]
    assert spoken_over.audio_after_interrupt == 0  # the gateway sent none of its audio after the interrupt
    heard = spoken_over.report["heard_text"]
    assert spoken_over.report["cut_off"] and heard
    assert len(heard.split()) < len(spoken_over.report["reply_text"].split())
    assert spoken_over.report["reply_text"].startswith(heard.split()[0])
    # "Stop," and its pause may make two bursts of voice: each pauses, the first one resumes.
    report = spoken_over.report
    assert report["interrupts"] == 1 and report["pauses"] >= 1 and report["resumes"] == report["pauses"] - 1
    nxt = answered(turns)[-1]
    assert "spain" in nxt.transcript.lower() and nxt.report["voice_to_voice_ms"] is not None
    past = await history(stack, spoken_over.report["session_id"])
    assert past[0].assistant == heard and past[0].cut_off  # never the whole reply
    assert len(past) == 2 and "spain" in past[1].user.lower()


async def test_a_backchannel_pauses_then_resumes_and_the_reply_completes(stack, speech):
    turns = await talk(stack, [
        Say(pcm(speech("Can you tell me how to plant a tree in my garden?"))),
        Say(pcm(speech("Yeah.")), barge_in_after_s=1.0),
    ], max_reply_tokens=64)
    reply = answered(turns)
    assert len(reply) == 1, [t.report for t in turns]  # "yeah" did not become a turn
    turn = reply[0]
    assert turn.pauses_unix_ms and turn.resumes == ["backchannel"]
    assert not turn.report["cut_off"] and turn.report["heard_text"]
    assert (turn.report["pauses"], turn.report["resumes"], turn.report["interrupts"]) == (1, 1, 0)


async def test_a_cough_during_a_reply_pauses_then_resumes(stack, speech):
    # 150 ms of the onset of "Wow.": voice, too short for speech. Silero's probabilities for a blip
    # this short swing with its alignment to the VAD's 32 ms windows and with the audio before it:
    # 150 ms of the onset of "Ah." was heard as voice at 126 of 160 alignments and gaps after a
    # sentence (a CI run missed it), this one at all 192 tried (6 gaps x 32 alignments, its
    # second-highest window at 0.77 or more against the 0.5 threshold), never as an utterance,
    # and the same at 140 and 160 ms.
    wow = speech("Wow.")
    voiced = np.flatnonzero(np.abs(wow) > 0.05)
    burst = wow[voiced[0] : voiced[0] + int(0.15 * 16_000)].copy()
    fade = np.linspace(0, 1, 80, dtype=np.float32)  # 5 ms, so that the cut makes no click
    burst[:80] *= fade
    burst[-80:] *= fade[::-1]
    turns = await talk(stack, [
        Say(pcm(speech("What should I cook for dinner tonight?"))),
        Say(pcm(np.concatenate([np.zeros(1600, np.float32), burst, np.zeros(1600, np.float32)])),
            barge_in_after_s=1.0),
    ], max_reply_tokens=48)
    turn = answered(turns)[0]
    assert turn.pauses_unix_ms and turn.resumes == ["noise"]
    assert not turn.report["cut_off"] and turn.report["resumes"] == 1


async def test_a_one_millisecond_budget_degrades_every_stage_and_still_answers(stack, speech):
    first = await talk(stack, [Say(pcm(speech("Hello there, I am Sam.")))], max_reply_tokens=16)
    session_id = first[0].report["session_id"]
    options = ClientOptions(chunk_ms=40, wait_for_replies=True, trailing_silence_s=0.5, session_id=session_id,
                            overrides=gw.SessionConfig(budget_ms=1, max_reply_tokens=64))
    turns = await asyncio.wait_for(converse_script(
        stack["gateway"], [Say(pcm(speech("Why is the sky blue?")))], FMT, options), 120)
    report = answered(turns)[0].report
    assert report["budget_ms"] == 1 and report["budget_missed"]
    # Every stage gave up what could act (history only where it shortens the prefill: a cached
    # history costs nothing to keep), and the turn still completed.
    assert {"tts:first_phrase_shortened", "llm:reply_capped"} <= set(report["degradations"])
    assert report["heard_text"] and answered(turns)[0].reply_text.strip()


async def test_a_client_that_goes_away_mid_reply_stops_its_work(stack, speech):
    channel = grpc.aio.insecure_channel(stack["gateway"])
    stub = gw_grpc.GatewayStub(channel)
    session = await stub.CreateSession(gw.CreateSessionRequest(config=gw.SessionConfig(max_reply_tokens=200)))
    audio = pcm(speech("Please describe every planet of the solar system in detail.")) + b"\0" * 32_000

    async def messages():
        yield gw.ClientMessage(start=gw.StreamStart(session_id=session.session_id, format=common.AudioFormat(
            encoding=common.AudioFormat.PCM_S16LE, sample_rate_hz=16_000, channels=1)))
        for i in range(0, len(audio), 1280):
            await asyncio.sleep(0.04)
            yield gw.ClientMessage(audio=audio[i : i + 1280])
        await asyncio.sleep(60)

    call = stub.Converse(messages())
    turn_id = ""
    async for event in call:
        if event.WhichOneof("event") == "audio":
            turn_id = event.turn_id
            break
    call.cancel()  # the client is gone
    await channel.close()
    assert turn_id
    redis = connect(stack["redis"])
    try:
        entries = [e async for e in read_token_stream(redis, turn_id, timeout_s=10)]
    finally:
        await redis.aclose()
    assert entries[-1].end and entries[-1].finish_reason == "cancelled"
    assert sum(len(e.token_ids) for e in entries) < 200  # it stopped well before its cap


async def test_caption_mode_times_cleaned_captions_on_the_input_timeline(stack, speech):
    says = [Say(pcm(speech("um so the meeting is moved to three o'clock on friday"))),
            Say(pcm(speech("please bring the budget report")), gap_s=0.2)]
    turns = await talk(stack, says, mode=gw.SessionConfig.CAPTION,
                       caption_formats=[gw.SessionConfig.WEBVTT, gw.SessionConfig.SRT])
    captioned = [t for t in turns if t.caption is not None]
    assert len(captioned) == 2 and all(not t.audio for t in turns)
    for turn in captioned:
        words = turn.words
        lo, hi = words[0]["start_s"], words[-1]["end_s"]
        cues = list(turn.caption.cues)
        assert cues and turn.caption.text.strip()
        assert all(lo - 0.15 <= c.start_s < c.end_s <= hi + 0.15 for c in cues)
        assert all(a.end_s <= b.start_s for a, b in pairwise(cues))
        parsed = webvtt.from_string(turn.caption.webvtt)
        assert [html.unescape(c.text) for c in parsed] == [c.text for c in turn.caption.lines]
        assert turn.caption.srt.startswith("1\n")
        assert turn.report["mode"] == "caption"
    assert captioned[0].caption.cues[0].start_s < captioned[1].caption.cues[0].start_s


async def test_caption_mode_hears_a_sentence_cut_at_a_pause_whole(stack, speech):
    """In caption mode the gateway asks the asr to go on from the speech before a pause
    (caption_context_pause_ms): "how do volcanoes form?" after "I have a question," and half a second
    is captioned as said, where the same audio heard alone is "Happy volcano's form." (whisper tiny;
    tests/e2e/test_services.py streams it both ways)."""
    paused = np.concatenate([speech("I have a question,"), np.zeros(8000, np.float32),
                             speech("how do volcanoes form?")])
    turns = await talk(stack, [Say(pcm(paused))], mode=gw.SessionConfig.CAPTION)
    captions = [t.caption.text for t in turns if t.caption is not None]
    assert len(captions) == 2 and "how do volcanoes form" in captions[1].lower(), captions


@pytest.mark.parametrize(("config", "field"), [
    ({"voice": "nobody"}, "config.voice"),
    ({"drafter": "telepathy"}, "config.drafter"),
    ({"mode": 7}, "config.mode"),
    ({"caption_formats": [9]}, "config.caption_formats"),
    ({"reply_sample_rate_hz": 7}, "config.reply_sample_rate_hz"),
    ({"budget_ms": 10**6}, "config.budget_ms"),
    ({"max_reply_tokens": 100_000}, "config.max_reply_tokens"),
    ({"language": "English"}, "config.language"),
    ({"sampling": common.Sampling(temperature=-1)}, "config.sampling"),
    ({"backchannels": [""]}, "config.backchannels"),
])
async def test_bad_session_config_values_are_refused_by_name(stack, config, field):
    async with grpc.aio.insecure_channel(stack["gateway"]) as channel:
        stub = gw_grpc.GatewayStub(channel)
        await expect_status(grpc.StatusCode.INVALID_ARGUMENT, field,
                            stub.CreateSession(gw.CreateSessionRequest(config=gw.SessionConfig(**config))))
        # The same value as a stream's override is refused alike, before any audio is taken.
        session = await stub.CreateSession(gw.CreateSessionRequest())
        start = gw.StreamStart(session_id=session.session_id, overrides=gw.SessionConfig(**config),
                               format=common.AudioFormat(encoding=common.AudioFormat.PCM_S16LE, sample_rate_hz=16_000))
        await expect_status(grpc.StatusCode.INVALID_ARGUMENT, field,
                            stub.Converse(iter([gw.ClientMessage(start=start)])))
        assert session.config.budget_ms == 800 and session.config.mode == gw.SessionConfig.DIALOGUE
