"""Visemes for real: the tts service's Synthesize with the bundled voice, and a conversation through `specvox up`.

The tts's visemes must sit on the samples the client plays: at the voice's own rate and
resampled, each one lies where the voice's phoneme alignment put its phonemes, in the reply's
timeline, and comes just before the audio chunk it starts in; the audio under them sounds as
they say (closed lips and pauses quiet, open vowels loud). Through the gateway they come
between the audio in the same way, and none of an interrupted turn follows its interrupt.
"""

from __future__ import annotations

import asyncio
import json
from itertools import pairwise

import grpc
import numpy as np
import pytest

from pipeline.audio import PcmFormat, float_to_pcm16
from pipeline.tts.visemes import visemes_from_alignment
from services.channels import message_size_options
from services.client import ClientOptions, Say, converse_script, write_outputs
from services.protos import load
from services.settings import Settings
from services.stages.tts import TtsServicer
from services.store.context import open_redis

tts, tts_grpc = load("tts")
gw, _ = load("gateway")
VOICE_RATE = 22_050
# Sentences of at most five words, so every phrase the service cuts is one sentence.
TEXT = "Map the way home. She sat by the water. Five big boats, then two."
PHRASES = ["Map the way home.", "She sat by the water.", "Five big boats, then two."]


@pytest.fixture(scope="module")
async def service(redis_url, synthesizer):
    settings = Settings(redis_url=redis_url)
    redis = await open_redis(settings)
    server = grpc.aio.server(options=message_size_options(settings.max_message_bytes))
    tts_grpc.add_TtsServicer_to_server(TtsServicer(settings, synthesizer, redis), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield tts_grpc.TtsStub(channel)
    await channel.close()
    await server.stop(grace=1)
    await redis.close()


def chunk_end_s(chunk) -> float:
    return chunk.start_s + len(chunk.pcm_s16le) / 2 / chunk.sample_rate_hz


def voice_alignment_visemes(synthesizer, text: str) -> list:
    """The visemes of a phrase from the voice's own phoneme widths (its encoder run alone), sentence
    after sentence, in seconds from the phrase's start."""
    out, offset = [], 0.0
    config = synthesizer.phonemizer.config
    for phonemes in synthesizer.phonemizer.phonemize(text):
        phonemes = [p for p in phonemes if p in config.phoneme_id_map]
        widths, _ = synthesizer.model.run(synthesizer.phonemizer.phonemes_to_ids(phonemes), synthesizer.inputs)
        alignment = synthesizer._phoneme_samples(phonemes, widths * config.hop_length)
        out += [(v.viseme, v.start_s + offset, v.end_s + offset) for v in visemes_from_alignment(alignment, VOICE_RATE)]
        offset += sum(n for _, n in alignment) / VOICE_RATE
    return out


async def synthesize(stub, rate: int) -> list:
    return [e async for e in stub.Synthesize(tts.SynthesizeRequest(text=TEXT, sample_rate_hz=rate))]


@pytest.mark.parametrize("rate", [0, 16_000])
async def test_visemes_lie_on_the_voice_s_phoneme_alignment_and_precede_their_audio(service, synthesizer, rate):
    events = await synthesize(service, rate)
    kinds = [e.WhichOneof("event") for e in events]
    chunks = [e.audio for e in events if e.WhichOneof("event") == "audio"]
    visemes = [e.viseme for e in events if e.WhichOneof("event") == "viseme"]
    assert [e.cue.text for e in events if e.WhichOneof("event") == "cue"] == PHRASES
    out_rate = rate or VOICE_RATE
    audio_s = sum(len(c.pcm_s16le) / 2 for c in chunks) / out_rate

    # Each viseme comes just before the audio chunk its start falls in.
    pending = []
    for kind, event in zip(kinds, events, strict=True):
        if kind == "viseme":
            pending.append(event.viseme)
        elif kind == "audio":
            assert all(event.audio.start_s - 1e-6 <= v.start_s < chunk_end_s(event.audio) for v in pending), (
                event.audio.start_s, [v.start_s for v in pending])
            pending = []
    assert not pending

    # They tile the reply's audio, in order, from its first sample to its last.
    assert visemes[0].start_s == 0 and visemes[-1].end_s == pytest.approx(audio_s, abs=1 / out_rate)
    assert all(0 <= b.start_s - a.end_s <= 1 / out_rate for a, b in pairwise(visemes))  # no gap past a sample
    assert not any(v.approximate for v in visemes)

    # Exactly where the voice's own alignment put each phoneme, each phrase from its first sample.
    phrase_starts = {}
    for c in chunks:
        phrase_starts.setdefault(c.phrase_index, c.start_s)
    tolerance_s = 1e-9 if not rate else 1.0 / out_rate
    for index, text in enumerate(PHRASES):
        expected = [(name, phrase_starts[index] + a, phrase_starts[index] + b)
                    for name, a, b in voice_alignment_visemes(synthesizer, text)]
        got = [(v.id, v.start_s, v.end_s) for v in visemes if v.phrase_index == index]
        assert [g[0] for g in got] == [e[0] for e in expected], text
        assert max(abs(g[1] - e[1]) for g, e in zip(got, expected, strict=True)) <= tolerance_s
        assert max(abs(g[2] - e[2]) for g, e in zip(got, expected, strict=True)) <= tolerance_s


async def test_the_audio_under_each_viseme_sounds_as_it_says(service):
    """Closures (lips, tongue) and pauses are quiet, open vowels loud: what an offset timeline would not give."""
    events = await synthesize(service, 0)
    chunks = [e.audio for e in events if e.WhichOneof("event") == "audio"]
    audio = np.concatenate([np.frombuffer(c.pcm_s16le, "<i2") / 32768.0 for c in chunks])

    def loudness(names: set[str]) -> float:
        spans = [audio[int(v.start_s * VOICE_RATE) : int(v.end_s * VOICE_RATE)] for e in events
                 if e.WhichOneof("event") == "viseme" and (v := e.viseme).id in names]
        return float(np.sqrt(np.mean(np.concatenate(spans) ** 2)))

    # Measured here: vowels 3.0x the stops' closures, pauses 0.026x the vowels; the same visemes 30 ms
    # late gave 1.6x and 0.075x, 50 ms early 2.0x and 0.042x.
    vowels, stops, pauses = loudness({"aa", "E", "oh"}), loudness({"PP", "DD", "kk"}), loudness({"sil"})
    assert vowels > 2.5 * stops, (vowels, stops)
    assert pauses < 0.05 * vowels, (vowels, pauses)


def pcm(samples: np.ndarray) -> bytes:
    return float_to_pcm16(samples)


@pytest.mark.e2e
async def test_the_gateway_sends_visemes_with_their_audio_and_none_after_an_interrupt(stack, speech, tmp_path):
    options = ClientOptions(chunk_ms=40, wait_for_replies=True, trailing_silence_s=0.5,
                            config=gw.SessionConfig(max_reply_tokens=96))
    turns = await asyncio.wait_for(converse_script(stack["gateway"], [
        Say(pcm(speech("Tell me a long story about a brave little dragon."))),
        Say(pcm(speech("Stop, what is the capital of Spain?")), barge_in_after_s=1.2),
    ], PcmFormat(16_000, 1, 2), options), 150)
    spoken_over = next(t for t in turns if t.report and t.report["finish_reason"] == "interrupted")
    answered = [t for t in turns if t.report and t.report["finish_reason"] in ("eos", "length", "stop")]
    assert answered and spoken_over.interrupt
    assert spoken_over.visemes_after_interrupt == 0 and spoken_over.audio_after_interrupt == 0
    for turn in (spoken_over, *answered):
        assert turn.visemes, "no visemes came with the reply"
        chunks = [(start, start + len(audio) / 2 / turn.sample_rate_hz) for start, audio in turn.audio]
        for chunks_before, viseme in turn.visemes:  # between the audio: just before the chunk it starts in
            assert chunks_before < len(chunks), "a viseme came without its audio"
            start, end = chunks[chunks_before]
            assert start - 1e-6 <= viseme.start_s < end
            # an answered reply's end inside its audio; the interrupted one's last may run into audio never sent
            assert viseme.end_s <= chunks[-1][1] + 1e-3 or turn is spoken_over
        visemes = [v for _, v in turn.visemes]
        assert all(a.end_s <= b.start_s + 1e-6 for a, b in pairwise(visemes))
        assert {v.id for v in visemes} - {"sil"} and not any(v.approximate for v in visemes)
    write_outputs(turns, str(tmp_path))  # the client's file: the last answered reply's visemes
    written = json.loads((tmp_path / "visemes.json").read_text())
    assert [(v["id"], v["start_s"]) for v in written] == [(v.id, v.start_s) for _, v in answered[-1].visemes]
