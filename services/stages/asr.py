"""The asr gRPC service: a stream of audio in; voice and speech starts, partial and final transcripts out."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import AsyncIterator, Sequence

import grpc
import numpy as np

from pipeline.asr import (
    SAMPLE_RATE_HZ,
    AsrOptions,
    Transcriber,
    prompt_of_phrases,
    with_speech_threshold,
    with_vad_gain,
)
from pipeline.asr_stream import (
    AsrEvent,
    PartialTranscript,
    SharedCadence,
    SpeechStarted,
    StreamingRecognizer,
    VoiceEnded,
    VoiceStarted,
    join_words,
)
from pipeline.audio import AudioStreamReader, PcmFormat, PcmStreamDecoder
from services.protos import load, load_common
from services.riva import asr as riva_asr
from services.server import logs
from services.server.errors import status_on_error
from services.server.model_worker import ModelWorker
from services.server.runtime import Service, service_main
from services.server.stage_clock import StageClock
from services.settings import Settings
from services.store.client import now_ms
from services.store.context import open_redis
from services.store.sessions import SessionStore

pb, pb_grpc = load("asr")
common = load_common()  # AudioFormat, Word, StageTimes (specvox.common.v1)
Kind = pb.TranscriptEvent.Kind
END = object()
# Client messages waiting for the listener (~10 s of 40 ms chunks); past it the reader waits, through gRPC's flow
# control: a file sent unpaced had grown the stage by 260 MB in ten minutes of audio with no bound.
AUDIO_QUEUE_MESSAGES = 256
MIN_UTTERANCE_CAP_S = 2.0  # a stream's max_utterance_s: less would cut most sentences in pieces
MAX_VAD_GAIN_DB = 20.0  # the most a stream's vad_gain_db may be: ten times the amplitude


class WireAudioDecoder:
    """The stream's audio bytes, in their declared framing, as mono float32 at 16 kHz."""

    def __init__(self, fmt: common.AudioFormat) -> None:
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
        # The streams' VAD, apart from whisper: a voice onset (which pauses the avatar) is heard
        # at its check, not after the whisper pass of another stream in progress.
        self.listener = ModelWorker("asr-vad")
        self.cadence = SharedCadence()  # the partial passes of this thread's streams, shared out

    async def Transcribe(self, request_iterator, context: grpc.aio.ServicerContext) -> AsyncIterator:
        clock = StageClock("asr")
        async with status_on_error(context, "asr"):
            config = await _first_config(request_iterator)
            logs.bind(session_id=config.session_id)
            await self.sessions.require(config.session_id)
            events = self.recognize(config.format, config.language, _client_audio(request_iterator, clock),
                                    phrases=(config.prompt,),
                                    max_utterance_s=config.max_utterance_s, context_pause_ms=config.context_pause_ms,
                                    vad_threshold=config.vad_threshold, vad_gain_db=config.vad_gain_db)
            yield pb.TranscriptEvent(kind=Kind.READY, emitted_unix_ms=now_ms())
            async for event in events:
                yield _event(clock, event)

    def recognize(self, fmt: common.AudioFormat, language: str, audio: AsyncIterator[bytes | str],
                  phrases: Sequence[str] = (), max_utterance_s: float = 0.0,
                  context_pause_ms: int = 0, vad_threshold: float = 0.0,
                  vad_gain_db: float = 0.0) -> AsyncIterator[AsrEvent]:
        """One stream's recognition, what every surface of the asr service runs (Transcribe, Riva's
        StreamingRecognize and Recognize): `audio` yields the stream's bytes, and a str for new
        expected phrases (`prompt_of`, the recognizer's `expected`); `phrases`: the stream's vocabulary
        (every pass's prompt); the rest, what the stream asks of its
        `AsrOptions` (`_stream_options`). Checked here, before any audio is read (ValueError,
        AudioFormatError)."""
        decoder = WireAudioDecoder(fmt)
        checked = self.transcriber.check_language(language) if language else None
        options = self._stream_options(max_utterance_s, context_pause_ms, vad_threshold, vad_gain_db)
        recognizer = StreamingRecognizer(options, self.transcriber, checked, self.cadence)
        try:
            recognizer.vocabulary = prompt_of_phrases(phrases)
        except ValueError as e:
            raise ValueError(f"the stream's prompt (StreamConfig.prompt, or Riva's speech contexts): {e}") from None
        return self._recognize(recognizer, decoder, audio)

    def _stream_options(self, max_utterance_s: float, context_pause_ms: int, vad_threshold: float,
                        vad_gain_db: float) -> AsrOptions:
        """The service's options with what a stream asks for (StreamConfig; each 0: the service's):
        `max_utterance_s`, a cap under the service's; `context_pause_ms`; `vad_threshold`, 0 to 1, where
        speech begins, its silence staying the service's (`with_speech_threshold`) where that is lower;
        `vad_gain_db`, 0 to MAX_VAD_GAIN_DB, how much louder Silero hears the stream."""
        options = self.options
        if not math.isfinite(max_utterance_s) or max_utterance_s < 0:
            raise ValueError(f"max_utterance_s must be 0 (the service's) or a positive number of seconds, "
                             f"not {max_utterance_s}")
        if max_utterance_s and max_utterance_s < options.max_utterance_s:
            if max_utterance_s < MIN_UTTERANCE_CAP_S:
                raise ValueError(f"max_utterance_s must be at least {MIN_UTTERANCE_CAP_S:g} s, not {max_utterance_s:g}")
            options = dataclasses.replace(options, max_utterance_s=max_utterance_s)
        if context_pause_ms:
            options = dataclasses.replace(options, context_pause_ms=context_pause_ms)
        if not math.isfinite(vad_threshold) or not 0 <= vad_threshold < 1:
            raise ValueError(f"vad_threshold must be 0 (the service's) or a speech probability under 1, "
                             f"not {vad_threshold:g}")
        if not math.isfinite(vad_gain_db) or not 0 <= vad_gain_db <= MAX_VAD_GAIN_DB:
            raise ValueError(f"vad_gain_db must be 0 (the service's) to {MAX_VAD_GAIN_DB:g} dB, not {vad_gain_db:g}")
        return with_speech_threshold(with_vad_gain(options, vad_gain_db), vad_threshold)

    async def _recognize(self, recognizer: StreamingRecognizer, decoder: WireAudioDecoder,
                         audio: AsyncIterator[bytes | str]) -> AsyncIterator[AsrEvent]:
        chunks: asyncio.Queue = asyncio.Queue(maxsize=AUDIO_QUEUE_MESSAGES)
        reader = asyncio.create_task(_read_audio(audio, chunks))
        try:
            ended = False
            while not ended:
                samples, prompt, ended = await _take_all(chunks)
                if prompt is not None:
                    recognizer.expected = prompt
                for event in await self._hear(recognizer, decoder.feed(samples)):
                    yield event
            events = await self._hear(recognizer, decoder.finish())
            events += await self.worker.call(recognizer.finish)
            for event in events:
                yield event
        finally:
            reader.cancel()
            recognizer.close()

    async def _hear(self, recognizer: StreamingRecognizer, samples: np.ndarray) -> list[AsrEvent]:
        """The VAD's events on the listener thread, then the passes due (if any) on the model thread."""
        events = await self.listener.call(recognizer.listen, samples)
        if recognizer.transcription_due:
            return events + await self.worker.call(recognizer.transcribe)
        return events + recognizer.transcribe()


async def _client_audio(request_iterator, clock: StageClock) -> AsyncIterator[bytes | str]:
    """A Transcribe stream's audio, and its contexts' expected phrases as whisper's prompt."""
    async for request in request_iterator:
        kind = request.WhichOneof("payload")
        if kind == "context":
            yield prompt_of(request.context)
            continue
        if kind != "audio":
            raise ValueError("only audio or a context may follow the stream's config message")
        clock.received()
        yield request.audio


async def _read_audio(audio: AsyncIterator[bytes | str], chunks: asyncio.Queue) -> None:
    """The client's audio (and prompts) → queue, so that audio arriving during a transcription
    pass is taken in one go. The queue is bounded: a client sending faster than the stage hears
    (a file sent unpaced) waits, through gRPC's flow control, instead of filling memory."""
    try:
        async for item in audio:
            await chunks.put(item)
        await chunks.put(END)
    except Exception as e:  # noqa: BLE001 - raised again where the stream is answered
        await chunks.put(e)


def prompt_of(context: pb.Context) -> str:
    """The context's phrases as one prompt (`prompt_of_phrases`); a refusal names the field."""
    try:
        return prompt_of_phrases(context.expected_phrases)
    except ValueError as e:
        raise ValueError(f"context.expected_phrases: {e}") from None


async def _take_all(chunks: asyncio.Queue) -> tuple[bytes, str | None, bool]:
    """Everything queued (waiting for at least one item): the audio, the last expected phrases sent with it
    (None: unchanged), and True once the client's stream ended."""
    items = [await chunks.get()]
    while not chunks.empty():
        items.append(chunks.get_nowait())
    for item in items:
        if isinstance(item, Exception):
            raise item
    prompts = [i for i in items if isinstance(i, str)]
    audio = b"".join(i for i in items if isinstance(i, bytes))
    return audio, (prompts[-1] if prompts else None), END in items


def _event(clock: StageClock, event: AsrEvent) -> pb.TranscriptEvent:
    clock.emitted()
    if isinstance(event, VoiceStarted):  # speech_start_s: where the voice began in the stream's audio
        return pb.TranscriptEvent(kind=Kind.VOICE_STARTED, speech_start_s=event.speech_start_s,
                                  heard_s=event.heard_s, emitted_unix_ms=now_ms())
    if isinstance(event, VoiceEnded):
        return pb.TranscriptEvent(kind=Kind.VOICE_ENDED, heard_s=event.heard_s, emitted_unix_ms=now_ms())
    if isinstance(event, SpeechStarted):
        return pb.TranscriptEvent(kind=Kind.SPEECH_STARTED, speech_start_s=event.heard_s,
                                  utterance_index=event.utterance_index, heard_s=event.heard_s,
                                  emitted_unix_ms=now_ms())
    if isinstance(event, PartialTranscript):
        return pb.TranscriptEvent(
            kind=Kind.PARTIAL, text=event.text, words=_words((*event.committed, *event.tentative)),
            committed_text=join_words(event.committed), tentative_text=join_words(event.tentative),
            stability=event.stability, committed_words=len(event.committed), speech_ending=event.speech_ending,
            speech_start_s=event.speech_start_s, speech_end_s=event.speech_end_s,
            utterance_index=event.utterance_index, heard_s=event.heard_s, emitted_unix_ms=now_ms(),
        )
    utterance = event.utterance
    return pb.TranscriptEvent(
        kind=Kind.FINAL, text=event.text, words=_words(event.words), committed_text=event.text,
        stability=1.0, committed_words=len(event.words),
        speech_start_s=utterance.speech_start_s, speech_end_s=utterance.speech_end_s,
        utterance_index=utterance.index, emitted_unix_ms=now_ms(), times=clock.to_proto(common.StageTimes),
    )


def _words(words) -> list[common.Word]:
    return [common.Word(text=w.text, start_s=w.start_s, end_s=w.end_s, probability=w.probability) for w in words]


async def _first_config(request_iterator) -> pb.StreamConfig:
    async for request in request_iterator:
        if request.WhichOneof("payload") != "config":
            raise ValueError("the first message of a Transcribe stream must be its config")
        return request.config
    raise ValueError("the stream ended before its config message")


async def build(settings: Settings) -> Service:
    """The asr service for run_service: whisper and the VAD loaded and warmed before it serves."""
    redis = await open_redis(settings)
    servicer = AsrServicer(settings.asr, redis.sessions)
    servicer.transcriber.warm_up()

    def register(server: grpc.aio.Server) -> None:
        pb_grpc.add_AsrServicer_to_server(servicer, server)
        riva_asr.add_to_server(servicer, server)  # Riva's recognition calls, on the same recogniser

    return Service("asr", register, close=redis.close, more_names=[riva_asr.SERVICE_NAME])


if __name__ == "__main__":
    service_main(build)
