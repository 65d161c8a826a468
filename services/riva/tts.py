"""`nvidia.riva.tts.RivaSpeechSynthesis` on the tts service: Riva's calls run as the tts stage's own
Synthesize and SynthesizeStream (the same phrase cutting, synthesis, resampling and word cues).

- Synthesize: the whole text's audio in one response.
- SynthesizeOnline: a stream of requests (Riva's current bidirectional call; the older call, one
  request and a stream back, is the same method on the wire): the first request's voice, rate and
  encoding hold for the stream, the texts are spoken as one text (a space between them), each
  phrase as soon as it is complete; audio goes out in `AUDIO_CHUNK_S` pieces.
- Audio: LINEAR_PCM (16-bit mono) at `sample_rate_hz` (0: the voice's own rate), or MULAW/ALAW.
- Word times (`enable_word_time_offsets`) in `meta.words`, in milliseconds of the reply's audio:
  SynthesizeOnline sends each word's on the first response after the stage knows it (one with no
  audio carries those known only after the last audio).
- GetRivaSynthesisConfig (Pipecat calls it at start-up): one entry per voice, named as
  `voice_name` takes it. An unknown voice, zero-shot data, an encoding not served and empty text
  are INVALID_ARGUMENT; `language_code` and `custom_dictionary` are not used (the voice decides).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
from riva.client.proto import riva_tts_pb2 as rtts
from riva.client.proto import riva_tts_pb2_grpc as rtts_grpc

from pipeline import g711
from services.protos import load
from services.riva import G711_LAWS, AudioEncoding, check_encoding
from services.server.errors import status_on_error

if TYPE_CHECKING:
    from services.stages.tts import TtsServicer

pb, _ = load("tts")
SERVICE_NAME = rtts.DESCRIPTOR.services_by_name["RivaSpeechSynthesis"].full_name
PIPER_VOICE_LANGUAGE = re.compile(r"^([a-z]{2,3})_([A-Z]{2})-")  # en_US-joe-medium → en-US


def add_to_server(tts: TtsServicer, server: grpc.aio.Server) -> None:
    rtts_grpc.add_RivaSpeechSynthesisServicer_to_server(RivaTtsServicer(tts), server)


class RivaTtsServicer(rtts_grpc.RivaSpeechSynthesisServicer):
    def __init__(self, tts: TtsServicer) -> None:
        self.tts = tts

    async def GetRivaSynthesisConfig(self, request, context: grpc.aio.ServicerContext):
        async with status_on_error(context, "tts"):
            capabilities = await self.tts.Capabilities(pb.CapabilitiesRequest(), context)
            voices = list(capabilities.voices)
            if request.model_name:
                _check_voice(request.model_name, voices)
                voices = [request.model_name]
            return rtts.RivaSynthesisConfigResponse(model_config=[
                rtts.RivaSynthesisConfigResponse.Config(model_name=voice, parameters={
                    "voice_name": voice, "language_code": voice_language(voice),
                    "sample_rate_hz": str(capabilities.sample_rate_hz), "backend": capabilities.backend,
                    "encodings": "LINEAR_PCM,MULAW,ALAW", "streaming": "true"}) for voice in voices])

    async def Synthesize(self, request, context: grpc.aio.ServicerContext):
        async with status_on_error(context, "tts"):
            await self._check(request, context)
            native = pb.SynthesizeRequest(text=request.text, sample_rate_hz=request.sample_rate_hz,
                                          voice=request.voice_name)
            audio, words = bytearray(), []
            async for event in self.tts.Synthesize(native, context):
                kind = event.WhichOneof("event")
                if kind == "audio":
                    audio += event.audio.pcm_s16le
                elif kind == "word":
                    words.append(_word_timing(event.word))
            return rtts.SynthesizeSpeechResponse(
                audio=_encoded(bytes(audio), request.encoding), id=request.id,
                meta=rtts.SynthesizeSpeechResponseMetadata(
                    text=request.text, words=words if request.enable_word_time_offsets else []))

    async def SynthesizeOnline(self, request_iterator, context: grpc.aio.ServicerContext) -> AsyncIterator:
        async with status_on_error(context, "tts"):
            requests = aiter(request_iterator)
            first = await anext(requests, None)
            if first is None:
                raise ValueError("the stream ended before its first request")
            await self._check(first, context)
            words: list[rtts.WordTiming] = []
            async for event in self.tts.SynthesizeStream(_text_pieces(first, requests), context):
                kind = event.WhichOneof("event")
                if kind == "word" and first.enable_word_time_offsets:
                    words.append(_word_timing(event.word))
                elif kind == "audio":
                    yield rtts.SynthesizeSpeechResponse(audio=_encoded(event.audio.pcm_s16le, first.encoding),
                                                        meta=rtts.SynthesizeSpeechResponseMetadata(words=words),
                                                        id=first.id)
                    words = []
            if words:  # cues known after the last audio: a response of their own
                yield rtts.SynthesizeSpeechResponse(meta=rtts.SynthesizeSpeechResponseMetadata(words=words),
                                                    id=first.id)

    async def _check(self, request: rtts.SynthesizeSpeechRequest, context: grpc.aio.ServicerContext) -> None:
        """What this service cannot honour, refused before anything is synthesized."""
        if request.encoding != AudioEncoding.ENCODING_UNSPECIFIED:  # unspecified: LINEAR_PCM
            check_encoding(request.encoding)
        if request.zero_shot_data.audio_prompt:
            raise ValueError("zero-shot voices (zero_shot_data) are not served here")
        if request.voice_name:
            capabilities = await self.tts.Capabilities(pb.CapabilitiesRequest(), context)
            _check_voice(request.voice_name, list(capabilities.voices))


async def _text_pieces(first: rtts.SynthesizeSpeechRequest, rest: AsyncIterator) -> AsyncIterator:
    """Riva's texts as the stage's text pieces: one text, a space between them (the client splits
    at whitespace, and a sentence's end stays one); the first request's rate holds for the stream."""
    yield pb.TextPiece(text=first.text, sample_rate_hz=first.sample_rate_hz)
    async for request in rest:
        yield pb.TextPiece(text=" " + request.text)


def _check_voice(voice: str, voices: list[str]) -> None:
    if voice not in voices:
        raise ValueError(f"voice {voice!r} is not served here: choose {' or '.join(map(repr, voices))} "
                         "(or leave voice_name empty)")


def voice_language(voice: str) -> str:
    """A Piper voice's language as Riva writes it ("en-US"); "" where the name does not say."""
    match = PIPER_VOICE_LANGUAGE.match(voice)
    return f"{match[1]}-{match[2]}" if match else ""


def _word_timing(cue) -> rtts.WordTiming:
    return rtts.WordTiming(word=cue.text, start_time=round(cue.start_s * 1000), end_time=round(cue.end_s * 1000))


def _encoded(pcm_s16le: bytes, encoding: int) -> bytes:
    law = G711_LAWS.get(encoding)
    return g711.encode(pcm_s16le, law) if law else pcm_s16le
