"""The tts service for real: the deterministic bundled voice, real Valkey, gRPC on loopback.

Speech heard back by the asr stage, captions read by third-party parsers (webvtt-py,
srt), token streams that arrive slowly, in bursts, empty or unfinished, long text,
and a cancelled call.
"""

from __future__ import annotations

import asyncio
import difflib
import io
import time
import tracemalloc
from itertools import pairwise

import grpc
import jiwer
import numpy as np
import pytest
import srt
import webvtt

from pipeline.asr import Utterance
from pipeline.asr_stream import normalised_text
from services.channels import message_size_options
from services.protos import load
from services.settings import Settings
from services.stages.tts import AUDIO_CHUNK_S, TtsServicer
from services.store.client import now_ms
from services.store.context import open_redis
from services.store.turn_log import TokenEntry, TokenStreamWriter
from tests.grpc_status import expect_status

tts, tts_grpc = load("tts")
RATE = 16_000
REPLY = ("Hello there, my friend. The weather in Paris is lovely today, with clear skies and a gentle breeze. "
         "We could walk along the river after lunch.")
WER_BOUND = 0.15  # whisper tiny.en hearing the bundled voice
WORD_TOLERANCE_S = 0.150


@pytest.fixture(scope="module")
async def service(redis_url, synthesizer):
    settings = Settings(redis_url=redis_url, token_timeout_s=5.0)
    redis = await open_redis(settings)
    server = grpc.aio.server(options=message_size_options(settings.max_message_bytes))
    servicer = TtsServicer(settings, synthesizer, redis)
    tts_grpc.add_TtsServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield tts_grpc.TtsStub(channel), redis
    await channel.close()
    await server.stop(grace=1)
    await redis.close()


async def collect(call) -> dict:
    out: dict = {"audio": [], "cues": [], "words": [], "captions": None, "times": None}
    async for event in call:
        kind = event.WhichOneof("event")
        if kind == "audio":
            out["audio"].append(event.audio)
        elif kind == "cue":
            out["cues"].append(event.cue)
        elif kind == "word":
            out["words"].append(event.word)
        else:
            out[kind] = getattr(event, kind)
    return out


def samples(result: dict) -> np.ndarray:
    return np.frombuffer(b"".join(a.pcm_s16le for a in result["audio"]), "<i2").astype(np.float32) / 32768


def seconds(timestamp) -> float:
    return timestamp.in_milliseconds() / 1000


def check_timeline(result: dict, rate: int = RATE) -> float:
    """Chunks are contiguous and short; phrase cues tile the audio; word cues are ordered, inside it."""
    audio_s = samples(result).size / rate
    starts = [a.start_s for a in result["audio"]]
    ends = [a.start_s + len(a.pcm_s16le) / 2 / rate for a in result["audio"]]
    assert all(abs(e - s) < 1e-3 for e, s in zip(ends, starts[1:], strict=False))
    assert all(len(a.pcm_s16le) / 2 <= AUDIO_CHUNK_S * rate for a in result["audio"])
    cues = result["cues"]
    assert cues[0].start_s == 0 and cues[-1].end_s == pytest.approx(audio_s, abs=2e-3)
    assert all(a.end_s == b.start_s for a, b in pairwise(cues))
    words = result["words"]
    assert all(0 <= w.start_s <= w.end_s <= audio_s + 1e-3 for w in words)
    assert all(a.end_s <= b.start_s for a, b in pairwise(words))
    return audio_s


async def test_reply_speech_is_heard_back_and_its_word_cues_match_the_asr_word_times(service, transcriber):
    stub, _ = service
    result = await collect(stub.Synthesize(tts.SynthesizeRequest(text=REPLY, sample_rate_hz=RATE)))
    audio_s = check_timeline(result)
    heard = transcriber.transcribe(Utterance(0, 0.0, audio_s, samples(result)))
    assert jiwer.wer(normalised_text(REPLY), normalised_text(heard.text)) <= WER_BOUND, heard.text

    docs = result["captions"]
    vtt_words = webvtt.from_string(docs.words_webvtt)
    assert [c.text for c in vtt_words] == REPLY.split()
    vtt_phrases = webvtt.from_string(docs.phrases_webvtt)
    assert normalised_text(" ".join(c.text for c in vtt_phrases)) == normalised_text(REPLY)
    assert seconds(vtt_phrases[-1].end_time) == pytest.approx(audio_s, abs=2e-3)
    srt_words = list(srt.parse(docs.words_srt))
    assert [c.content for c in srt_words] == REPLY.split()
    assert all(a.end <= b.start for a, b in pairwise(srt_words))
    assert [round(c.start.total_seconds(), 3) for c in srt_words] == [seconds(c.start_time) for c in vtt_words]
    assert len(list(srt.parse(docs.phrases_srt))) == len(result["cues"]) >= 3

    # Each word cue's middle lies within 150 ms of the span whisper gives that word.
    cue_words = [normalised_text(w.text) for w in result["words"]]
    asr_words = [normalised_text(w.text) for w in heard.words]
    matcher = difflib.SequenceMatcher(a=cue_words, b=asr_words, autojunk=False)
    pairs = [(result["words"][i + k], heard.words[j + k])
             for i, j, n in matcher.get_matching_blocks() for k in range(n)]
    assert len(pairs) >= 0.9 * len(cue_words)
    offsets = [max(asr.start_s - (cue.start_s + cue.end_s) / 2, (cue.start_s + cue.end_s) / 2 - asr.end_s, 0.0)
               for cue, asr in pairs]
    assert max(offsets) <= WORD_TOLERANCE_S, [(c.text, c.start_s, c.end_s, a.start_s, a.end_s) for c, a in pairs]
    start_errors = [abs(cue.start_s - asr.start_s) for cue, asr in pairs]
    assert float(np.median(start_errors)) <= 0.1


async def test_numbers_are_spoken_in_words_and_captioned_as_written(service, transcriber):
    stub, _ = service
    text = "It costs $1,200 and takes 15 minutes."
    result = await collect(stub.Synthesize(tts.SynthesizeRequest(text=text, sample_rate_hz=RATE)))
    audio_s = check_timeline(result)
    assert [w.text for w in result["words"]] == text.split()
    heard = normalised_text(transcriber.transcribe(Utterance(0, 0.0, audio_s, samples(result))).text)
    assert ("1200" in heard or "thousand two hundred" in heard) and ("15" in heard or "fifteen" in heard), heard
    amount = next(w for w in result["words"] if w.text == "$1,200")
    assert amount.end_s - amount.start_s > 1.0  # "one thousand two hundred dollars"


async def test_bad_input_gets_a_clear_status_and_punctuation_only_says_nothing(service):
    stub, _ = service
    for request, code, words in [
        (tts.SynthesizeRequest(text="  "), grpc.StatusCode.INVALID_ARGUMENT, "text is empty"),
        (tts.SynthesizeRequest(text="Hi.", sample_rate_hz=96_000), grpc.StatusCode.INVALID_ARGUMENT, "sample_rate_hz"),
        (tts.SynthesizeRequest(text="x" * 100_001), grpc.StatusCode.INVALID_ARGUMENT, "exceeds"),
    ]:
        await expect_status(code, words, collect(stub.Synthesize(request)))
    await expect_status(grpc.StatusCode.INVALID_ARGUMENT, "",
                        collect(stub.SynthesizeStream(aiter_of([tts.TextPiece(text=""), tts.TextPiece(text=" ")]))))

    for call in (stub.Synthesize(tts.SynthesizeRequest(text="... !!! — ?")),
                 stub.SynthesizeStream(aiter_of([tts.TextPiece(text="..."), tts.TextPiece(text=" !")]))):
        result = await collect(call)
        assert not result["audio"] and not result["cues"] and not result["words"]
        assert result["captions"].words_webvtt.startswith("WEBVTT") and result["captions"].phrases_srt == ""
        assert result["times"].stage == "tts"


async def aiter_of(items):
    for item in items:
        yield item


async def test_text_streamed_in_pieces_is_spoken_phrase_by_phrase_as_it_arrives(service):
    stub, _ = service
    arrived: dict[str, float] = {}

    async def pieces():
        yield tts.TextPiece(text="Hello there, my", sample_rate_hz=RATE)
        yield tts.TextPiece(text=" friend. How are")
        await asyncio.sleep(3.0)  # the first phrase must be heard before the rest is written
        arrived["rest"] = time.monotonic()
        yield tts.TextPiece(text=" you today?")

    first_audio = 0.0
    result: dict = {"audio": [], "cues": [], "words": []}
    async for event in stub.SynthesizeStream(pieces()):
        kind = event.WhichOneof("event")
        if kind == "audio":
            first_audio = first_audio or time.monotonic()
        if kind in ("audio", "cue", "word"):
            result[{"audio": "audio", "cue": "cues", "word": "words"}[kind]].append(getattr(event, kind))
    assert first_audio < arrived["rest"]
    assert [c.text for c in result["cues"]] == ["Hello there,", "my friend.", "How are you today?"]
    check_timeline(result)


async def new_turn(redis) -> tuple[str, str]:
    session_id = await redis.sessions.create("")
    return session_id, await redis.turns.create(session_id)


async def write_tokens(redis, turn_id: str, deltas: list[str | None], gap_s: float, end: bool = True) -> None:
    """One stream entry per delta; None: a pause of `gap_s`."""
    writer = TokenStreamWriter(redis.client, turn_id)
    seq = 0
    for delta in deltas:
        if delta is None:
            await asyncio.sleep(gap_s)
            continue
        await writer.append(TokenEntry(seq, (seq,), delta, 1, now_ms()))
        seq += 1
    if end:
        await writer.append(TokenEntry(seq, (), "", 0, now_ms(), end=True, finish_reason="eos"))


@pytest.mark.parametrize("arrival", ["slowly", "in bursts", "with empty deltas"])
async def test_a_turn_is_spoken_from_its_token_stream_however_it_arrives(service, arrival):
    stub, redis = service
    words = [w + " " for w in "Sure, I can help. It takes about 5 minutes, more or less.".split()]
    deltas: list[str | None] = {
        "slowly": [d for w in words for d in (w, None)],
        "in bursts": ["".join(words[:4]), None, "".join(words[4:9]), None, None, "".join(words[9:])],
        "with empty deltas": [d for w in words for d in ("", w, "")],
    }[arrival]
    session_id, turn_id = await new_turn(redis)
    writer = asyncio.create_task(write_tokens(redis, turn_id, deltas, gap_s=0.15))
    result = await collect(stub.SpeakTurn(tts.SpeakTurnRequest(session_id=session_id, turn_id=turn_id,
                                                               sample_rate_hz=RATE)))
    await writer
    check_timeline(result)
    assert [c.text for c in result["cues"]] == ["Sure, I can help.",
                                                "It takes about 5 minutes, more or less."]
    assert [w.text for w in result["words"]] == "".join(words).split()
    assert result["times"].first_in_unix_ms <= result["times"].first_out_unix_ms


async def test_a_token_stream_without_its_end_marker_times_out_after_speaking_what_came(service):
    stub, redis = service
    session_id, turn_id = await new_turn(redis)
    await write_tokens(redis, turn_id, ["Well, I think ", "so, and this ", "reply never ends"], gap_s=0, end=False)
    audio = []

    async def speak() -> None:
        async for event in stub.SpeakTurn(tts.SpeakTurnRequest(session_id=session_id, turn_id=turn_id,
                                                               token_timeout_s=0.5)):
            audio.extend([event.audio] if event.WhichOneof("event") == "audio" else [])

    await expect_status(grpc.StatusCode.DEADLINE_EXCEEDED, "no token entry", speak())
    assert audio, "the complete first phrase was spoken before the stream stalled"


async def test_ten_thousand_characters_stream_out_in_chunks_with_bounded_memory(service):
    """The reply is about 12 minutes of speech (~23 MB at 16 kHz); the service holds a phrase at a time."""
    stub, _ = service
    sentence = "The quick brown fox jumps over the lazy dog, and then it runs far away. "
    text = (sentence * (10_000 // len(sentence) + 1))[:10_000]
    tracemalloc.start(16)
    try:
        received_s, chunks, first_audio_s, started = 0.0, 0, 0.0, time.monotonic()
        held: dict[int, int] = {}  # seconds of audio received → bytes that specvox's code still holds
        call = stub.Synthesize(tts.SynthesizeRequest(text=text, sample_rate_hz=RATE))
        async for event in call:
            if event.WhichOneof("event") == "audio":
                first_audio_s = first_audio_s or time.monotonic() - started
                chunks += 1
                received_s += len(event.audio.pcm_s16le) / 2 / RATE
                for mark in HELD_MARKS_S:
                    if received_s > mark and mark not in held:
                        held[mark] = held_by_specvox(tracemalloc.take_snapshot())
                if received_s > 100:  # enough to show the pattern; the rest would only take time
                    call.cancel()
                    break
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert received_s > 100 and chunks >= 100 / AUDIO_CHUNK_S, (received_s, chunks)
    assert first_audio_s < 0.1 * received_s, first_audio_s  # out as made, not after the whole text
    # What is held at any moment is the phrase in hand (about 4 s of audio, about 1 MB in all its
    # forms, or almost nothing between phrases) and the reply's cues (a few kB a phrase). Had the
    # audio been kept, 100 s of it would hold 3.2 MB as 16 kHz PCM and 8.8 MB as float samples.
    assert len(held) == len(HELD_MARKS_S) and max(held.values()) < 2 * 1024 * 1024, held
    # gRPC's own buffers (flow-control window) included, far below the whole reply's audio
    assert peak_bytes < 16 * 1024 * 1024, peak_bytes


HELD_MARKS_S = range(20, 101, 10)  # when the test weighs what specvox holds, in seconds of audio out


def held_by_specvox(snapshot: tracemalloc.Snapshot) -> int:
    """Bytes still allocated by pipeline/ or the tts service (not by gRPC's send buffers)."""
    mine = snapshot.filter_traces([tracemalloc.Filter(True, "*/pipeline/*", all_frames=True),
                                   tracemalloc.Filter(True, "*/services/stages/tts.py", all_frames=True)])
    return sum(stat.size for stat in mine.statistics("filename"))


async def test_a_cancelled_turn_stops_within_a_phrase_and_the_service_goes_on(service, synthesizer, monkeypatch):
    stub, redis = service
    phrase_s = synthesizer_time_s(synthesizer, "This is a rather long reply that goes on.")
    started: list[float] = []  # when each phrase's synthesis began (the real voice still speaks it)
    stream = synthesizer.stream
    monkeypatch.setattr(synthesizer, "stream", lambda *a, **kw: (started.append(time.monotonic()), stream(*a, **kw))[1])
    session_id, turn_id = await new_turn(redis)
    long_reply = "This is a rather long reply that goes on. " * 40
    await write_tokens(redis, turn_id, [w + " " for w in long_reply.split()], gap_s=0)
    call = stub.SpeakTurn(tts.SpeakTurnRequest(session_id=session_id, turn_id=turn_id))
    async for event in call:
        if event.WhichOneof("event") == "audio":
            break
    call.cancel()  # barge-in
    cancelled = time.monotonic()
    await asyncio.sleep(3 * phrase_s + 0.5)
    after_cancel = [t for t in started if t > cancelled]
    assert len(after_cancel) <= 1, (len(after_cancel), len(started))  # at most one began as the cancel flew
    assert len(started) < 5  # of 40
    result = await collect(stub.Synthesize(tts.SynthesizeRequest(text="Yes?")))
    assert result["audio"]


def synthesizer_time_s(synthesizer, text: str) -> float:
    began = time.monotonic()
    synthesizer.synthesize(text)
    return time.monotonic() - began


def test_caption_documents_round_trip_through_parsers():
    from pipeline.captions import CaptionTrack, Cue

    track = CaptionTrack([Cue(0.0, 1.5, "Hello there,"), Cue(1.5, 3.25, "how are you?")],
                         [Cue(0.1, 0.5, "Hello"), Cue(0.6, 1.2, "there,")])
    docs = track.documents()
    assert [(seconds(c.start_time), seconds(c.end_time), c.text) for c in webvtt.from_buffer(
        io.StringIO(docs["phrases_webvtt"]))] == [(0.0, 1.5, "Hello there,"), (1.5, 3.25, "how are you?")]
    parsed = list(srt.parse(docs["words_srt"]))
    assert [(c.start.total_seconds(), c.end.total_seconds(), c.content) for c in parsed] == [
        (0.1, 0.5, "Hello"), (0.6, 1.2, "there,")]


def test_words_espeak_splits_are_counted_once_each(synthesizer):
    """A phrase whose words espeak counts differently ("COVID-19") is timed word by word; each
    word's count is phonemized once and remembered (each phonemization takes time)."""
    synthesizer._espeak_words_in.cache_clear()
    for _ in range(3):
        list(synthesizer.stream("COVID-19 cases fell, and COVID-19 tests rose."))
    info = synthesizer._espeak_words_in.cache_info()
    assert info.misses == 6 and info.hits == 2 * 7 + 1, info  # 6 distinct words of 7; the repeat hits


PHONEMIZED = ["Hello there, how can I help you today?", "", "   ", "...", "Wait! Really?! Yes: no; maybe.",
              "COVID-19 hit in 2020; 3.5% of $1,000,000 is $35,000.", "Café naïve résumé, “quoted” ‘single’ …",
              "Dr. Smith lives on St. James St. at 10 a.m.", "Line one\nLine two\n\nLine three", "日本語のテキスト",
              "Emoji 😀 and symbols © ® ™ → ∞", "(parenthesised) [bracketed] {braced}", "1st 2nd 3rd", "Hmm",
              "What? No. Never! Okay, fine: go; now.", "The quick brown fox jumps over the lazy dog. " * 40]


@pytest.mark.parametrize("voice", ["en-us", "fr", "de"])
def test_clause_phonemes_are_the_bridge_s_own_without_its_leak(synthesizer, voice):
    """pipeline/tts/espeak_clauses.py stands in for piper's espeakbridge.get_phonemes: the same
    clauses, terminators and sentence ends on any text, and none of the bridge's ~0.7 KB a call kept
    (measured on the bridge too, so the check is seen to catch a leak)."""
    from piper import espeakbridge

    from pipeline.tts import espeak_clauses

    bridge = espeak_clauses.bridge_get_phonemes
    assert bridge is not None and espeakbridge.get_phonemes is espeak_clauses.clause_phonemes  # the voice installed it
    espeakbridge.set_voice(voice)
    try:
        for text in PHONEMIZED:
            assert espeak_clauses.clause_phonemes(text) == [tuple(c) for c in bridge(text)], text
        kept = {}
        for name, phonemize in (("ours", espeak_clauses.clause_phonemes), ("bridge", bridge)):
            phonemize(PHONEMIZED[0])
            tracemalloc.start()
            for _ in range(1000):
                phonemize(PHONEMIZED[4])
            kept[name] = tracemalloc.get_traced_memory()[0]
            tracemalloc.stop()
        assert kept["ours"] < 10_000 and kept["bridge"] > 200_000, kept
    finally:
        espeakbridge.set_voice("en-us")


def _malloc_in_use() -> int:
    """Bytes glibc's malloc has handed out and not had back (native memory tracemalloc cannot see)."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    mallinfo2.restype = MallInfo2
    return int(mallinfo2().uordblks)


def test_piper_sets_espeak_s_voice_once_with_the_same_phonemes(synthesizer):
    """Piper's phonemizer sets espeak-ng's voice before every text, and the bridge's set_voice
    leaks a copy of the voice each time (pipeline/tts/espeak_clauses.py): the voice is now set only
    where it changes. The phonemes are those of a voice set before every text, in any order of
    voices, and a thousand texts in one voice keep no native memory where the bridge's call, the
    control, keeps over a kilobyte each."""
    import os

    from piper import espeakbridge
    from piper import voice as piper_voice

    from pipeline.tts import espeak_clauses

    if "jemalloc" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("glibc's malloc counts the native memory here")
    assert espeakbridge.set_voice is espeak_clauses.set_voice_once  # the voice installed it
    synthesizer.phonemizer.phonemize("Warm up.")
    phonemizer = piper_voice._ESPEAK_PHONEMIZER
    voices = ["en-us", "en-us", "fr", "fr", "de", "en-us", "de", "de", "en-us"]
    texts = [PHONEMIZED[(i * 5) % len(PHONEMIZED)] for i in range(len(voices))]
    try:
        with_each_set = []
        for voice, text in zip(voices, texts, strict=True):
            espeak_clauses.bridge_set_voice(voice)
            with_each_set.append(phonemizer.phonemize(voice, text))
        espeak_clauses.set_voice_once("en-us")
        assert [phonemizer.phonemize(voice, text) for voice, text in zip(voices, texts, strict=True)] == with_each_set

        kept = {}
        for name, set_voice in (("once", espeak_clauses.set_voice_once), ("bridge", espeak_clauses.bridge_set_voice)):
            set_voice("en-us")
            before = _malloc_in_use()
            for _ in range(1000):
                set_voice("en-us")
                espeak_clauses.clause_phonemes(PHONEMIZED[4])
            kept[name] = _malloc_in_use() - before
        assert kept["once"] < 20_000 and kept["bridge"] > 1_000_000, kept
    finally:
        espeak_clauses.set_voice_once("en-us")
