"""`nvidia.riva.asr.RivaSpeechRecognition` on the asr service: Riva's recognition calls run as
one stream of the asr stage's own recogniser (`AsrServicer.recognize`, what Transcribe runs).

- StreamingRecognize: the first message is the config, every later one audio. Interim results
  (when asked) are the stage's partials, `stability` their committed share of the words; every
  utterance the VAD closes ends in one `is_final` result, empty if nothing was said.
- Recognize: the whole audio as one stream; one result per utterance.
- Word times (`enable_word_time_offsets`) in milliseconds on the stream's timeline.
- Audio: LINEAR_PCM at `sample_rate_hertz` (mono or interleaved stereo), MULAW and ALAW; a
  WAV header at the head of the audio (as the Riva client sends files) is read instead.
- Speech contexts' phrases become whisper's prompt; endpointing and custom configuration are
  left to the asr settings (its VAD decides the end of an utterance). What cannot be honoured
  (diarization, recognition per channel, another model) is INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING

import grpc
from riva.client.proto import riva_asr_pb2 as rasr
from riva.client.proto import riva_asr_pb2_grpc as rasr_grpc

from pipeline import g711
from pipeline.asr import SAMPLE_RATE_HZ, Word
from pipeline.asr_stream import AsrEvent, FinalTranscript, PartialTranscript
from pipeline.audio import Encoding
from services.protos import load_common
from services.riva import G711_LAWS, AudioEncoding, check_encoding, language_of
from services.server.errors import status_on_error
from services.server.stage_clock import StageClock

if TYPE_CHECKING:
    from services.stages.asr import AsrServicer

common = load_common()
SERVICE_NAME = rasr.DESCRIPTOR.services_by_name["RivaSpeechRecognition"].full_name
WAV_MAGIC = b"RIFF"


def add_to_server(asr: AsrServicer, server: grpc.aio.Server) -> None:
    rasr_grpc.add_RivaSpeechRecognitionServicer_to_server(RivaAsrServicer(asr), server)


class RivaAsrServicer(rasr_grpc.RivaSpeechRecognitionServicer):
    def __init__(self, asr: AsrServicer) -> None:
        self.asr = asr

    @property
    def model_name(self) -> str:
        return self.asr.options.model

    async def GetRivaSpeechRecognitionConfig(self, request, context: grpc.aio.ServicerContext):
        async with status_on_error(context, "asr"):
            self._check_model(request.model_name)
            language = self.asr.options.language
            return rasr.RivaSpeechRecognitionConfigResponse(model_config=[
                rasr.RivaSpeechRecognitionConfigResponse.Config(model_name=self.model_name, parameters={
                    "type": "online", "streaming": "true", "offline": "true",
                    "language_code": language or "multi", "sample_rate": str(SAMPLE_RATE_HZ),
                    "encodings": "LINEAR_PCM,MULAW,ALAW", "word_time_offsets": "true"})])

    async def StreamingRecognize(self, request_iterator, context: grpc.aio.ServicerContext) -> AsyncIterator:
        clock = StageClock("asr")
        async with status_on_error(context, "asr"):
            requests = aiter(request_iterator)
            first = await anext(requests, None)
            if first is None or first.WhichOneof("streaming_request") != "streaming_config":
                raise ValueError("the first message of a StreamingRecognize stream must carry streaming_config")
            streaming = first.streaming_config
            config = streaming.config
            self._check_config(config)
            audio = _stream_audio(requests, clock)
            events = self._recognize(config, await _first_audio(audio), audio)
            async for event in events:
                result = _streaming_result(event, config, streaming.interim_results)
                if result is not None:
                    clock.emitted()
                    yield rasr.StreamingRecognizeResponse(results=[result], id=first.id)

    async def Recognize(self, request, context: grpc.aio.ServicerContext):
        async with status_on_error(context, "asr"):
            self._check_config(request.config)
            if not request.audio:
                raise ValueError("audio is empty")
            events = self._recognize(request.config, request.audio, _nothing())
            finals = [e async for e in events if isinstance(e, FinalTranscript)]
            return rasr.RecognizeResponse(results=[_offline_result(f, request.config) for f in finals], id=request.id)

    def _recognize(self, config: rasr.RecognitionConfig, head: bytes,
                   rest: AsyncIterator[bytes]) -> AsyncIterator[AsrEvent]:
        """The asr stage's recognition of the audio `head` (read ahead: its framing) and `rest`."""
        return self.asr.recognize(_wire_format(config, head), language_of(config.language_code),
                                  _decoded(head, rest, config.encoding), _phrases(config))

    def _check_model(self, model: str) -> None:
        if model and model != self.model_name:
            raise ValueError(f"model {model!r} is not served here: choose {self.model_name!r} (or leave it empty)")

    def _check_config(self, config: rasr.RecognitionConfig) -> None:
        """What this service cannot honour, refused before any audio is heard."""
        self._check_model(config.model)
        if config.encoding != AudioEncoding.ENCODING_UNSPECIFIED:
            check_encoding(config.encoding)
        if config.diarization_config.enable_speaker_diarization:
            raise ValueError("speaker diarization is not served here")
        if config.enable_separate_recognition_per_channel and config.audio_channel_count > 1:
            raise ValueError("recognition per channel is not served here: channels are mixed to one")


async def _nothing() -> AsyncIterator[bytes]:
    return
    yield b""  # an async generator that yields nothing


async def _stream_audio(requests: AsyncIterator, clock: StageClock) -> AsyncIterator[bytes]:
    """The audio of a stream's later messages; a second config is refused."""
    async for request in requests:
        if request.WhichOneof("streaming_request") == "streaming_config":
            raise ValueError("streaming_config may come only in the stream's first message")
        clock.received()
        if request.audio_content:
            yield request.audio_content


async def _first_audio(audio: AsyncIterator[bytes]) -> bytes:
    """The first audio chunk, waited for (its head tells a WAV file from raw samples)."""
    async for chunk in audio:
        return chunk
    raise ValueError("the stream carried no audio")


def _wire_format(config: rasr.RecognitionConfig, head: bytes) -> common.AudioFormat:
    """The stage's AudioFormat for Riva's config: WAV where the audio starts with a WAV header, else
    16-bit PCM (G.711 arrives decoded to it) at `sample_rate_hertz`."""
    if head.startswith(WAV_MAGIC) and config.encoding in (AudioEncoding.ENCODING_UNSPECIFIED,
                                                          AudioEncoding.LINEAR_PCM):
        return common.AudioFormat(encoding=Encoding.WAV)
    if config.encoding == AudioEncoding.ENCODING_UNSPECIFIED:
        raise ValueError("config.encoding is unspecified: use LINEAR_PCM, MULAW or ALAW (or send a WAV file)")
    if not config.sample_rate_hertz:
        raise ValueError("config.sample_rate_hertz is required for headerless audio")
    return common.AudioFormat(encoding=Encoding.PCM_S16LE, sample_rate_hz=config.sample_rate_hertz,
                              channels=config.audio_channel_count or 1, sample_width_bytes=2)


async def _decoded(head: bytes, rest: AsyncIterator[bytes], encoding: int) -> AsyncIterator[bytes]:
    """The stream's bytes as the stage reads them: G.711 expanded to 16-bit PCM, the rest as sent."""
    law = G711_LAWS.get(encoding)
    yield g711.decode(head, law) if law else head
    async for chunk in rest:
        yield g711.decode(chunk, law) if law else chunk


def _phrases(config: rasr.RecognitionConfig) -> list[str]:
    """The speech contexts' phrases, whisper's first prompt (boost values have no counterpart)."""
    return [phrase for context in config.speech_contexts for phrase in context.phrases]


def _streaming_result(event: AsrEvent, config: rasr.RecognitionConfig,
                      interim: bool) -> rasr.StreamingRecognitionResult | None:
    """A partial (with text, when interim results are asked) or a final as Riva's result; None for the rest."""
    if isinstance(event, PartialTranscript) and interim and event.text:
        words = (*event.committed, *event.tentative)
        return rasr.StreamingRecognitionResult(alternatives=[_alternative(event.text, words, config)],
                                               is_final=False, stability=event.stability,
                                               audio_processed=event.heard_s)
    if isinstance(event, FinalTranscript):
        return rasr.StreamingRecognitionResult(alternatives=[_alternative(event.text, event.words, config)],
                                               is_final=True, stability=1.0,
                                               audio_processed=event.utterance.speech_end_s)
    return None


def _offline_result(final: FinalTranscript, config: rasr.RecognitionConfig) -> rasr.SpeechRecognitionResult:
    return rasr.SpeechRecognitionResult(alternatives=[_alternative(final.text, final.words, config)],
                                        audio_processed=final.utterance.speech_end_s)


def _alternative(text: str, words: Iterable[Word], config: rasr.RecognitionConfig) -> rasr.SpeechRecognitionAlternative:
    words = list(words)
    confidence = sum(w.probability for w in words) / len(words) if words else 0.0
    timed = [rasr.WordInfo(word=w.text.strip(), start_time=round(w.start_s * 1000), end_time=round(w.end_s * 1000),
                           confidence=w.probability) for w in words] if config.enable_word_time_offsets else []
    return rasr.SpeechRecognitionAlternative(transcript=text, confidence=confidence, words=timed,
                                             language_code=[config.language_code] if config.language_code else [])
