"""The tts gRPC service: tails a turn's token stream (or takes text), returns audio and cues."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from pipeline.audio import float_to_pcm16
from pipeline.tts.phrases import PhraseCutter, PhraseOptions
from pipeline.tts.piper_backend import PiperSynthesizer
from pipeline.tts.speaker import ReplySpeaker, SpokenPhrase
from services.grpc_server import ModelWorker, StageClock, serve, status_on_error
from services.protos import load
from services.redis_store import read_token_stream
from services.runtime import RedisContext, open_redis
from services.settings import Settings

pb, pb_grpc = load("tts")
AUDIO_CHUNK_S = 0.2  # audio goes out in pieces this long, so the client can start playing early
MAX_TEXT_CHARS = 100_000
MAX_SAMPLE_RATE_HZ = 48_000


class TtsServicer(pb_grpc.TtsServicer):
    def __init__(self, settings: Settings, synthesizer: PiperSynthesizer, redis: RedisContext) -> None:
        self.settings = settings
        self.synthesizer = synthesizer
        self.redis = redis
        self.worker = ModelWorker("tts")

    async def SpeakTurn(self, request, context: grpc.aio.ServicerContext) -> AsyncIterator:
        clock = StageClock("tts")
        async with status_on_error(context, "tts"):
            await self.redis.sessions.require(request.session_id)
            await self.redis.turns.require(request.turn_id, request.session_id)
            speaker = self._speaker(request.sample_rate_hz)
            cutter = PhraseCutter(self.settings.phrases)
            timeout_s = request.token_timeout_s or self.settings.token_timeout_s
            async for entry in read_token_stream(self.redis.client, request.turn_id, timeout_s):
                clock.received()
                phrases = cutter.feed(entry.text) + (cutter.flush() if entry.end else [])
                for text in phrases:
                    async for event in self._speak(speaker, text, clock):
                        yield event
            yield pb.SpeechEvent(times=clock.to_proto(pb.StageTimes))

    async def Synthesize(self, request, context: grpc.aio.ServicerContext) -> AsyncIterator:
        clock = StageClock("tts")
        clock.received()
        async with status_on_error(context, "tts"):
            if not request.text.strip():
                raise ValueError("text is empty")
            if len(request.text) > MAX_TEXT_CHARS:
                raise ValueError(f"text of {len(request.text)} characters exceeds {MAX_TEXT_CHARS}")
            speaker = self._speaker(request.sample_rate_hz)
            cutter = PhraseCutter(PhraseOptions(first_phrase_min_chars=1))
            for text in cutter.feed(request.text) + cutter.flush():
                async for event in self._speak(speaker, text, clock):
                    yield event
            yield pb.SpeechEvent(times=clock.to_proto(pb.StageTimes))

    def _speaker(self, sample_rate_hz: int) -> ReplySpeaker:
        if sample_rate_hz and not 8_000 <= sample_rate_hz <= MAX_SAMPLE_RATE_HZ:
            raise ValueError(f"sample_rate_hz {sample_rate_hz} is outside 8000-{MAX_SAMPLE_RATE_HZ}")
        return ReplySpeaker(self.synthesizer, sample_rate_hz)

    async def _speak(self, speaker: ReplySpeaker, text: str, clock: StageClock) -> AsyncIterator:
        phrase: SpokenPhrase = await self.worker.call(speaker.speak, text)
        step = int(AUDIO_CHUNK_S * phrase.sample_rate_hz)
        for offset in range(0, phrase.audio.size, step):
            clock.emitted()
            yield pb.SpeechEvent(audio=pb.AudioChunk(
                pcm_s16le=float_to_pcm16(phrase.audio[offset : offset + step]),
                sample_rate_hz=phrase.sample_rate_hz,
                start_s=phrase.start_s + offset / phrase.sample_rate_hz,
                phrase_index=phrase.index,
            ))
        cue = phrase.cue
        yield pb.SpeechEvent(cue=pb.CaptionCue(start_s=cue.start_s, end_s=cue.end_s, text=cue.text))


async def run(settings: Settings) -> None:
    redis = await open_redis(settings)
    synthesizer = PiperSynthesizer(settings.tts)
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
