"""The tts gRPC service: tails a turn's token stream (or takes text), returns audio and cues.

Synthesis runs in the model's worker thread one piece (a sentence of a phrase, or a
part of one) at a time, so a cancelled call (a barge-in) stops after the piece in hand
and nothing queued behind it is made or sent.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from pipeline.audio import float_to_pcm16
from pipeline.models import resolve_piper_voice
from pipeline.tts.backend import Synthesizer, load_synthesizer
from pipeline.tts.phrases import PhraseCutter, PhraseOptions
from pipeline.tts.speaker import ReplySpeaker, SpeechPiece
from services.grpc_server import ModelWorker, StageClock, serve, status_on_error
from services.protos import load, load_common
from services.redis_store import now_ms, read_token_stream
from services.runtime import RedisContext, open_redis
from services.settings import Settings

pb, pb_grpc = load("tts")
common = load_common()
AUDIO_CHUNK_S = 0.2  # audio goes out in pieces this long, so the client can start playing early
MAX_TEXT_CHARS = 100_000
MIN_SAMPLE_RATE_HZ, MAX_SAMPLE_RATE_HZ = 8_000, 48_000


class TtsServicer(pb_grpc.TtsServicer):
    def __init__(self, settings: Settings, synthesizer: Synthesizer, redis: RedisContext) -> None:
        self.settings = settings
        self.synthesizer = synthesizer
        self.redis = redis
        self.worker = ModelWorker("tts")
        self.voice = voice_name(settings)

    async def Capabilities(self, request, context: grpc.aio.ServicerContext):
        return pb.ServiceCapabilities(voices=[self.voice], default_voice=self.voice,
                                      sample_rate_hz=self.synthesizer.sample_rate_hz,
                                      backend=self.settings.tts.backend)

    def _check_voice(self, voice: str) -> None:
        if voice and voice != self.voice:
            raise ValueError(f"voice {voice!r} is not served here: choose {self.voice!r} (or leave it empty)")

    async def SpeakTurn(self, request, context: grpc.aio.ServicerContext) -> AsyncIterator:
        clock = StageClock("tts")
        async with status_on_error(context, "tts"):
            await self.redis.sessions.require(request.session_id)
            await self.redis.turns.require(request.turn_id, request.session_id)
            self._check_voice(request.voice)
            speaker = self._speaker(request.sample_rate_hz)
            cutter = PhraseCutter(self.settings.phrases)
            timeout_s = request.token_timeout_s or self.settings.token_timeout_s
            deadline_ms = request.budget.deadline_unix_ms
            hurry_at_ms = deadline_ms - self.settings.phrases.hurry_before_deadline_ms
            degradations = []
            async for entry in read_token_stream(self.redis.client, request.turn_id, timeout_s):
                clock.received()
                if deadline_ms and now_ms() >= hurry_at_ms and cutter.hurry():  # the budget: a shorter first phrase
                    degradations.append("first_phrase_shortened")
                phrases = cutter.feed(entry.text) + (cutter.flush() if entry.end else [])
                async for event in self._speak(speaker, phrases, clock):
                    yield event
            yield pb.SpeechEvent(times=common.StageTimes(**vars(clock), degradations=degradations))

    async def Synthesize(self, request, context: grpc.aio.ServicerContext) -> AsyncIterator:
        clock = StageClock("tts")
        clock.received()
        async with status_on_error(context, "tts"):
            if not request.text.strip():
                raise ValueError("text is empty")
            _check_length(len(request.text))
            self._check_voice(request.voice)
            speaker = self._speaker(request.sample_rate_hz)
            cutter = PhraseCutter(PhraseOptions(first_phrase_min_chars=1))
            async for event in self._speak(speaker, cutter.feed(request.text) + cutter.flush(), clock):
                yield event
            yield _documents(speaker)
            yield pb.SpeechEvent(times=clock.to_proto(common.StageTimes))

    async def SynthesizeStream(self, request_iterator, context: grpc.aio.ServicerContext) -> AsyncIterator:
        """Text in pieces: each phrase is spoken as soon as it is complete, the rest at the end."""
        clock = StageClock("tts")
        async with status_on_error(context, "tts"):
            speaker: ReplySpeaker | None = None
            cutter = PhraseCutter(self.settings.phrases)
            chars, said_anything = 0, False
            async for piece in request_iterator:
                clock.received()
                speaker = speaker or self._speaker(piece.sample_rate_hz)
                chars += len(piece.text)
                said_anything = said_anything or bool(piece.text.strip())
                _check_length(chars)
                async for event in self._speak(speaker, cutter.feed(piece.text), clock):
                    yield event
            if speaker is None or not said_anything:
                raise ValueError("text is empty")
            async for event in self._speak(speaker, cutter.flush(), clock):
                yield event
            yield _documents(speaker)
            yield pb.SpeechEvent(times=clock.to_proto(common.StageTimes))

    def _speaker(self, sample_rate_hz: int) -> ReplySpeaker:
        if sample_rate_hz and not MIN_SAMPLE_RATE_HZ <= sample_rate_hz <= MAX_SAMPLE_RATE_HZ:
            raise ValueError(f"sample_rate_hz {sample_rate_hz} is outside {MIN_SAMPLE_RATE_HZ}-{MAX_SAMPLE_RATE_HZ}")
        return ReplySpeaker(self.synthesizer, sample_rate_hz)

    async def _speak(self, speaker: ReplySpeaker, phrases: list[str], clock: StageClock) -> AsyncIterator:
        """The phrases' events, one synthesized piece at a time (a cancel lands between pieces)."""
        for text in phrases:
            async for piece in self.worker.iterate(speaker.speak(text)):
                for event in _events(piece, speaker):
                    if event.WhichOneof("event") == "audio":
                        clock.emitted()
                    yield event


def voice_name(settings: Settings) -> str:
    """The name a client picks this service's voice by: the Piper voice file's, or the Coqui model's."""
    tts = settings.tts
    if tts.backend == "coqui":
        return tts.coqui_model
    return Path(resolve_piper_voice(tts.voice).model_path).stem


def _events(piece: SpeechPiece, speaker: ReplySpeaker) -> list:
    """Word cues first (they are known once the piece is made), then its audio, then the phrase cue."""
    events = [pb.SpeechEvent(word=_cue(c, piece.phrase_index)) for c in piece.word_cues]
    step = int(AUDIO_CHUNK_S * piece.sample_rate_hz)
    for offset in range(0, piece.audio.size, step):
        events.append(pb.SpeechEvent(audio=common.AudioChunk(
            pcm_s16le=float_to_pcm16(piece.audio[offset : offset + step]),
            sample_rate_hz=piece.sample_rate_hz,
            start_s=piece.start_s + offset / piece.sample_rate_hz,
            phrase_index=piece.phrase_index,
            chunk_index=speaker.chunks_out,
        )))
        speaker.chunks_out += 1
    if piece.phrase_cue:
        events.append(pb.SpeechEvent(cue=_cue(piece.phrase_cue, piece.phrase_index)))
    return events


def _cue(cue, phrase_index: int):
    return common.CaptionCue(start_s=cue.start_s, end_s=cue.end_s, text=cue.text, phrase_index=phrase_index)


def _documents(speaker: ReplySpeaker):
    return pb.SpeechEvent(captions=pb.CaptionDocuments(**speaker.captions.documents()))


def _check_length(chars: int) -> None:
    if chars > MAX_TEXT_CHARS:
        raise ValueError(f"text of {chars} characters exceeds {MAX_TEXT_CHARS}: split it over several calls")


async def run(settings: Settings) -> None:
    redis = await open_redis(settings)
    synthesizer = load_synthesizer(settings.tts)
    synthesizer.warm_up()
    servicer = TtsServicer(settings, synthesizer, redis)
    await serve(
        "tts",
        lambda server: pb_grpc.add_TtsServicer_to_server(servicer, server),
        [pb.DESCRIPTOR.services_by_name["Tts"].full_name],
        f"{settings.host}:{settings.tts_port}",
        settings.max_message_bytes,
        on_stop=redis.close,
    )
