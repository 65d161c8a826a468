"""Speech recognition for a live turn: Silero VAD endpointing plus faster-whisper.

`UtteranceSegmenter` watches a growing 16 kHz stream: speech has started once
`speech_start_ms` of it is heard, and an utterance closes once `end_of_speech_silence_ms`
of silence follows it. `Transcriber` turns an utterance (closed, or still open for a
partial result) into text and word timings in the stream's timeline. `pipeline.asr_stream`
puts the two together into partial and final transcripts.
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
    speech_start_ms: int = 200  # speech heard for this long starts an utterance (shorter blips are ignored)
    end_of_speech_silence_ms: int = 400  # silence after speech for this long closes the utterance
    vad_check_every_ms: int = 100
    partial_every_ms: int = 200  # re-transcribe the open utterance after this much new audio
    agreement_n: int = 2  # LocalAgreement-n: hypotheses that must agree before a word is committed
    final_reuse_margin_ms: int = 200  # a partial pass that heard this much silence after the speech is the final
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
            min_speech_duration_ms=options.speech_start_ms,
            min_silence_duration_ms=options.end_of_speech_silence_ms,
            speech_pad_ms=0,
        )
        self._buffer = np.zeros(0, np.float32)
        self._buffer_start = 0  # sample index of _buffer[0] in the stream
        self._unchecked = 0
        self._index = 0
        self._open: list[dict] = []  # Silero spans of the utterance still open, in buffer samples
        self.speech_active = False

    @property
    def silence_after_s(self) -> float:
        """Silence heard since the open utterance's last speech (0 when none is open)."""
        return (self._buffer.size - self._open[-1]["end"]) / SAMPLE_RATE_HZ if self._open else 0.0

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

    def open_utterance(self) -> Utterance | None:
        """The utterance still being spoken, as heard so far (for partial results)."""
        if not self._open:
            return None
        start = self._open[0]["start"]
        lo = max(0, start - self.options.transcribe_pad_ms * SAMPLE_RATE_HZ // 1000)
        return Utterance(
            index=self._index,
            speech_start_s=(self._buffer_start + start) / SAMPLE_RATE_HZ,
            speech_end_s=(self._buffer_start + self._open[-1]["end"]) / SAMPLE_RATE_HZ,
            audio=self._buffer[lo:].copy(),
            audio_start_s=(self._buffer_start + lo) / SAMPLE_RATE_HZ,
        )

    def _scan(self, final: bool) -> list[Utterance]:
        """Close every utterance that silence (or the stream's end) has ended.

        Silero merges speech separated by less than `end_of_speech_silence_ms`, so
        each span but the last is a whole utterance already.
        """
        from faster_whisper.vad import get_speech_timestamps

        spans = get_speech_timestamps(self._buffer, self._vad)
        if not spans:
            self._open, self.speech_active = [], False
            self._forget_silence()
            return []
        needed = self.options.end_of_speech_silence_ms * SAMPLE_RATE_HZ // 1000
        longest = self.options.max_utterance_s * SAMPLE_RATE_HZ
        closed = []
        while spans:
            silence_after = self._buffer.size - spans[-1]["end"]
            too_long = spans[-1]["end"] - spans[0]["start"] >= longest
            if len(spans) > 1:
                first = spans.pop(0)
            elif final or silence_after >= needed or too_long:
                first = spans.pop(0)
            else:
                break
            closed.append(self._close(first["start"], first["end"]))
            spans = [{"start": s["start"] - first["end"], "end": s["end"] - first["end"]} for s in spans]
        self._open, self.speech_active = spans, bool(spans)
        return closed

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
