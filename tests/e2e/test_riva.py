"""NVIDIA Riva's protocols on the real asr and tts services (their own `build`, interceptors, health and
reflection; tests/inprocess.py), reached by NVIDIA's own client, `nvidia-riva-client` from PyPI.

The client is blocking: each call runs in a thread, while the services serve in the test's loop.
Recognition is checked on the bundled voice's speech (what was said is known), synthesis by hearing
its audio back through Riva's own Recognize and by its word times, every refusal by its status and by
the next call still being served, and each Riva method is fuzzed with bench/fuzz.py's cases. Pipecat's
NvidiaSTTService and NvidiaTTSService run in their own environment (.venv-clients, `make clients`).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import jiwer
import numpy as np
import pytest
import riva.client
from grpc_health.v1 import health_pb2, health_pb2_grpc
from riva.client.proto import riva_asr_pb2 as rasr
from riva.client.proto import riva_tts_pb2 as rtts

from bench import fuzz
from pipeline import g711
from pipeline.asr_stream import normalised_text
from pipeline.audio import float_to_pcm16, resample, wav_bytes
from pipeline.tts.backend import TtsOptions
from services.settings import Settings
from services.stack import free_port
from services.stages.tts import voice_name
from tests.inprocess import serve_one

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]

QUESTION = "What is the capital of France?"
REPLY = "The capital of France is Paris. It is known for the Eiffel Tower."
WER_BOUND = 0.2  # whisper tiny.en hearing the bundled voice
CHUNK_FRAMES = 1600  # 100 ms at 16 kHz, as Riva's examples stream a file


@pytest.fixture(scope="module")
async def services(redis_url) -> Any:
    """The asr and tts services on free ports: {"asr": address, "tts": address, "voice": the voice's name}.
    The voice without noise: the same text is the same audio on every call."""
    settings = Settings(redis_url=redis_url, asr_port=free_port(), tts_port=free_port(),
                        tts=TtsOptions(noise_scale=0.0, noise_w_scale=0.0))
    async with serve_one(settings, "asr") as asr, serve_one(settings, "tts") as tts:
        yield {"asr": asr, "tts": tts, "voice": voice_name(settings)}


def in_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any):
    """The blocking Riva client, off the loop the services run in."""
    return asyncio.to_thread(fn, *args, **kwargs)


def asr_client(services) -> riva.client.ASRService:
    return riva.client.ASRService(riva.client.Auth(uri=services["asr"]))


def tts_client(services, **auth: Any) -> riva.client.SpeechSynthesisService:
    return riva.client.SpeechSynthesisService(riva.client.Auth(uri=services["tts"], **auth))


def wer(reference: str, hypothesis: str) -> float:
    return jiwer.wer(normalised_text(reference), normalised_text(hypothesis) or "<nothing>")


def write_wav(path: Path, samples: np.ndarray, rate_hz: int) -> Path:
    path.write_bytes(wav_bytes(float_to_pcm16(samples), rate_hz))
    return path


def streaming_config(rate_hz: int = 16_000, **fields: Any) -> rasr.StreamingRecognitionConfig:
    config = {"encoding": riva.client.AudioEncoding.LINEAR_PCM, "sample_rate_hertz": rate_hz, "language_code": "en-US",
              "max_alternatives": 1, "enable_word_time_offsets": True, "audio_channel_count": 1, **fields}
    return riva.client.StreamingRecognitionConfig(config=riva.client.RecognitionConfig(**config), interim_results=True)


def refusal(call: Callable[[], Any]) -> grpc.RpcError:
    """The RpcError a blocking client call (or the iteration of its stream) ends with."""
    try:
        result = call()
        if not isinstance(result, rasr.RecognizeResponse | rtts.SynthesizeSpeechResponse):
            list(result)
    except grpc.RpcError as e:
        return e
    raise AssertionError("the call was not refused")


async def test_streaming_recognition_of_a_file_gives_interim_results_then_a_final_with_word_times(services, speech,
                                                                                                  tmp_path):
    """As Riva's own transcribe_file example streams: the WAV file in 100 ms chunks at the speed of
    speech, header and all (the service reads the header for the framing)."""
    samples = speech(QUESTION, 16_000)
    path = write_wav(tmp_path / "question.wav", samples, 16_000)
    config = streaming_config()
    riva.client.add_audio_file_specs_to_config(config, path)
    with riva.client.AudioChunkFileIterator(str(path), CHUNK_FRAMES, riva.client.sleep_audio_length) as chunks:
        responses = await in_thread(lambda: list(asr_client(services).streaming_response_generator(chunks, config)))
    results = [r for response in responses for r in response.results]
    interim = [r for r in results if not r.is_final]
    finals = [r for r in results if r.is_final]
    assert interim, "no interim result while the question was spoken"
    assert all(0.0 <= r.stability <= 1.0 and r.alternatives[0].transcript for r in interim)
    assert results[-1].is_final and len(finals) == 1  # one utterance: one final, last
    final = finals[0].alternatives[0]
    assert wer(QUESTION, final.transcript) <= WER_BOUND, final.transcript
    words = final.words
    assert normalised_text(" ".join(w.word for w in words)) == normalised_text(final.transcript)
    starts = [w.start_time for w in words]
    assert starts == sorted(starts) and all(w.start_time < w.end_time for w in words)
    # Milliseconds on the stream's timeline: the speech (whisper times its first word early) ends by the
    # file's 0.4 s of trailing silence, and within half a second of it.
    speech_end_ms = 1000 * (samples.size / 16_000 - 0.4)
    assert 0 <= words[0].start_time < 800 and speech_end_ms - 500 <= words[-1].end_time <= speech_end_ms + 100, starts
    assert 0 < final.confidence <= 1


async def test_streaming_recognition_without_interim_results_sends_finals_only_and_takes_mulaw(services, speech):
    """Telephone audio: G.711 mu-law at 8 kHz, raw (no header), as a SIP bridge sends it."""
    samples = resample(speech(QUESTION, 16_000), 16_000, 8_000)
    mulaw = g711.encode(float_to_pcm16(samples), "mulaw")
    config = streaming_config(8_000, encoding=riva.client.AudioEncoding.MULAW)
    config.interim_results = False
    chunks = [mulaw[i : i + 800] for i in range(0, len(mulaw), 800)]
    responses = await in_thread(lambda: list(asr_client(services).streaming_response_generator(chunks, config)))
    results = [r for response in responses for r in response.results]
    assert results and all(r.is_final for r in results)
    assert wer(QUESTION, " ".join(r.alternatives[0].transcript for r in results)) <= WER_BOUND


async def test_every_utterance_ends_in_a_final_even_a_sound_with_no_words(services, speech):
    """A tone long enough to be taken for speech, then a question: each utterance gets its is_final."""
    t = np.arange(int(1.2 * 16_000)) / 16_000
    hum = 0.3 * np.sin(2 * np.pi * 150 * t).astype(np.float32)
    audio = np.concatenate([speech(QUESTION, 16_000), np.zeros(16_000, np.float32), hum, np.zeros(16_000, np.float32)])
    pcm = float_to_pcm16(audio)
    config = streaming_config()
    chunks = [pcm[i : i + 3200] for i in range(0, len(pcm), 3200)]
    responses = await in_thread(lambda: list(asr_client(services).streaming_response_generator(chunks, config)))
    finals = [r for response in responses for r in response.results if r.is_final]
    assert finals and wer(QUESTION, finals[0].alternatives[0].transcript) <= WER_BOUND
    assert all(r.alternatives for r in finals)  # an empty one still has its (empty) alternative


async def test_offline_recognize_gives_one_result_per_utterance_with_word_times(services, speech):
    audio = np.concatenate([speech(QUESTION, 16_000), np.zeros(16_000, np.float32), speech(REPLY, 16_000)])
    config = riva.client.RecognitionConfig(encoding=riva.client.AudioEncoding.LINEAR_PCM, sample_rate_hertz=16_000,
                                           language_code="en-US", enable_word_time_offsets=True)
    response = await in_thread(asr_client(services).offline_recognize, float_to_pcm16(audio), config)
    transcripts = [r.alternatives[0].transcript for r in response.results]
    assert len(transcripts) == 2, transcripts
    assert wer(QUESTION, transcripts[0]) <= WER_BOUND and wer(REPLY, transcripts[1]) <= WER_BOUND, transcripts
    first_of_second = response.results[1].alternatives[0].words[0]
    assert first_of_second.start_time > response.results[0].alternatives[0].words[-1].end_time + 500


async def test_the_recognition_config_names_the_model_and_refuses_another(services):
    client = asr_client(services)
    reply = await in_thread(client.stub.GetRivaSpeechRecognitionConfig, rasr.RivaSpeechRecognitionConfigRequest())
    (model,) = reply.model_config
    assert model.model_name and model.parameters["streaming"] == "true"
    error = await in_thread(refusal, lambda: client.stub.GetRivaSpeechRecognitionConfig(
        rasr.RivaSpeechRecognitionConfigRequest(model_name="conformer-en-US-asr-streaming")))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and model.model_name in error.details()


async def test_synthesize_online_streams_the_audio_at_the_rate_asked(services):
    """Audio in several responses as phrases are made, as long at each rate as its word times say (the
    voice's own rate is 22.05 kHz), and what comes back at 16 kHz is heard as the text by Riva's Recognize."""
    client = tts_client(services)
    for rate in (16_000, 22_050, 48_000):
        responses = await in_thread(lambda rate=rate: list(client.synthesize_online(
            REPLY, sample_rate_hz=rate, enable_word_time_offsets=True)))
        assert len(responses) > 2, "the audio came in one piece"
        audio = b"".join(r.audio for r in responses)
        words = [w for r in responses for w in r.meta.words]
        assert normalised_text(" ".join(w.word for w in words)) == normalised_text(REPLY)
        seconds, spoken_s = len(audio) / 2 / rate, words[-1].end_time / 1000
        assert spoken_s <= seconds + 0.05 and seconds <= spoken_s + 0.6, (rate, seconds, spoken_s)
        if rate == 16_000:
            config = riva.client.RecognitionConfig(encoding=riva.client.AudioEncoding.LINEAR_PCM,
                                                   sample_rate_hertz=16_000, language_code="en-US")
            heard = await in_thread(asr_client(services).offline_recognize, audio, config)
            assert wer(REPLY, " ".join(r.alternatives[0].transcript for r in heard.results)) <= WER_BOUND


async def test_synthesize_online_takes_texts_in_pieces_as_one_text(services):
    """Pipecat's stitched mode: one stream, a sentence a request (heard back as the text); split anywhere
    at whitespace, the words are said as written (none glued to the next, none lost)."""
    client = tts_client(services)
    sentences = ["The capital of France is Paris.", "It is known for the Eiffel Tower."]
    responses = await in_thread(lambda: list(client.synthesize_online(sentences, sample_rate_hz=16_000)))
    config = riva.client.RecognitionConfig(encoding=riva.client.AudioEncoding.LINEAR_PCM, sample_rate_hertz=16_000,
                                           language_code="en-US")
    heard = await in_thread(asr_client(services).offline_recognize, b"".join(r.audio for r in responses), config)
    assert wer(REPLY, " ".join(r.alternatives[0].transcript for r in heard.results)) <= WER_BOUND
    pieces = ["The capital of France", "is Paris.", "It is known for", "the Eiffel Tower."]
    responses = await in_thread(lambda: list(client.synthesize_online(pieces, enable_word_time_offsets=True)))
    assert [w.word for r in responses for w in r.meta.words] == REPLY.split()


async def test_the_older_single_request_synthesize_online_is_served(services):
    """Before the bidirectional call, SynthesizeOnline took one request and streamed audio back: the
    same method on the wire, so an older client's unary-stream call is answered."""
    channel = riva.client.Auth(uri=services["tts"]).channel
    older = channel.unary_stream("/nvidia.riva.tts.RivaSpeechSynthesis/SynthesizeOnline",
                                 request_serializer=rtts.SynthesizeSpeechRequest.SerializeToString,
                                 response_deserializer=rtts.SynthesizeSpeechResponse.FromString)
    request = rtts.SynthesizeSpeechRequest(text=REPLY, language_code="en-US", sample_rate_hz=16_000,
                                           encoding=riva.client.AudioEncoding.LINEAR_PCM)
    responses = await in_thread(lambda: list(older(request)))
    assert len(responses) > 2 and sum(len(r.audio) for r in responses) > 2 * 16_000 * 2  # over 2 s of speech


async def test_synthesize_returns_the_whole_audio_with_word_times(services):
    client = tts_client(services)
    response = await in_thread(client.synthesize, REPLY, voice_name=services["voice"], sample_rate_hz=22_050,
                               enable_word_time_offsets=True)
    seconds = len(response.audio) / 2 / 22_050
    assert 2.5 < seconds < 10
    words = response.meta.words
    assert normalised_text(" ".join(w.word for w in words)) == normalised_text(REPLY)
    assert [w.start_time for w in words] == sorted(w.start_time for w in words)
    assert words[-1].end_time <= 1000 * seconds + 50



async def test_synthesize_speaks_mulaw_for_the_telephone(services):
    """G.711 mu-law at 8 kHz: a byte a sample, as long as its word times say, heard back (as mu-law) as the text."""
    mulaw = riva.client.AudioEncoding.MULAW
    response = await in_thread(tts_client(services).synthesize, REPLY, sample_rate_hz=8_000, encoding=mulaw,
                               enable_word_time_offsets=True)
    seconds, spoken_s = len(response.audio) / 8_000, response.meta.words[-1].end_time / 1000
    assert spoken_s <= seconds + 0.05 and seconds <= spoken_s + 0.6
    config = riva.client.RecognitionConfig(encoding=mulaw, sample_rate_hertz=8_000, language_code="en-US")
    heard = await in_thread(asr_client(services).offline_recognize, response.audio, config)
    assert wer(REPLY, " ".join(r.alternatives[0].transcript for r in heard.results)) <= WER_BOUND


async def test_the_synthesis_config_lists_the_voice_pipecat_asks_for_at_start_up(services):
    reply = await in_thread(tts_client(services).stub.GetRivaSynthesisConfig, rtts.RivaSynthesisConfigRequest())
    assert [m.model_name for m in reply.model_config] == [services["voice"]]
    assert reply.model_config[0].parameters["voice_name"] == services["voice"]
    assert int(reply.model_config[0].parameters["sample_rate_hz"]) > 0


@pytest.mark.parametrize("bad, fragment", [
    ({"text": ""}, "text is empty"),
    ({"text": "   "}, "text is empty"),
    ({"voice_name": "Magpie-Multilingual.EN-US.Aria"}, "is not served here"),
    ({"encoding": riva.client.AudioEncoding.OGGOPUS}, "encoding OGGOPUS is not served"),
    ({"encoding": 77}, "encoding 77 is not served"),
    ({"sample_rate_hz": 1_000}, "sample_rate_hz 1000"),
])
async def test_a_bad_synthesis_request_gets_invalid_argument_and_the_service_goes_on(services, bad, fragment):
    client = tts_client(services)
    request = {"text": REPLY, "sample_rate_hz": 16_000, **bad}
    for call in (lambda: client.synthesize(**request), lambda: client.synthesize_online(**request)):
        error = await in_thread(refusal, call)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and fragment in error.details(), error.details()
    assert (await in_thread(client.synthesize, "Still here.", sample_rate_hz=16_000)).audio


def _streaming_requests(config: rasr.StreamingRecognitionConfig | None, audio: bytes):
    if config is not None:
        yield rasr.StreamingRecognizeRequest(streaming_config=config)
    yield rasr.StreamingRecognizeRequest(audio_content=audio)


@pytest.mark.parametrize("config, fragment", [
    (None, "first message of a StreamingRecognize stream must carry streaming_config"),
    (streaming_config(encoding=riva.client.AudioEncoding.FLAC), "encoding FLAC is not served"),
    (streaming_config(encoding=riva.client.AudioEncoding.ENCODING_UNSPECIFIED), "encoding is unspecified"),
    (streaming_config(sample_rate_hertz=0), "sample_rate_hertz is required"),
    (streaming_config(sample_rate_hertz=4_000), "outside 8000-48000"),
    (streaming_config(language_code="de-DE"), "English-only"),
    (streaming_config(model="parakeet-ctc"), "model 'parakeet-ctc' is not served"),
    (streaming_config(diarization_config=rasr.SpeakerDiarizationConfig(enable_speaker_diarization=True)),
     "diarization"),
])
async def test_a_bad_recognition_stream_gets_invalid_argument_and_the_service_goes_on(services, speech, config,
                                                                                      fragment):
    client = asr_client(services)
    pcm = float_to_pcm16(speech("Hello.", 16_000))
    error = await in_thread(refusal, lambda: client.stub.StreamingRecognize(_streaming_requests(config, pcm)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and fragment in error.details(), error.details()
    offline = rasr.RecognizeRequest(config=streaming_config().config, audio=b"")
    error = await in_thread(refusal, lambda: client.stub.Recognize(offline))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "audio is empty" in error.details()
    heard = await in_thread(client.offline_recognize, pcm, streaming_config().config)
    assert "hello" in normalised_text(heard.results[0].alternatives[0].transcript)


async def test_health_and_reflection_name_the_riva_services(services):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    for service, name in (("asr", "nvidia.riva.asr.RivaSpeechRecognition"),
                          ("tts", "nvidia.riva.tts.RivaSpeechSynthesis")):
        channel = grpc.insecure_channel(services[service])
        reply = await in_thread(health_pb2_grpc.HealthStub(channel).Check, health_pb2.HealthCheckRequest(service=name))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = ProtoReflectionDescriptorDatabase(channel)
        assert name in await in_thread(reflection.get_services)
        channel.close()


async def test_riva_calls_over_tls_carry_the_service_credential(redis_url, tmp_path):
    """The tts service on TLS with the cluster's credential: Riva's client sends the credential as
    `authorization: Bearer` metadata (metadata_args), over TLS on every call, the config call Pipecat
    makes at start-up without metadata of its own too; without it (or with a wrong one), UNAUTHENTICATED."""
    from services.server.auth import AuthOptions
    from services.tls import TlsOptions
    from tests.certs import Authority

    ca = Authority(tmp_path / "ca")
    server = ca.issue("tts")
    settings = Settings(redis_url=redis_url, tts_port=free_port(), auth=AuthOptions(service_token="cluster-secret"),
                        tls=TlsOptions(cert_file=str(server.cert), key_file=str(server.key)))
    async with serve_one(settings, "tts") as address:
        served = {"tts": address}

        def client(token: str | None) -> riva.client.SpeechSynthesisService:
            metadata = [["authorization", f"Bearer {token}"]] if token else None
            return tts_client(served, ssl_root_cert=str(ca.ca_file), use_ssl=True, metadata_args=metadata)

        granted = client("cluster-secret")
        assert (await in_thread(granted.synthesize, "Hello.", sample_rate_hz=16_000)).audio
        config = await in_thread(granted.stub.GetRivaSynthesisConfig, rtts.RivaSynthesisConfigRequest())
        assert config.model_config
        for token in (None, "wrong"):
            error = await in_thread(refusal, lambda t=token: client(t).synthesize("Hi."))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED, error.details()


RIVA_SERVICES = (("asr", rasr, "RivaSpeechRecognition"), ("tts", rtts, "RivaSpeechSynthesis"))
RIVA_METHODS = [fuzz.Method(service, method) for service, proto, name in RIVA_SERVICES
                for method in proto.DESCRIPTOR.services_by_name[name].methods]
RIVA_HINTS = {"sample_rate_hertz": [16_000, 8_000, 0, 7_999], "sample_rate_hz": [16_000, 22_050, 0, 48_001],
              "encoding": [0, 1, 2, 3, 4, 20, 99], "language_code": ["en-US", "en", "de-DE", ""],
              "text": ["Hello there.", "", "$1,200."], "audio_channel_count": [1, 2, 3],
              "voice_name": ["en_US-joe-medium", "Aria"], "model_name": ["", "whisper"], "model": ["", "whisper"]}
FUZZ_EXAMPLES = int(os.environ.get("SPECVOX_FUZZ_EXAMPLES", "15"))


@pytest.mark.parametrize("method", RIVA_METHODS, ids=str)
async def test_fuzzed_riva_requests_end_with_a_clear_status_and_the_service_serving(services, method):
    """bench/fuzz.py's cases (random, guided and raw requests, sequences, cancels) on each Riva method."""
    from hypothesis import given

    channel = grpc.insecure_channel(services[method.service], options=fuzz.CLIENT_OPTIONS)
    health = health_pb2_grpc.HealthStub(channel)

    def check(case: fuzz.Case) -> None:
        outcome = fuzz.call(channel, method, case)
        assert fuzz.problem(outcome) is None, (fuzz.problem(outcome), case.describe(300))
        reply = health.Check(health_pb2.HealthCheckRequest(service=method.service_full_name), timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING

    settings = fuzz.fuzz_settings(FUZZ_EXAMPLES, derandomize=os.environ.get("CI", "").lower() == "true", shrink=True)
    try:
        await in_thread(settings(given(fuzz.case_strategy(method, RIVA_HINTS))(check)))
    finally:
        channel.close()


def clients_python() -> Path:
    """.venv-clients' Python (`make clients`; SPECVOX_CLIENTS_PYTHON names another); missing: skip, in CI fail."""
    python = Path(os.environ.get("SPECVOX_CLIENTS_PYTHON", ROOT / ".venv-clients/bin/python"))
    if not python.exists():
        problem = f"{python} is missing: `make clients` builds .venv-clients (requirements/clients.txt)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(problem + "; make test does")
        pytest.skip(problem)
    return python


async def test_pipecat_nvidia_stt_and_tts_services_talk_to_specvox(services, speech, tmp_path):
    """Pipecat's NvidiaSTTService and NvidiaTTSService (use_ssl=False) in their own pipelines, in the
    clients' environment: a spoken question transcribed (interim frames, then the final), and a reply
    synthesized at the rate the pipeline asked for (tests/clients/pipecat_riva.py)."""
    wav = write_wav(tmp_path / "question.wav", speech(QUESTION, 16_000), 16_000)
    process = await asyncio.create_subprocess_exec(
        str(clients_python()), str(ROOT / "tests/clients/pipecat_riva.py"), "--asr", services["asr"],
        "--tts", services["tts"], "--wav", str(wav), "--voice", services["voice"], "--text", REPLY,
        "--rate", "24000", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), 180)
    assert process.returncode == 0, err.decode()[-3000:]
    result = json.loads(out.decode().strip().splitlines()[-1])
    assert not result["stt_errors"] and not result["tts_errors"], result
    assert wer(QUESTION, result["transcript"]) <= WER_BOUND and result["interim_count"] > 0, result
    assert result["tts_sample_rate"] == [24_000] and result["tts_frames"] > 2, result
    # As much audio as Riva's own client gets at 24 kHz (the voice is noiseless: the same speech), which at
    # the voice's own 22.05 kHz would be 8 % less.
    same = await in_thread(tts_client(services).synthesize, REPLY, sample_rate_hz=24_000)
    assert result["tts_audio_bytes"] == pytest.approx(len(same.audio), rel=0.01), (result, len(same.audio))
