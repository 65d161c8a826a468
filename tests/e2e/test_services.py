"""The four services for real: `specvox up` on loopback, real models, real Valkey.

One spoken turn end to end, health and reflection on each server, and bad input to
each server answered with a clear status, after which it serves the next request.
"""

from __future__ import annotations

import wave
from itertools import pairwise
from pathlib import Path

import grpc
import jiwer
import numpy as np
import psutil
import pytest
import webvtt
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pipeline.asr_stream import normalised_text
from pipeline.audio import float_to_pcm16
from pipeline.llm.options import LlmOptions
from pipeline.turn_taking import DEFAULT_BACKCHANNELS, TurnTaking
from services.cli.serve import kernel_threads_beside_other_stages
from services.client import ClientOptions, converse, write_outputs
from services.protos import load, load_common
from services.settings import Settings
from services.store.client import connect
from services.store.sessions import SessionStore
from services.store.turn_log import TurnStore
from tests.conftest import write_wav
from tests.grpc_status import expect_status, expect_stream_status

gw, gw_grpc = load("gateway")
asr, asr_grpc = load("asr")
llm, llm_grpc = load("llm")
tts, tts_grpc = load("tts")
common = load_common()
FIFTY_MB = b"\x00" * (50 * 1024 * 1024)
QUESTION = "What is the capital of France?"
SERVICE_NAMES = {
    "gateway": "specvox.gateway.v1.Gateway",
    "asr": "specvox.asr.v1.Asr",
    "llm": "specvox.llm.v1.Llm",
    "tts": "specvox.tts.v1.Tts",
}

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
async def channels(stack):
    opened = {name: grpc.aio.insecure_channel(address) for name, address in stack.items()
              if name not in ("redis", "http")}
    yield opened
    for channel in opened.values():
        await channel.close()


@pytest.fixture(scope="module")
async def session_id(channels):
    return (await gw_grpc.GatewayStub(channels["gateway"]).CreateSession(gw.CreateSessionRequest())).session_id


async def test_a_spoken_turn_round_trips(stack, speech, tmp_path):
    rate = 22_050  # the client's audio is stereo at the voice's rate: the gateway path resamples it
    wav = write_wav(tmp_path / "question.wav", speech(QUESTION, rate), rate, channels=2)
    turns = await converse(stack["gateway"], str(wav), ClientOptions(chunk_ms=100, realtime=True))
    report = write_outputs(turns, str(tmp_path / "out"))

    assert jiwer.wer(normalised_text(QUESTION), normalised_text(report["transcript"])) < 0.10, report["transcript"]
    assert report["reply_text"].strip(), "the avatar said nothing"
    assert report["finish_reason"] in ("eos", "length")

    with wave.open(str(tmp_path / "out" / "reply.wav")) as w:
        assert (w.getsampwidth(), w.getnchannels()) == (2, 1)
        audio_s = w.getnframes() / w.getframerate()
    words = len(report["reply_text"].split())
    assert 0.15 * words <= audio_s <= 1.5 * words + 1.0, (audio_s, report["reply_text"])

    cues = list(webvtt.read(str(tmp_path / "out" / "captions.vtt")))
    assert cues, "no caption cues"
    starts = [c.start_in_seconds for c in cues]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)
    assert all(c.start_in_seconds < c.end_in_seconds <= audio_s + 0.01 for c in cues)
    assert normalised_text(" ".join(c.text for c in cues)) == normalised_text(report["reply_text"])

    # The user's words: partials while speaking, committed words never taken back, then the final.
    turn = next(t for t in turns if t.report is report)
    assert turn.partials, "no partial transcripts"
    committed = [normalised_text(t).split() for t in [*(p.committed_text for p in turn.partials), turn.transcript]]
    assert all(later[: len(earlier)] == earlier for earlier, later in pairwise(committed)), committed
    assert all(0.0 <= p.stability <= 1.0 for p in turn.partials)
    assert report["preemption"] in ("", "kept")
    user_cues = list(webvtt.read(str(tmp_path / "out" / "user_captions.vtt")))
    assert normalised_text(" ".join(c.text for c in user_cues)) == normalised_text(report["transcript"])
    spans = [(c.start_time.in_milliseconds() / 1000, c.end_time.in_milliseconds() / 1000) for c in user_cues]
    assert all(0.0 < start < end <= report["speech_end_s"] + 0.5 for start, end in spans), (spans, report)

    assert report["voice_to_voice_ms"] > 0
    assert set(report["stages"]) == {"asr", "llm", "tts", "gateway"}
    llm_times, tts_times = report["stages"]["llm"], report["stages"]["tts"]
    assert llm_times["first_in_unix_ms"] <= llm_times["first_out_unix_ms"] <= llm_times["last_out_unix_ms"]
    assert tts_times["first_in_unix_ms"] >= llm_times["first_out_unix_ms"]  # tts reads what llm wrote


def listening_process(address: str):
    port = int(address.rsplit(":", 1)[1])
    pid = next(c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port)
    return psutil.Process(pid)


def test_the_gateway_runs_without_torch(stack):
    """It runs no model, so it must not map torch (~125 MB and ~1 s of start-up) through the llm's
    option types, as it did while they lived beside the model code."""
    gateway = listening_process(stack["gateway"])
    mapped = {Path(m.path).name for m in gateway.memory_maps()}
    assert "libtorch_cpu.so" not in mapped and "libtorch_python.so" not in mapped, sorted(mapped)
    llm = {Path(m.path).name for m in listening_process(stack["llm"]).memory_maps()}
    assert "libtorch_cpu.so" in llm  # the check sees torch where it is


def test_under_specvox_up_the_llms_kernels_run_on_one_thread(stack):
    """asr and tts share the cores there; a second kernel thread lost at 4 sessions (docs/benchmarks/history.md)."""
    assert listening_process(stack["llm"]).environ().get("SPECVOX_LLM__KERNEL_THREADS") == "1"
    env = {"SPECVOX_LLM__KERNEL_THREADS": "3"}
    kernel_threads_beside_other_stages(Settings(), env)  # the user's own setting wins
    assert env == {"SPECVOX_LLM__KERNEL_THREADS": "3"}
    env = {}
    kernel_threads_beside_other_stages(Settings(llm=LlmOptions(kernel_threads=2)), env)
    assert env == {}


@pytest.mark.parametrize("service", SERVICE_NAMES)
async def test_each_service_is_healthy_and_reflects_its_api(channels, service):
    health = health_pb2_grpc.HealthStub(channels[service])
    for name in ("", SERVICE_NAMES[service]):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channels[service])
    call = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    listed = [s.name async for reply in call for s in reply.list_services_response.service]
    assert SERVICE_NAMES[service] in listed and "grpc.health.v1.Health" in listed


def pcm_config(session: str, width: int = 2, encoding=common.AudioFormat.PCM_S16LE, rate: int = 16_000,
               language: str = "", **asked):
    """The config of a stream of 16-bit PCM; `asked`: StreamConfig's max_utterance_s, context_pause_ms,
    vad_threshold, vad_gain_db, prompt."""
    fmt = common.AudioFormat(encoding=encoding, sample_rate_hz=rate, channels=1, sample_width_bytes=width)
    return asr.TranscribeRequest(config=asr.StreamConfig(session_id=session, language=language, format=fmt,
                                                         **asked))


async def test_asr_rejects_bad_input_then_transcribes(channels, session_id, speech):
    stub = asr_grpc.AsrStub(channels["asr"])
    audio = asr.TranscribeRequest(audio=float_to_pcm16(speech("Good morning to you.")))
    bad = [
        (grpc.StatusCode.INVALID_ARGUMENT, "no audio", [pcm_config(session_id)]),
        (grpc.StatusCode.INVALID_ARGUMENT, "sample width 3", [pcm_config(session_id, width=3), audio]),
        (grpc.StatusCode.INVALID_ARGUMENT, "not a WAV", [pcm_config(session_id, encoding=common.AudioFormat.WAV),
                                                        asr.TranscribeRequest(audio=b"%PDF-1.7 not audio")]),
        (grpc.StatusCode.INVALID_ARGUMENT, "stray byte", [pcm_config(session_id),
                                                         asr.TranscribeRequest(audio=b"\x01\x02\x03")]),
        (grpc.StatusCode.INVALID_ARGUMENT, "sample rate 7 Hz", [pcm_config(session_id, rate=7), audio]),
        (grpc.StatusCode.INVALID_ARGUMENT, "English-only", [pcm_config(session_id, language="de"), audio]),
        (grpc.StatusCode.INVALID_ARGUMENT, "max_utterance_s must be 0", [pcm_config(session_id, max_utterance_s=-1),
                                                                        audio]),
        (grpc.StatusCode.INVALID_ARGUMENT, "at least 2 s", [pcm_config(session_id, max_utterance_s=0.5), audio]),
        (grpc.StatusCode.INVALID_ARGUMENT, "vad_threshold must be", [pcm_config(session_id, vad_threshold=1.5), audio]),
        (grpc.StatusCode.INVALID_ARGUMENT, "not nan", [pcm_config(session_id, vad_threshold=float("nan")), audio]),
        (grpc.StatusCode.INVALID_ARGUMENT, "vad_gain_db must be", [pcm_config(session_id, vad_gain_db=-3), audio]),
        (grpc.StatusCode.INVALID_ARGUMENT, "to 20 dB, not 40", [pcm_config(session_id, vad_gain_db=40), audio]),
        (grpc.StatusCode.NOT_FOUND, "unknown session", [pcm_config("no-such-session"), audio]),
        (grpc.StatusCode.INVALID_ARGUMENT, "first message", [audio]),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max",
         [pcm_config(session_id), asr.TranscribeRequest(audio=FIFTY_MB)]),
        (grpc.StatusCode.INVALID_ARGUMENT, "context.expected_phrases",
         [pcm_config(session_id), asr.TranscribeRequest(context=asr.Context(expected_phrases=["okay"] * 200))]),
        (grpc.StatusCode.INVALID_ARGUMENT, "StreamConfig.prompt",
         [pcm_config(session_id, prompt="word " * 100), audio]),
    ]
    for code, fragment, requests in bad:
        await expect_stream_status(code, fragment, stub.Transcribe(), requests)
    events = [e async for e in stub.Transcribe(iter([pcm_config(session_id, language="en"), audio]))]
    assert events[0].kind == asr.TranscriptEvent.READY
    finals = [e for e in events if e.kind == asr.TranscriptEvent.FINAL]
    assert len(finals) == 1 and normalised_text(finals[0].text) == "good morning to you"


async def test_asr_context_prompts_whisper_with_the_expected_phrases(channels, session_id, speech):
    """A murmured "Mm-hmm." (the Piper voice), which whisper tiny writes as words ("In a moment.")
    unprompted, comes out as a backchannel once the gateway's context names the backchannels, or as no
    words at all (a hum's spelling: pipeline/asr_words.py); either way it takes no turn."""
    stub = asr_grpc.AsrStub(channels["asr"])
    murmur = asr.TranscribeRequest(audio=float_to_pcm16(speech("Mm-hmm.")))
    context = asr.TranscribeRequest(context=asr.Context(expected_phrases=list(DEFAULT_BACKCHANNELS)))
    finals = [e.text async for e in stub.Transcribe(iter([pcm_config(session_id), context, murmur]))
              if e.kind == asr.TranscriptEvent.FINAL]
    assert finals and all(not f.strip() or TurnTaking()._backchannel(f) for f in finals), finals
    # A context ahead of speech that is no backchannel leaves its words alone.
    question = asr.TranscribeRequest(audio=float_to_pcm16(speech("Stop, how many legs does a spider have?")))
    finals = [e.text async for e in stub.Transcribe(iter([pcm_config(session_id), context, question]))
              if e.kind == asr.TranscriptEvent.FINAL]
    assert "spider" in normalised_text(" ".join(finals)), finals


async def test_a_stream_may_ask_to_go_on_from_the_speech_before_a_pause(channels, session_id, speech, transcriber):
    """`StreamConfig.context_pause_ms`, which the gateway asks for in caption mode: the asr's finals are then
    the recognizer's going on from the speech before a pause, word for word; 0 (the service's, off) hears each
    utterance alone, where whisper tiny wrote "how do volcanoes form?" after "I have a question," as
    "Happy volcano's form."."""
    from pipeline.asr import AsrOptions
    from pipeline.asr_stream import StreamingRecognizer
    from pipeline.audio import PcmFormat, pcm_to_mono_float
    from tests.e2e.test_asr_stream import finals, stream

    stub = asr_grpc.AsrStub(channels["asr"])
    pcm = float_to_pcm16(np.concatenate([speech("I have a question,"), np.zeros(8000, np.float32),
                                         speech("how do volcanoes form?")]))
    audio = pcm_to_mono_float(pcm, PcmFormat(16_000, 1, 2))  # what the asr hears of it
    heard = {}
    for pause_ms in (0, 2000):
        config = pcm_config(session_id)
        config.config.context_pause_ms = pause_ms
        heard[pause_ms] = [e.text async for e in stub.Transcribe(iter([config, asr.TranscribeRequest(audio=pcm)]))
                           if e.kind == asr.TranscriptEvent.FINAL]
        in_process = [f.text for f in finals(stream(StreamingRecognizer(AsrOptions(context_pause_ms=pause_ms),
                                                                        transcriber), audio))]
        assert heard[pause_ms] == in_process, pause_ms
    assert len(heard[0]) == 2 and heard[0] != heard[2000], heard


async def test_a_stream_may_ask_for_its_own_vad_threshold(channels, session_id, speech, transcriber):
    """`StreamConfig.vad_threshold`, which the gateway asks for in caption mode (0.3, so that quiet speech is
    not missed): the asr's finals are then the recognizer's with speech beginning at that threshold and its
    silence under it too where that is lower than the service's (0.35), word for word and to the millisecond
    of their speech's end, which at 0.2 comes later than at the service's 0.5."""
    from pipeline.asr import AsrOptions
    from pipeline.asr_stream import StreamingRecognizer
    from pipeline.audio import PcmFormat, pcm_to_mono_float
    from tests.e2e.test_asr_stream import finals, stream

    stub = asr_grpc.AsrStub(channels["asr"])
    pcm = float_to_pcm16(np.concatenate([speech("Could you read the next line more slowly?"),
                                         np.zeros(8000, np.float32)]))
    audio = pcm_to_mono_float(pcm, PcmFormat(16_000, 1, 2))
    ends = {}
    for threshold in (0.0, 0.2):
        heard = [(e.text, round(e.speech_end_s, 3)) async for e in stub.Transcribe(iter([
            pcm_config(session_id, vad_threshold=threshold), asr.TranscribeRequest(audio=pcm)]))
            if e.kind == asr.TranscriptEvent.FINAL]
        options = AsrOptions(vad_threshold=threshold, vad_silence_threshold=threshold) if threshold else AsrOptions()
        in_process = [(f.text, round(f.utterance.speech_end_s, 3))
                      for f in finals(stream(StreamingRecognizer(options, transcriber), audio))]
        assert heard == in_process, threshold
        ends[threshold] = [end for _, end in heard]
    assert len(ends[0.0]) == len(ends[0.2]) == 1 and ends[0.2][0] > ends[0.0][0], ends


async def test_llm_rejects_bad_input_then_replies(channels, stack, session_id):
    stub = llm_grpc.LlmStub(channels["llm"])
    redis = connect(stack["redis"])
    try:
        turn = await TurnStore(redis).create(session_id)
        other_turn = await TurnStore(redis).create(session_id)
    finally:
        await redis.aclose()

    def ask(**fields):
        return stub.Reply(llm.ReplyRequest(**({"session_id": session_id, "turn_id": turn,
                                               "user_text": "Hi!", "max_new_tokens": 4} | fields)))

    await expect_status(grpc.StatusCode.NOT_FOUND, "unknown session", ask(session_id="nope"))
    await expect_status(grpc.StatusCode.NOT_FOUND, "unknown turn", ask(turn_id="nope"))
    await expect_status(grpc.StatusCode.INVALID_ARGUMENT, "user_text is empty", ask(user_text="  "))
    await expect_status(grpc.StatusCode.INVALID_ARGUMENT, "unknown drafter", ask(drafter="telepathy"))
    await expect_status(grpc.StatusCode.INVALID_ARGUMENT, "tokens", ask(user_text="word " * 9000))
    await expect_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max",
                        ask(user_text=FIFTY_MB.decode()))
    steps = [s async for s in ask(turn_id=other_turn)]
    assert steps[-1].end and steps[-1].finish_reason in ("eos", "length")
    assert 1 <= sum(s.accepted for s in steps) <= 4
    # A dialogue reply joins the session's history, unless the caller records it (the gateway does,
    # once the turn is confirmed).
    redis = connect(stack["redis"])
    try:
        sessions, turns = SessionStore(redis), TurnStore(redis)
        before = await sessions.history(session_id)
        assert before and before[-1].user == "Hi!"
        [s async for s in ask(turn_id=await turns.create(session_id), defer_history=True)]
        assert await sessions.history(session_id) == before
    finally:
        await redis.aclose()


async def test_tts_rejects_bad_input_then_speaks(channels, session_id):
    stub = tts_grpc.TtsStub(channels["tts"])
    await expect_status(grpc.StatusCode.INVALID_ARGUMENT, "text is empty", stub.Synthesize(tts.SynthesizeRequest()))
    await expect_status(grpc.StatusCode.INVALID_ARGUMENT, "sample_rate_hz",
                        stub.Synthesize(tts.SynthesizeRequest(text="Hi.", sample_rate_hz=7)))
    await expect_status(grpc.StatusCode.NOT_FOUND, "unknown session",
                        stub.SpeakTurn(tts.SpeakTurnRequest(session_id="nope", turn_id="t")))
    await expect_status(grpc.StatusCode.NOT_FOUND, "unknown turn",
                        stub.SpeakTurn(tts.SpeakTurnRequest(session_id=session_id, turn_id="nope")))
    await expect_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max",
                        stub.Synthesize(tts.SynthesizeRequest(text=FIFTY_MB.decode())))
    events = [e async for e in stub.Synthesize(tts.SynthesizeRequest(text="Hello there. Nice to meet you.",
                                                                     sample_rate_hz=16_000))]
    audio = [e.audio for e in events if e.WhichOneof("event") == "audio"]
    cues = [e.cue for e in events if e.WhichOneof("event") == "cue"]
    assert [c.text for c in cues] == ["Hello there.", "Nice to meet you."]
    samples = np.frombuffer(b"".join(a.pcm_s16le for a in audio), "<i2")
    assert all(a.sample_rate_hz == 16_000 for a in audio) and 0.8 < samples.size / 16_000 < 5
    assert cues[-1].end_s == pytest.approx(samples.size / 16_000, abs=0.01)


async def test_gateway_rejects_bad_input_then_serves(channels, session_id):
    stub = gw_grpc.GatewayStub(channels["gateway"])

    def start(session: str = session_id, width: int = 2, encoding=common.AudioFormat.PCM_S16LE):
        return gw.ClientMessage(start=gw.StreamStart(session_id=session, format=common.AudioFormat(
            encoding=encoding, sample_rate_hz=16_000, channels=1, sample_width_bytes=width)))

    silence = gw.ClientMessage(audio=b"\x00" * 3200)
    bad = [
        (grpc.StatusCode.NOT_FOUND, "unknown session", [start("nope"), silence]),
        (grpc.StatusCode.INVALID_ARGUMENT, "sample width", [start(width=1), silence]),
        (grpc.StatusCode.INVALID_ARGUMENT, "no audio", [start()]),
        (grpc.StatusCode.INVALID_ARGUMENT, "not a WAV",
         [start(encoding=common.AudioFormat.WAV), gw.ClientMessage(audio=b"GIF89a not audio")]),
        (grpc.StatusCode.INVALID_ARGUMENT, "first message", [silence]),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max", [start(), gw.ClientMessage(audio=FIFTY_MB)]),
    ]
    for code, fragment, messages in bad:
        await expect_stream_status(code, fragment, stub.Converse(), messages)
    await expect_status(grpc.StatusCode.INVALID_ARGUMENT, "system_prompt",
                        stub.CreateSession(gw.CreateSessionRequest(system_prompt="x" * 9000)))
    # Silence is valid audio with nothing to answer: the stream ends cleanly with no turn.
    events = [e async for e in stub.Converse(iter([start(), silence, silence]))]
    assert [e.WhichOneof("event") for e in events] == ["ready"]
    assert (await stub.CreateSession(gw.CreateSessionRequest())).session_id
