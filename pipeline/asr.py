"""Speech recognition for a live turn: Silero VAD endpointing plus faster-whisper.

`UtteranceSegmenter` watches a growing 16 kHz stream and closes an utterance once
`end_of_speech_silence_ms` of silence follows speech; `Transcriber` turns a closed
utterance into text and word timings in the stream's timeline.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from pipeline.models import not_found_offline, resolve_asr

SAMPLE_RATE_HZ = 16_000  # what Whisper and Silero VAD expect


@dataclass(frozen=True)
class AsrOptions:
    model: str = "bundled"
    device: str = "cpu"
    compute_type: str = "int8"
    cpu_threads: int = 0  # 0: CTranslate2's default
    language: str = "en"
    beam_size: int = 1
    vad_threshold: float = 0.5
    end_of_speech_silence_ms: int = 400
    min_speech_ms: int = 200
    vad_check_every_ms: int = 100
    transcribe_pad_ms: int = 300  # audio kept either side of the detected speech
    max_utterance_s: float = 25.0  # forced close: Whisper sees at most 30 s
    offline: bool = True  # a model named by hub id must already be in the local cache


@dataclass(frozen=True)
class Word:
    text: str
    start_s: float
    end_s: float
    probability: float


@dataclass(frozen=True)
class Utterance:
    """A closed stretch of speech; times in the stream's audio timeline."""

    index: int
    speech_start_s: float
    speech_end_s: float
    audio: np.ndarray = field(repr=False)  # mono float32 at 16 kHz, padded
    audio_start_s: float = 0.0  # where `audio` begins in the timeline


@dataclass(frozen=True)
class Transcript:
    text: str
    words: tuple[Word, ...]


class UtteranceSegmenter:
    """Streaming end-of-speech detection with the Silero VAD that faster-whisper ships."""

    def __init__(self, options: AsrOptions) -> None:
        from faster_whisper.vad import VadOptions

        self.options = options
        self._vad = VadOptions(
            threshold=options.vad_threshold,
            min_speech_duration_ms=options.min_speech_ms,
            min_silence_duration_ms=options.end_of_speech_silence_ms,
            speech_pad_ms=0,
        )
        self._buffer = np.zeros(0, np.float32)
        self._buffer_start = 0  # sample index of _buffer[0] in the stream
        self._unchecked = 0
        self._index = 0
        self.speech_active = False

    @property
    def stream_s(self) -> float:
        return (self._buffer_start + self._buffer.size) / SAMPLE_RATE_HZ

    def feed(self, samples: np.ndarray) -> list[Utterance]:
        self._buffer = np.concatenate([self._buffer, samples])
        self._unchecked += samples.size
        if self._unchecked < self.options.vad_check_every_ms * SAMPLE_RATE_HZ // 1000:
            return []
        self._unchecked = 0
        return self._scan(final=False)

    def finish(self) -> list[Utterance]:
        """The stream ended: whatever speech is open closes now."""
        return self._scan(final=True)

    def _scan(self, final: bool) -> list[Utterance]:
        from faster_whisper.vad import get_speech_timestamps

        spans = get_speech_timestamps(self._buffer, self._vad)
        if not spans:
            self.speech_active = False
            self._forget_silence()
            return []
        self.speech_active = True
        silence_after = self._buffer.size - spans[-1]["end"]
        needed = self.options.end_of_speech_silence_ms * SAMPLE_RATE_HZ // 1000
        too_long = spans[-1]["end"] - spans[0]["start"] >= self.options.max_utterance_s * SAMPLE_RATE_HZ
        if final or silence_after >= needed or too_long:
            return [self._close(spans[0]["start"], spans[-1]["end"])]
        return []

    def _close(self, start: int, end: int) -> Utterance:
        pad = self.options.transcribe_pad_ms * SAMPLE_RATE_HZ // 1000
        lo, hi = max(0, start - pad), min(self._buffer.size, end + pad)
        utterance = Utterance(
            index=self._index,
            speech_start_s=(self._buffer_start + start) / SAMPLE_RATE_HZ,
            speech_end_s=(self._buffer_start + end) / SAMPLE_RATE_HZ,
            audio=self._buffer[lo:hi].copy(),
            audio_start_s=(self._buffer_start + lo) / SAMPLE_RATE_HZ,
        )
        self._index += 1
        self.speech_active = False
        self._buffer_start += end
        self._buffer = self._buffer[end:]
        return utterance

    def _forget_silence(self) -> None:
        """Keep only the last second of a silent buffer, so memory stays bounded."""
        keep = SAMPLE_RATE_HZ
        if self._buffer.size > 2 * keep:
            drop = self._buffer.size - keep
            self._buffer_start += drop
            self._buffer = self._buffer[drop:]


class Transcriber:
    """faster-whisper on a closed utterance; blocking, so services run it in a thread."""

    def __init__(self, options: AsrOptions) -> None:
        from faster_whisper import WhisperModel

        self.options = options
        try:
            self.model = WhisperModel(
                resolve_asr(options.model),
                device=options.device,
                compute_type=options.compute_type,
                cpu_threads=options.cpu_threads,
                local_files_only=options.offline,
            )
        except (OSError, ValueError) as e:
            if options.offline:
                raise not_found_offline("asr", options.model, e) from e
            raise

    def warm_up(self) -> None:
        """One pass on a second of faint noise, so the first user turn does not pay for it."""
        noise = np.random.default_rng(0).normal(0, 1e-3, SAMPLE_RATE_HZ).astype(np.float32)
        self.transcribe(Utterance(0, 0.0, 1.0, noise))

    def transcribe(self, utterance: Utterance) -> Transcript:
        segments, _ = self.model.transcribe(
            utterance.audio,
            language=self.options.language or None,
            beam_size=self.options.beam_size,
            word_timestamps=True,
            condition_on_previous_text=False,
            vad_filter=False,
        )
        words = tuple(_shift_words(segments, utterance.audio_start_s))
        text = "".join(w.text for w in words).strip()
        return Transcript(text=text, words=words)


def _shift_words(segments: Iterator, offset_s: float) -> Iterator[Word]:
    for segment in segments:
        for w in segment.words or ():
            yield Word(
                text=w.word,
                start_s=round(offset_s + w.start, 3),
                end_s=round(offset_s + w.end, 3),
                probability=float(w.probability),
            )
