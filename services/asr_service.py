"""The asr gRPC service: a stream of audio in, speech-start and final transcripts out."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import numpy as np

from pipeline.asr import SAMPLE_RATE_HZ, AsrOptions, Transcriber, Utterance, UtteranceSegmenter
from pipeline.audio import AudioStreamReader, PcmFormat, PcmStreamDecoder
from services.grpc_server import ModelWorker, StageClock, serve, status_on_error
from services.protos import load
from services.redis_store import SessionStore, now_ms
from services.runtime import open_redis
from services.settings import Settings

pb, pb_grpc = load("asr")
Kind = pb.TranscriptEvent.Kind


class WireAudioDecoder:
    """The stream's audio bytes, in their declared framing, as mono float32 at 16 kHz."""

    def __init__(self, fmt: pb.AudioFormat) -> None:
        declared = PcmFormat(fmt.sample_rate_hz, fmt.channels or 1, fmt.sample_width_bytes or 2)
        self.reader = AudioStreamReader(fmt.encoding, declared)
        self._decoder: PcmStreamDecoder | None = None

    def feed(self, chunk: bytes) -> np.ndarray:
        pcm = self.reader.feed(chunk)
        if self.reader.format is None:
            return np.zeros(0, np.float32)
        if self._decoder is None:
            self._decoder = PcmStreamDecoder(self.reader.format, SAMPLE_RATE_HZ)
        return self._decoder.feed(pcm)

    def finish(self) -> np.ndarray:
        self.reader.finish()
        assert self._decoder is not None  # a complete header or PCM always makes one
        return self._decoder.finish()


class AsrServicer(pb_grpc.AsrServicer):
    def __init__(self, options: AsrOptions, sessions: SessionStore) -> None:
        self.options = options
        self.sessions = sessions
        self.transcriber = Transcriber(options)
        self.worker = ModelWorker("asr")

    async def Transcribe(self, request_iterator, context: grpc.aio.ServicerContext) -> AsyncIterator:
        clock = StageClock("asr")
        async with status_on_error(context, "asr"):
            config = await _first_config(request_iterator)
            await self.sessions.require(config.session_id)
            decoder = WireAudioDecoder(config.format)
            segmenter = UtteranceSegmenter(self.options)
            yield pb.TranscriptEvent(kind=Kind.READY, emitted_unix_ms=now_ms())
            async for request in request_iterator:
                if request.WhichOneof("payload") != "audio":
                    raise ValueError("only audio may follow the stream's config message")
                clock.received()
                was_active = segmenter.speech_active
                closed = await self.worker.call(segmenter.feed, decoder.feed(request.audio))
                if segmenter.speech_active and not was_active:
                    yield self._event(clock, Kind.SPEECH_STARTED, segmenter.stream_s)
                for utterance in closed:
                    yield await self._final(clock, utterance)
            tail = decoder.finish()
            closed = await self.worker.call(segmenter.feed, tail)
            closed += await self.worker.call(segmenter.finish)
            for utterance in closed:
                yield await self._final(clock, utterance)

    def _event(self, clock: StageClock, kind: int, at_s: float) -> pb.TranscriptEvent:
        clock.emitted()
        return pb.TranscriptEvent(kind=kind, speech_start_s=at_s, emitted_unix_ms=now_ms())

    async def _final(self, clock: StageClock, utterance: Utterance) -> pb.TranscriptEvent:
        transcript = await self.worker.call(self.transcriber.transcribe, utterance)
        clock.emitted()
        return pb.TranscriptEvent(
            kind=Kind.FINAL,
            text=transcript.text,
            words=[pb.Word(text=w.text, start_s=w.start_s, end_s=w.end_s, probability=w.probability)
                   for w in transcript.words],
            speech_start_s=utterance.speech_start_s,
            speech_end_s=utterance.speech_end_s,
            utterance_index=utterance.index,
            emitted_unix_ms=now_ms(),
            times=clock.to_proto(pb.StageTimes),
        )


async def _first_config(request_iterator) -> pb.StreamConfig:
    async for request in request_iterator:
        if request.WhichOneof("payload") != "config":
            raise ValueError("the first message of a Transcribe stream must be its config")
        return request.config
    raise ValueError("the stream ended before its config message")


async def run(settings: Settings) -> None:
    redis = await open_redis(settings)
    servicer = AsrServicer(settings.asr, redis.sessions)
    servicer.transcriber.warm_up()
    await serve(
        "asr",
        lambda server: pb_grpc.add_AsrServicer_to_server(servicer, server),
        [pb.DESCRIPTOR.services_by_name["Asr"].full_name],
        f"{settings.host}:{settings.asr_port}",
        settings.max_message_bytes,
        on_stop=redis.close,
    )
