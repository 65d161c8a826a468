"""A media file to timed captions in one process: decode, find the utterances, transcribe, clean, cue.

The steps are the live caption path's, run over a file as fast as the CPU allows:

1. `pipeline.media.MediaAudio` decodes the file's audio in chunks (16 kHz mono);
2. `pipeline.asr.UtteranceSegmenter`, the asr stage's own Silero VAD, cuts it into utterances;
3. whisper transcribes them, several a pass (`pipeline.asr_batch.BatchTranscriber`), keeping the
   words the live finals keep (`pipeline.asr_words.utterance_words`: none of whisper's additions to
   the silence after speech, its loops, or words for a sound that is no word);
4. a caption cleaner turns each transcript into a caption (`clean_transcripts`, the one call);
5. `pipeline.captions.align_caption` times each caption word from the ASR words;
6. `caption_cues` cuts the timed words into broadcast-style cues (`pipeline.caption_style.broadcast_cues`:
   lines, reading speed, durations), a new cue at each utterance.

Decoding and the VAD run on a thread of their own, a bounded queue ahead of whisper, so on two
cores the cheap steps overlap the expensive one and at most `QUEUED_CHUNKS` chunks of audio
wait; only closed utterances' audio is kept, and only until their batch is transcribed, so an
hour of audio takes the memory of a few minutes.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Protocol

from pipeline.asr import (
    AsrOptions,
    Transcriber,
    Utterance,
    UtteranceSegmenter,
    Word,
    join_words,
    with_speech_threshold,
    with_vad_gain,
)
from pipeline.asr_batch import BatchTranscriber
from pipeline.asr_words import utterance_words
from pipeline.caption_style import CueStyle, broadcast_cues
from pipeline.captions import Cue, align_caption, json_document, srt_document, webvtt_document
from pipeline.media import CHUNK_S, DEFAULT_MAX_DURATION_S, MediaAudio, MediaInfo

FORMATS = ("vtt", "srt", "json")
QUEUED_CHUNKS = 4  # decoded chunks (their utterances) waiting for whisper at most
# Utterances a whisper pass: 4 took 1.13 s of CPU for a minute of speech against 1.91 s for 1 on this
# 2-core CPU, 2 and 8 more than 4 (a batch is padded to its longest utterance); docs/captions.md.
BATCH_UTTERANCES = 4
# Whisper's threads for a file: one per core, at most this many. On this 2-core CPU, 221 s of real and bundled
# speech took 4.9-5.9 s with two threads against 6.7-7.4 s with one (identity cleaner), and 8.1-9.3 s against
# 10.8-11.9 s beside the LLM's cleaning (docs/captions.md); the live asr keeps its one thread (asr.cpu_threads),
# leaving the other core to the llm and tts.
MAX_WHISPER_THREADS = 4


@dataclass(frozen=True)
class FileCaptionOptions:
    batch_utterances: int = BATCH_UTTERANCES
    max_duration_s: float = DEFAULT_MAX_DURATION_S  # longer files are refused (MediaTooLong)
    # Silence that closes an utterance: the live asr's 150 ms gets its final out fast, and splits a
    # sentence at a comma's pause ("Good morning." / "and welcome to ..."); a file waits for no one.
    # On 10 minutes of sentences 0.4-1.2 s apart, 300 and 500 ms found each sentence whole, 800
    # joined some (longer passes, slower) and 150 split 25 of 177 (docs/captions.md).
    end_of_speech_silence_ms: int = 500
    # Where speech begins, Silero's probability (0: the asr's, 0.5), as on a live caption stream
    # (settings caption_vad_threshold): a caption is a record, and at 0.5 Silero missed quiet speech
    # whole. `specvox bench captions`' clips as files, transcript WER as is / 0.1 s less / 0.2 s more
    # silence before / 2 dB quieter, nine human recordings: 0.5: 0.164 / 0.158 / 0.175 / 0.212; 0.3: 0.151
    # / 0.156 / 0.173 / 0.163; the bundled voices' script: 0.5: 0.159 / 0.195 / 0.207 / 0.171; 0.3: 0.220
    # / 0.183 / 0.244 / 0.207 (a filler heard with its sentence, "Uh, for work." as "forward."); all,
    # mean of the four: 0.178 at 0.5, 0.167 at 0.3 (docs/captions.md).
    vad_threshold: float = 0.3
    # How much louder Silero hears the file than it is (asr.vad_gain_db), as a live caption stream hears it
    # (settings caption_vad_gain_db); 0: the asr's. The same clips as files, four versions each, transcript errors: the
    # human recordings 375 at 0 dB, 363 at 6 (of 2336 words; the speaker with a cold 77 -> 66), the bundled
    # voices' 156 at both (docs/captions.md).
    vad_gain_db: float = 6.0
    style: CueStyle = CueStyle()  # the cues' rules (pipeline/caption_style.py; CueStyle.children() for 13 chars/s)
    chunk_s: float = CHUNK_S  # audio decoded at a time
    whisper_threads: int = 0  # 0: one per core, at most MAX_WHISPER_THREADS


def whisper_threads(options: FileCaptionOptions) -> int:
    return options.whisper_threads or min(MAX_WHISPER_THREADS, os.cpu_count() or 1)


class CleanedText(Protocol):
    @property
    def text(self) -> str: ...


class CaptionCleaning(Protocol):
    """What turns transcripts into captions: `pipeline.llm.caption_cleaner.CaptionCleaner`, or the identity."""

    def clean_many(self, transcripts: Sequence[str]) -> Sequence[CleanedText]: ...


@dataclass(frozen=True)
class _Caption:
    text: str


class TranscriptAsCaption:
    """The identity cleaner: each caption is its transcript's own text, word for word."""

    def clean_many(self, transcripts: Sequence[str]) -> list[_Caption]:
        return [_Caption(t) for t in transcripts]


def clean_transcripts(cleaner: CaptionCleaning, transcripts: Sequence[str]) -> list[str]:
    """The one place a file's transcripts become captions (several per call: the cleaner batches them)."""
    return [c.text for c in cleaner.clean_many(transcripts)] if transcripts else []


def caption_cues(utterances: Sequence[Sequence[Cue]], style: CueStyle = CueStyle()) -> list[Cue]:
    """The document's cues from each utterance's timed caption words, a new cue at each utterance (the
    one place a file's cues are cut)."""
    return broadcast_cues(utterances, style)


@dataclass(frozen=True)
class CaptionedUtterance:
    index: int
    speech_start_s: float
    speech_end_s: float
    transcript: str
    words: tuple[Word, ...]  # the ASR's, on the file's timeline
    caption: str
    caption_words: tuple[Cue, ...]  # the caption's words, timed by align_caption


@dataclass
class Timings:
    """Where the time went, in seconds of wall clock (decoding and the VAD run beside the rest)."""

    decode_s: float = 0.0
    vad_s: float = 0.0
    asr_s: float = 0.0
    clean_s: float = 0.0
    cues_s: float = 0.0
    total_s: float = 0.0
    cpu_s: float = 0.0  # this process's CPU time (all threads) while captioning: the work, whatever the load


@dataclass
class FileCaptions:
    media: MediaInfo
    duration_s: float  # of audio decoded
    utterances: list[CaptionedUtterance]
    cues: list[Cue]
    timings: Timings = field(default_factory=Timings)

    def document(self, fmt: str) -> str:
        """WebVTT ("vtt"), SRT ("srt") or JSON ("json": the cues, and each utterance's transcript,
        caption and words with their times). No speech: a valid document with no cues."""
        if fmt == "vtt":
            return webvtt_document(self.cues)
        if fmt == "srt":
            return srt_document(self.cues)
        if fmt == "json":
            return json.dumps(self.as_json(), indent=1, ensure_ascii=False) + "\n"
        raise ValueError(f"unknown caption format {fmt!r}: one of {', '.join(FORMATS)}")

    def as_json(self) -> dict:
        """The source; the cues as `pipeline.captions.json_document` writes them (their lines and words);
        each utterance's transcript, caption, caption words and ASR words, times in seconds."""
        return {
            "source": {"path": self.media.path, "container": self.media.container, "codec": self.media.codec,
                       "duration_s": round(self.duration_s, 3)},
            "cues": json.loads(json_document(self.cues))["cues"],
            "utterances": [{
                "index": u.index, "speech_start": round(u.speech_start_s, 3), "speech_end": round(u.speech_end_s, 3),
                "transcript": u.transcript, "caption": u.caption,
                "words": [{"text": c.text, "start": c.start_s, "end": c.end_s} for c in u.caption_words],
                "asr_words": [{"text": w.text.strip(), "start": w.start_s, "end": w.end_s,
                               "probability": round(w.probability, 3)} for w in u.words],
            } for u in self.utterances],
        }


@dataclass
class _Heard:
    """What the VAD closed in one decoded chunk, and how far into the file the chunk reaches."""

    utterances: list[Utterance]
    heard_s: float


@dataclass
class _Cleaning:
    """A batch whose transcripts are being cleaned on the cleaning thread."""

    heard: list[tuple[Utterance, tuple[Word, ...]]]
    transcripts: list[str]
    captions: Future


class FileCaptioner:
    """Captions files with one whisper model (loaded once) and one cleaner; blocking."""

    def __init__(self, asr: AsrOptions, options: FileCaptionOptions = FileCaptionOptions(),
                 cleaner: CaptionCleaning | None = None, transcriber: Transcriber | None = None) -> None:
        heard = with_vad_gain(with_speech_threshold(asr, options.vad_threshold), options.vad_gain_db)
        self.asr = replace(heard, cpu_threads=whisper_threads(options),
                           end_of_speech_silence_ms=options.end_of_speech_silence_ms)
        self.options = options
        self.cleaner = cleaner or TranscriptAsCaption()
        self.transcriber = transcriber or Transcriber(self.asr)
        self.batch = BatchTranscriber(self.transcriber)

    def caption(self, media: MediaAudio, on_progress: Callable[[float], None] | None = None) -> FileCaptions:
        """The file's captions. `on_progress(seconds)`: how far into the file the captions are done,
        after each batch. Raises the file's MediaError (corrupt, too long) as decoding finds it."""
        started, cpu_started = time.perf_counter(), time.process_time()
        timings = Timings()
        heard: queue.Queue[_Heard | BaseException | None] = queue.Queue(QUEUED_CHUNKS)
        stop = threading.Event()
        producer = threading.Thread(target=self._listen, args=(media, heard, stop, timings), name="file-vad",
                                    daemon=True)
        producer.start()
        utterances: list[CaptionedUtterance] = []
        word_cues: list[list[Cue]] = []
        waiting: list[Utterance] = []
        duration_s = 0.0
        # A batch's cleaning runs on a thread of its own while whisper hears the next batch (both release the
        # GIL): on 2 cores the LLM's passes and whisper's overlap instead of taking turns.
        cleaning = ThreadPoolExecutor(1, thread_name_prefix="file-clean")
        pending: deque[_Cleaning] = deque()
        try:
            for item in _until_done(heard):
                waiting += item.utterances
                duration_s = item.heard_s
                while len(waiting) >= self.options.batch_utterances:
                    batch, waiting = waiting[: self.options.batch_utterances], waiting[self.options.batch_utterances:]
                    pending.append(self._transcribe_batch(batch, cleaning, timings))
                    while len(pending) > 1:
                        self._finish_batch(pending.popleft(), utterances, word_cues, timings)
                if on_progress is not None:  # done: the audio before the first utterance still waiting
                    on_progress(waiting[0].audio_start_s if waiting else duration_s)
            if waiting:
                pending.append(self._transcribe_batch(waiting, cleaning, timings))
            while pending:
                self._finish_batch(pending.popleft(), utterances, word_cues, timings)
        finally:
            stop.set()
            _drain(heard)
            producer.join()
            cleaning.shutdown(cancel_futures=True)
        if on_progress is not None:
            on_progress(duration_s)
        t = time.perf_counter()
        cues = caption_cues(word_cues, self.options.style)
        timings.cues_s += time.perf_counter() - t
        timings.total_s = time.perf_counter() - started
        timings.cpu_s = time.process_time() - cpu_started
        return FileCaptions(media.info, duration_s, utterances, cues, timings)

    def _listen(self, media: MediaAudio, heard: queue.Queue, stop: threading.Event, timings: Timings) -> None:
        """Decode and VAD (the producer thread): each chunk's closed utterances into `heard`, then None;
        an exception instead, if one ends it."""
        try:
            segmenter = UtteranceSegmenter(self.asr)
            chunks = media.chunks(self.options.chunk_s)
            while True:
                t = time.perf_counter()
                chunk = next(chunks, None)
                timings.decode_s += time.perf_counter() - t
                if chunk is None or stop.is_set():
                    break
                t = time.perf_counter()
                closed = segmenter.feed(chunk)
                timings.vad_s += time.perf_counter() - t
                _put(heard, _Heard(closed, segmenter.stream_s), stop)
            _put(heard, _Heard(segmenter.finish(), segmenter.stream_s), stop)
            _put(heard, None, stop)
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            _put(heard, e, stop)

    def _transcribe_batch(self, batch: list[Utterance], cleaning: ThreadPoolExecutor, timings: Timings) -> _Cleaning:
        """Whisper's words for a batch of utterances, their cleaning started on the cleaning thread."""
        t = time.perf_counter()
        words = [utterance_words(tr, u, self.asr) for tr, u in zip(self.batch.transcribe(batch), batch, strict=True)]
        heard = [(u, w) for u, w in zip(batch, words, strict=True) if w]
        timings.asr_s += time.perf_counter() - t
        transcripts = [join_words(ws) for _, ws in heard]

        def clean() -> list[str]:
            started = time.perf_counter()
            captions = clean_transcripts(self.cleaner, transcripts)
            timings.clean_s += time.perf_counter() - started
            return captions

        return _Cleaning(heard, transcripts, cleaning.submit(clean))

    def _finish_batch(self, batch: _Cleaning, out: list[CaptionedUtterance], word_cues: list[list[Cue]],
                      timings: Timings) -> None:
        """A batch's captions (waited for), timed from the ASR's words."""
        captions = batch.captions.result()
        heard, transcripts = batch.heard, batch.transcripts
        t = time.perf_counter()
        for (u, ws), transcript, caption in zip(heard, transcripts, captions, strict=True):
            timed = align_caption(caption, ws)
            out.append(CaptionedUtterance(u.index, u.speech_start_s, u.speech_end_s, transcript, ws, caption,
                                          tuple(timed)))
            if timed:  # a caption the cleaner left empty has no cue
                word_cues.append(timed)
        timings.cues_s += time.perf_counter() - t


def caption_file(path: str, asr: AsrOptions = AsrOptions(), options: FileCaptionOptions = FileCaptionOptions(),
                 cleaner: CaptionCleaning | None = None,
                 on_progress: Callable[[float], None] | None = None) -> FileCaptions:
    """`path`'s captions (loads the whisper model: to caption several files, keep a `FileCaptioner`)."""
    with MediaAudio(path, options.max_duration_s) as media:
        return FileCaptioner(asr, options, cleaner).caption(media, on_progress)


def _put(q: queue.Queue, item: object, stop: threading.Event) -> None:
    """Into the bounded queue, unless the consumer has stopped taking."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return
        except queue.Full:
            continue


def _until_done(q: queue.Queue) -> Iterator[_Heard]:
    while (item := q.get()) is not None:
        if isinstance(item, BaseException):
            raise item
        yield item


def _drain(q: queue.Queue) -> None:
    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            return
