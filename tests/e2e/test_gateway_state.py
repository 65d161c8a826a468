"""A Converse stream's own state stays bounded however long the stream runs (an avatar session
may stay open for an hour), and is freed when the stream ends, by reference counting alone.

The soak (bench/soak.py) opens a fresh stream every five turns, so it would not see a per-stream
record that grows with time; these check the records themselves. And a stream's state that only
the cyclic collector frees waits, once promoted, for a full collection: a soak's gateway held 30
ended conversations at minute 12, their audio clocks with them (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import gc
import time

import pytest

from pipeline.audio import PcmFormat, float_to_pcm16
from services.client import ClientOptions, Say, converse_script
from services.gateway.service import (
    KEPT_UNHEARD_TURNS,
    KEPT_UTTERANCES,
    AudioArrivalClock,
    Conversation,
    GatewayServicer,
    Stubs,
)
from services.protos import load, load_common
from services.runtime import open_redis
from services.server import metrics
from services.settings import Settings
from tests.inprocess import four_services

gw, _ = load("gateway")
asr, _ = load("asr")
common = load_common()
PCM16K = common.AudioFormat(encoding=common.AudioFormat.PCM_S16LE, sample_rate_hz=16_000, channels=1,
                            sample_width_bytes=2)
CHUNK = bytes(PcmFormat(16_000, 1, 2).bytes_per_s * 40 // 1000)  # 40 ms


def test_the_arrival_clock_keeps_the_last_two_minutes_of_a_two_hour_stream():
    clock = AudioArrivalClock(PCM16K)
    chunks = 2 * 3600 * 25
    before = int(time.time() * 1000)
    for _ in range(chunks):
        clock.received(CHUNK)
    assert len(clock._ends_s) == len(clock._arrivals_ms) <= 2 * 120 * 25 + 1
    assert clock._ends_s[-1] == pytest.approx(7200.0)
    # an utterance that just ended maps to when its audio came, as before the bound
    assert before <= clock.arrival_ms(7199.5) <= int(time.time() * 1000)
    assert clock.arrival_ms(7199.5) >= clock.arrival_ms(7100.0)


async def test_a_long_conversation_keeps_only_its_latest_transcripts_and_interrupted_turns(redis_url):
    settings = Settings(redis_url=redis_url)
    redis = await open_redis(settings)
    try:
        servicer = GatewayServicer(settings, redis, Stubs(asr=None, llm=None, tts=None))
        start = gw.StreamStart(session_id="s", format=PCM16K)
        conversation = Conversation(servicer, start, gw.SessionConfig())
        for utterance in range(200):  # finals with no words: transcribed, no turn to start
            await conversation._on_transcript(asr.TranscriptEvent(kind=asr.TranscriptEvent.FINAL,
                                                                  utterance_index=utterance, text=""))
        assert sorted(conversation.finals) == list(range(200 - KEPT_UTTERANCES, 200))
        for n in range(100):
            conversation.unheard.append(f"turn-{n}")
        assert list(conversation.unheard) == [f"turn-{n}" for n in range(100 - KEPT_UNHEARD_TURNS, 100)]
    finally:
        await redis.close()


@pytest.mark.e2e
async def test_a_finished_conversation_and_its_turns_are_freed_without_the_cyclic_collector(redis_url, speech):
    settings = Settings(redis_url=redis_url)
    audio = float_to_pcm16(speech("What is the capital of France?"))
    async with four_services(settings) as addresses:
        gc.collect()
        gc.disable()  # what is freed now is freed by reference counting
        try:
            turns = await converse_script(addresses["gateway"], [Say(audio)], PcmFormat(16_000, 1, 2), ClientOptions(
                chunk_ms=40, realtime=False, wait_for_replies=True, config=gw.SessionConfig(max_reply_tokens=12)))
            assert turns[0].report and turns[0].report["finish_reason"] in ("eos", "length"), turns
            await asyncio.sleep(0.5)  # the stream's handler returns after the client has its end
            left = list(metrics._conversations)  # a WeakSet: only what something still holds
            assert not left, f"{len(left)} ended conversation(s) wait for the cyclic collector"
        finally:
            gc.enable()
