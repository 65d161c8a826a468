"""Speech recognition for a live turn: Silero VAD endpointing plus faster-whisper.

`UtteranceSegmenter` watches a growing 16 kHz stream: speech has started once
`speech_start_ms` of it is heard, and an utterance closes once `end_of_speech_silence_ms`
of silence follows it. Sooner, once `voice_start_ms` of voice is heard, it reports the voice
(`VoiceStarted`: maybe speech, maybe a cough or a noise), and if that voice stops before it
becomes an utterance, its end (`VoiceEnded`), so that a live avatar can pause at once when
the user may be speaking over it and resume when it was noise. `Transcriber` turns an
utterance (closed, or still open for a partial result) into text and word timings in the
stream's timeline. `pipeline.asr_stream` puts the two together into partial and final
transcripts.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from pipeline.models import not_found_offline, resolve_asr

if TYPE_CHECKING:
    from faster_whisper.tokenizer import Tokenizer

SAMPLE_RATE_HZ = 16_000  # what Whisper and Silero VAD expect
VAD_FRAME_MS = 32  # Silero's window: 512 samples at 16 kHz
VAD_WINDOW = 512
VAD_CONTEXT = 64  # samples of the previous window the Silero model sees with each window
# A long utterance (asr.max_utterance_s) is cut at the first VAD window under the speech threshold in its last
# LONG_UTTERANCE_SEARCH_S before the cap, or at its quietest point there at the cap (_long_utterance_cut).
LONG_UTTERANCE_SEARCH_S = 2
MAX_TOKENS_PER_S = 10  # fast speech is ~4 words/s; more tokens than this is a repetition loop
# Whisper fed a cut-off utterance sometimes loops ("tell me about the tell me about the"); no
# 5-token sequence may repeat within one pass (speech rarely repeats 4 words in an utterance).
NO_REPEAT_NGRAM_TOKENS = 5
# faster-whisper's default silence check: a pass whose no-speech probability is above this
# and whose mean token log probability is below NO_SPEECH_LOGPROB heard no speech.
NO_SPEECH_PROBABILITY, NO_SPEECH_LOGPROB = 0.6, -1.0
ENCODER_SILENCE_S = 1  # digital silence after the audio in the encoder's input, so whisper hears it end
MAX_PROMPT_CHARS = 400  # a prompt's phrases in all: ~100 tokens, well inside whisper's 223


def prompt_of_phrases(phrases: Sequence[str]) -> str:
    """The phrases as one prompt ("Mm-hmm. Yeah."); ValueError past MAX_PROMPT_CHARS (Whisper's
    prompt holds at most 223 tokens, and it is decoded again on every pass)."""
    phrases = [p.strip() for p in phrases if p.strip()]
    prompt = " ".join(p if p[-1] in ".?!," else f"{p}." for p in phrases)
    if len(prompt) > MAX_PROMPT_CHARS:
        raise ValueError(f"the prompt's phrases have {len(prompt)} characters in all, at most {MAX_PROMPT_CHARS}")
    return prompt


@dataclass(frozen=True)
class AsrOptions:
    model: str = "bundled"
    device: str = "cpu"
    compute_type: str = "int8"
    # CTranslate2's threads (0: its default, one per core). One: a pass (~40 ms) is far inside the
    # 200 ms cadence and the final's pass runs during the silence, and on 2 cores shared with the
    # llm and tts a second thread made passes slower by the wall clock (docs/benchmarks/history.md).
    cpu_threads: int = 1
    language: str = "en"  # a stream's StreamConfig.language overrides it; "": the model detects it
    beam_size: int = 1
    # True: decode text tokens only (<|notimestamps|>), two tokens a segment fewer. Whisper then
    # often says a short utterance again and again into the silence after it ("Stop... Stop...
    # Stop...", "Hello Hello Hello Hello Hello": 80 words more than said on 48 synthesized clips,
    # 14 with timestamps, which mark where the speech ends; WER 0.17 -> 0.14); word timings come
    # from the cross-attention alignment either way.
    without_timestamps: bool = False
    vad_threshold: float = 0.5
    # A window under this speech probability is silence, and end_of_speech_silence_ms of them close the
    # utterance. 0: vad_threshold - 0.15, Silero's own hysteresis (`silence_threshold`).
    vad_silence_threshold: float = 0.0
    # Silero hears the stream this much louder (dB; 0: as it is). Its probabilities fall steeply with the
    # level on some voices: on a speaker with a cold (`specvox bench asr-finals`' mfa-cold-corpus) 0.5 as
    # recorded, 0.2 at 2 dB quieter, 0.9 at 2 dB louder, and whole sentences went unheard. Caption streams
    # ask for more (settings caption_vad_gain_db); whisper hears the audio as it is.
    vad_gain_db: float = 0.0
    speech_start_ms: int = 200  # speech heard for this long starts an utterance (shorter blips are ignored)
    # Voice heard for this long (the first to the last window at or above vad_threshold) is reported
    # at once as VOICE_STARTED, before it is known to be speech: the gateway pauses a speaking avatar
    # on it. 64: two Silero windows (a single 32 ms window above the threshold is often a click).
    voice_start_ms: int = 64
    # Silence after speech for this long closes the utterance. 150 ms is brisk (Pipecat's VAD
    # waits 0.8 s, LiveKit 0.5 s) and is what puts the final within 300 ms of the end of
    # speech; a pause inside a sentence may close an utterance early, and the gateway then
    # carries its words into the next turn when the user speaks on before hearing the reply
    # (docs/benchmarks/history.md counts the splits).
    end_of_speech_silence_ms: int = 150
    # The VAD looks at new audio this often (each 32 ms window is computed once, so checks are
    # cheap): at the first chunk that crosses each multiple of it in the stream, so a client sending
    # 20 ms chunks gets each window looked at as soon as it is whole (its end of speech, its voice).
    vad_check_every_ms: int = 32
    partial_every_ms: int = 200  # re-transcribe the open utterance after this much new audio
    agreement_n: int = 2  # LocalAgreement-n: hypotheses that must agree before a word is committed
    # An utterance's audio runs this far past its speech, and the partial pass that has heard this
    # much silence after the speech hears the utterance's audio whole: it runs while the rest of
    # end_of_speech_silence_ms is awaited, and the final reuses it (the same audio, so the same
    # words). 64: two Silero windows, as soon as the VAD can tell that the speech has stopped.
    final_reuse_margin_ms: int = 64
    # Once the speech has ended, trailing words whisper is less sure of than this are dropped
    # (its additions to the silence after an utterance; see asr_stream.spoken_words). 0: off.
    # 0.5 also dropped real last words whisper tiny is unsure of ("Why do cats [purr]?", "What
    # is the capital of [France]?": 9 of 32 finals of 8 questions in 4 voices, 2 at 0.3, with no
    # added word kept at either), and a truncated final reads as unfinished to the end-of-turn score.
    tail_min_probability: float = 0.3
    # ... unless it began at least this long before the VAD's end of speech: whisper's additions
    # lie at the end of the speech or just before it, a real unsure last word well inside it.
    tail_keep_inside_ms: int = 150
    transcribe_pad_ms: int = 300  # audio kept before the detected speech (after it: final_reuse_margin_ms)
    # Whisper's own silence check (faster-whisper's defaults): a pass whose no-speech probability
    # is above no_speech_probability and whose mean token log probability is at most
    # no_speech_logprob heard no speech.
    no_speech_probability: float = NO_SPEECH_PROBABILITY
    no_speech_logprob: float = NO_SPEECH_LOGPROB
    # An utterance voiced for less than this (the VAD's speech, start to end) is judged as a whole
    # (pipeline/asr_words.heard_as_words): a hum whisper spells ("Mm-hmm", "MMMM") in any of its
    # words, or a pass whose no-speech probability is at least short_no_speech_probability with a
    # mean log probability below short_avg_logprob, is a sound that is no word, and its final has
    # no words. Whisper tiny.en wrote words in 79 of 82 passes over hums said by Piper and espeak-ng
    # ("and anthem", "Then...", "them"; with and without the gateway's backchannel prompt), 23 with
    # these checks (10 of them "uh-huh" and "um", which the turn-taking takes as backchannels);
    # 176 passes over short real words kept theirs, and 56 of 57 utterances of human speech ("for
    # this." went). Its guesses at a hum and a real unsure word ("Hello?" at no-speech 0.49, log
    # probability -1.04) overlap: docs/benchmarks/README.md, "Streamed finals". 0: off.
    short_utterance_ms: int = 1000
    short_no_speech_probability: float = 0.25
    short_avg_logprob: float = -1.1
    # A pass that ends in `loop_min_copies` or more copies of the same words in a row is whisper
    # in a loop ("and anthem. and anthem. and and anthem."): one copy is kept. 0: off.
    loop_min_copies: int = 3
    # Speech with no pause of end_of_speech_silence_ms is cut by this long, between words
    # (_long_utterance_cut; Whisper sees at most 30 s). A stream may ask for less (StreamConfig.max_utterance_s): live
    # captions are cleaned only once an utterance closes, so the gateway asks for captions.max_utterance_s.
    max_utterance_s: float = 25.0
    # Speech cut at max_utterance_s closes once this much audio after the cut is heard, and its pass
    # hears it: the words it keeps begin before the cut, but whisper hears a word the cut runs through
    # whole ("Tex." | "as, originally" for "Texas, originally" where the pass stopped at the cut). No
    # partial pass runs meanwhile (`UtteranceSegmenter.cut_pending`). On the human recordings of `specvox
    # bench asr-finals`, four versions, as caption streams hear them: 376 errors of 2336 words at 200 ms,
    # 378 at 150, 373 at 300, 377 at 600 (398 at 0, an earlier run); a cut's final came 556 / 764 ms after
    # the cut (p50 / p95, CPU clock) at 200 against 1027 / 1228 at 600 with partial passes while it waited.
    cut_lookahead_ms: int = 200
    # Encode only the audio and a second of silence after it instead of Whisper's whole 30 s
    # window: the encoder's cost falls with it (see encoder_samples). False: the 30 s window.
    trim_encoder_input: bool = True
    encoder_min_s: float = 4.0  # trim_encoder_input: the least audio (s) the encoder is given
    # An utterance whose speech begins less than this after the last one's ended is heard after
    # it: its final's pass hears the stream's audio of the utterances just before it (as far back
    # as `context_s`) and continues their final words, forced as whisper's prefix, as whisper's own
    # long-form transcription goes on from the words before. Alone, whisper hears each piece of a
    # sentence cut at a pause without the rest ("how do volcanoes form?" after "I have a question,"
    # as "Happy volcano's form."; a quiet "acoustic corpus" after "different than the" as no
    # speech). Whisper is told a segment of its text begins at an utterance voiced for
    # `short_utterance_ms` or more (`SpeechBefore.new_segment`). A pass that stops short of its
    # utterance's speech or strays before its audio is redone alone (`asr_stream.went_on`: whisper
    # had stopped at "The river", and the next final wrote the rest timed in the speech before its
    # own). 0, the default: every final's pass hears its utterance alone. Going on cut streamed
    # WER 0.191 -> 0.169 on `specvox bench asr-finals`, but its finals after speech came 42 ms
    # later at p50 and ~200 ms at p95 (a pass that did not go on is done again alone) and the
    # stream's CPU rose ~30%: a conversation waits on its final, so it is a caption stream's
    # (caption_context_pause_ms, StreamConfig.context_pause_ms), whose live delays it did not
    # change (docs/benchmarks/README.md, "Streamed finals").
    context_pause_ms: int = 0
    context_s: float = 8.0  # the most audio before an utterance its final's pass hears
    # The least audio (s) the encoder is given on a pass with audio before its utterance. With
    # every pass in an 8 s window whisper went on from the words before worse (0.205); 10, 12 and
    # 15 s windows on these passes alone did alike (0.157-0.162), and 10 s costs the least.
    context_encoder_min_s: float = 10.0
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
class SpeechBefore:
    """What a stream said just before an utterance: its audio, from `audio_start_s` to where the
    utterance's audio begins, and the words of its finals (`AsrOptions.context_pause_ms`)."""

    audio: np.ndarray = field(repr=False)
    audio_start_s: float
    words: tuple[Word, ...]
    # The pass is told that a segment of whisper's text begins where the utterance's audio does
    # (`Transcriber._new_segment`); without it, whisper may end its pass with the words before.
    new_segment: bool = False

    @property
    def text(self) -> str:
        return join_words(self.words)


@dataclass(frozen=True)
class Transcript:
    """One pass's words, with whisper's own measures of the pass as a whole (Radford et al. 2022,
    sec. 4.5: the signals its long-form transcription uses to reject a window's text)."""

    text: str
    words: tuple[Word, ...]
    no_speech_prob: float = 0.0  # the <|nospeech|> token's probability at the start of the text
    avg_logprob: float = 0.0  # the mean log probability of the tokens decoded
    compression_ratio: float = 0.0  # the text's length / its gzip-compressed length: high for a loop


@dataclass(frozen=True)
class VoiceStarted:
    """The VAD has heard `voice_start_ms` of voice: maybe speech, maybe a cough or a noise."""

    speech_start_s: float  # where the voice began, in the stream's timeline
    heard_s: float  # how much of the stream had been heard when it was detected


@dataclass(frozen=True)
class VoiceEnded:
    """The voice of the last `VoiceStarted` stopped (`end_of_speech_silence_ms` of silence) before
    it became an utterance: no SpeechStarted for it, no transcript."""

    heard_s: float  # how much of the stream had been heard when its end was detected


VoiceEvent = VoiceStarted | VoiceEnded


class SileroProbabilities:
    """Silero speech probabilities of a growing stream, each 32 ms window computed once.

    faster-whisper's `get_speech_timestamps` runs the model over the whole audio it is given;
    called every 100 ms on a growing buffer that costs O(buffer) per check (~20 ms for 3 s on
    this CPU). The model is causal: each window sees 64 samples of the one before and the
    LSTM state it left, so carrying both on gives the very same probabilities (checked in
    tests/e2e/test_asr.py) for the new windows' cost only.

    `gain_db`: the model hears the audio this much louder (`AsrOptions.vad_gain_db`).
    """

    def __init__(self, gain_db: float = 0.0) -> None:
        from faster_whisper.vad import get_vad_model

        self._model = get_vad_model()
        self._gain = np.float32(10 ** (gain_db / 20))
        self._state = (np.zeros((1, 1, 128), np.float32), np.zeros((1, 1, 128), np.float32))
        self._context = np.zeros(VAD_CONTEXT, np.float32)
        self.probs = np.zeros(0, np.float32)  # one per whole window of the audio seen

    def extend(self, audio: np.ndarray) -> np.ndarray:
        """`audio`: the stream so far (from the first window not yet dropped); returns all probabilities."""
        new = audio[self.probs.size * VAD_WINDOW : audio.size // VAD_WINDOW * VAD_WINDOW].reshape(-1, VAD_WINDOW)
        if new.size:
            new = new * self._gain
            contexts = np.concatenate([self._context[None], new[:-1, -VAD_CONTEXT:]])
            out, h, c = self._model.session.run(None, {"input": np.concatenate([contexts, new], axis=1),
                                                       "h": self._state[0], "c": self._state[1]})
            self._state, self._context = (h, c), new[-1, -VAD_CONTEXT:].copy()
            self.probs = np.concatenate([self.probs, np.asarray(out, np.float32).reshape(-1)])
        return self.probs

    def drop(self, windows: int) -> None:
        """The stream's first `windows` windows are no longer needed."""
        self.probs = self.probs[windows:]


def silence_threshold(options: AsrOptions) -> float:
    """The speech probability under which a window is silence (`AsrOptions.vad_silence_threshold`)."""
    return options.vad_silence_threshold or max(options.vad_threshold - 0.15, 0.01)


def voiced_briefly(utterance: Utterance, options: AsrOptions) -> bool:
    """Whether the utterance's speech lasts less than `short_utterance_ms` (in whole milliseconds):
    maybe a hum, a filler or a cough. Such an utterance is judged as a whole
    (`asr_words.heard_as_words`), may get no word (`asr_stream.went_on`), and a pass going on from
    the speech before it is not told where it begins (`SpeechBefore.new_segment`)."""
    return round((utterance.speech_end_s - utterance.speech_start_s) * 1000) < options.short_utterance_ms


def with_speech_threshold(options: AsrOptions, vad_threshold: float) -> AsrOptions:
    """`options` with speech beginning where Silero's probability reaches `vad_threshold` (a caption's
    streams and files ask for a lower one: quiet speech is still speech) and ending where it ended, or
    under the new threshold where that is lower; 0: `options` as they are."""
    if not vad_threshold:
        return options
    return replace(options, vad_threshold=vad_threshold,
                   vad_silence_threshold=min(silence_threshold(options), vad_threshold))


def with_vad_gain(options: AsrOptions, vad_gain_db: float) -> AsrOptions:
    """`options` with Silero hearing the audio `vad_gain_db` louder (a caption's streams and files ask for
    it: `AsrOptions.vad_gain_db`); 0: `options` as they are."""
    return replace(options, vad_gain_db=vad_gain_db) if vad_gain_db else options


def speech_spans(probs: np.ndarray, audio_samples: int, threshold: float, min_speech_ms: int,
                 min_silence_ms: int, negative: float) -> list[dict]:
    """Speech spans (sample offsets) from window probabilities, as faster-whisper's
    `get_speech_timestamps` finds them (no padding, no length cap): speech starts at a window
    at or above `threshold`, and ends where `min_silence_ms` below `negative` begin (faster-whisper's
    is `threshold - 0.15`); spans not longer than `min_speech_ms` are dropped. A span still open runs
    to `audio_samples`."""
    min_speech = SAMPLE_RATE_HZ * min_speech_ms / 1000
    min_silence = SAMPLE_RATE_HZ * min_silence_ms / 1000
    spans: list[dict] = []
    start, silence_from = -1, 0
    for i, p in enumerate(probs.tolist()):
        at = i * VAD_WINDOW
        if p >= threshold:
            silence_from = 0
            if start < 0:
                start = at
            continue
        if start >= 0 and p < negative:
            silence_from = silence_from or at
            if at - silence_from >= min_silence:
                if silence_from - start > min_speech:
                    spans.append({"start": start, "end": silence_from})
                start, silence_from = -1, 0
    if start >= 0 and audio_samples - start > min_speech:
        spans.append({"start": start, "end": audio_samples})
    return spans


# A long utterance is cut at a gap between words: a window under this speech probability (or under vad_threshold
# where that is higher). Under a stream's lower threshold (captions: 0.3) fluent speech had no gap, and was cut
# at the quietest point of the last 2 s at the cap, 1.75 and 1.97 s after the speech it ended (the telephone
# call and a LibriVox reading of `specvox bench captions`), where 0.5 found a gap in time.
CUT_GAP_THRESHOLD = 0.5


def _long_utterance_cut(span: dict, probs: np.ndarray, longest: int, threshold: float) -> int | None:
    """Where to cut an open utterance whose speaker has not paused for end_of_speech_silence_ms, or None.

    Past `longest` less LONG_UTTERANCE_SEARCH_S (at least half of `longest`), the first window Silero puts
    under the speech `threshold` (a gap between words) cuts it as soon as it is heard; at `longest` with
    none, the quietest 96 ms (three windows' mean probability) since then does, short of its last 200 ms.
    The same cut is found at every check after (the windows' probabilities do not change), so the caller
    may wait for `cut_lookahead_ms` of audio after it before it closes the utterance there.
    On seven human recordings, a 6 s cap cut 7 utterances, each within 0.43 s of its cut point, for +0.010
    WER (0.2118 against 0.2014 uncut); waiting for a 64 ms gap under Silero's end-of-speech level instead
    left three cuts 0.4-1.8 s late, for +0.016."""
    soft = max(longest // 2, longest - LONG_UTTERANCE_SEARCH_S * SAMPLE_RATE_HZ)
    length = span["end"] - span["start"]
    if length < soft:
        return None
    first = (span["start"] + soft) // VAD_WINDOW
    stop = min(span["end"], span["start"] + longest)  # more may have come in at once: cut within the cap
    gaps = np.flatnonzero(probs[first : stop // VAD_WINDOW] < threshold)
    if gaps.size:
        return (first + int(gaps[0])) * VAD_WINDOW
    if length < longest:
        return None
    last = min((stop - SAMPLE_RATE_HZ // 5) // VAD_WINDOW, probs.size)
    if last - first < 3:
        return stop // VAD_WINDOW * VAD_WINDOW
    smoothed = np.convolve(probs[first:last], np.ones(3) / 3, mode="valid")
    return (first + 1 + int(np.argmin(smoothed))) * VAD_WINDOW  # the middle window of the quietest three


class VoiceTracker:
    """Voice spans of a stream, window by window, delimited as `speech_spans` delimits speech:
    a span starts at a window at or above the threshold and closes where `end_of_speech_silence_ms`
    below `threshold - 0.15` has followed it, so a span that becomes an utterance is one of them.

    A span is reported (`VoiceStarted`) once its voice, from its first to its last window at or
    above the threshold, lasts `voice_start_ms`; a reported span that closes without becoming an
    utterance is reported again (`VoiceEnded`). Each window is looked at once.
    """

    def __init__(self, options: AsrOptions) -> None:
        self.threshold = options.vad_threshold
        self.negative = silence_threshold(options)  # as speech_spans
        self.voice_start = SAMPLE_RATE_HZ * options.voice_start_ms / 1000
        self.min_silence = SAMPLE_RATE_HZ * options.end_of_speech_silence_ms / 1000
        self.windows = 0  # the stream's windows looked at so far
        self._reset()

    def _reset(self) -> None:
        self.start: int | None = None  # stream sample of the open span's first voiced window
        self._voiced_end = 0  # stream sample where its last voiced window ends
        self._silence_from: int | None = None
        self._reported = False
        self._utterance = False  # an utterance begins inside the span

    def update(self, probs: np.ndarray, first_window: int, utterance_starts: Sequence[int],
               heard_s: float) -> list[VoiceEvent]:
        """Look at the windows not seen yet of `probs` (the probabilities from the stream's window
        `first_window` on). `utterance_starts`: stream samples where the segmenter's utterances,
        closed or open, begin in these windows; a span holding one is an utterance's."""
        events: list[VoiceEvent] = []
        for i in range(max(0, self.windows - first_window), probs.size):
            p, at = float(probs[i]), (first_window + i) * VAD_WINDOW
            if p >= self.threshold:
                if self.start is None:
                    self.start = at
                self._silence_from, self._voiced_end = None, at + VAD_WINDOW
            elif self.start is not None and p < self.negative:
                self._silence_from = at if self._silence_from is None else self._silence_from
                if at - self._silence_from >= self.min_silence:
                    self._utterance |= any(self.start <= u < at for u in utterance_starts)
                    if self._reported and not self._utterance:
                        events.append(VoiceEnded(heard_s))
                    self._reset()
                    continue
            if self.start is None:
                continue
            self._utterance |= any(self.start <= u < at + VAD_WINDOW for u in utterance_starts)
            if not self._reported and (self._voiced_end - self.start >= self.voice_start or self._utterance):
                self._reported = True  # an utterance's voice is always reported, before its speech start
                events.append(VoiceStarted(self.start / SAMPLE_RATE_HZ, heard_s))
        self.windows = max(self.windows, first_window + probs.size)
        return events

    def finish(self, heard_s: float) -> list[VoiceEvent]:
        """The stream ended: a reported voice that is no utterance's has ended with it."""
        events: list[VoiceEvent] = [VoiceEnded(heard_s)] if self._reported and not self._utterance else []
        self._reset()
        return events


class UtteranceSegmenter:
    """Streaming end-of-speech detection with the Silero VAD that faster-whisper ships.

    `voice_events` holds what the last `feed` or `finish` found of the voice (`VoiceTracker`).
    """

    def __init__(self, options: AsrOptions) -> None:
        self.options = options
        self._probs = SileroProbabilities(options.vad_gain_db)
        self._buffer = np.zeros(0, np.float32)
        self._buffer_start = 0  # sample index of _buffer[0] in the stream
        self._checked_to = 0  # the stream sample the last VAD check's multiple of vad_check_every_ms reached
        self._index = 0
        self._open: list[dict] = []  # Silero spans of the utterance still open, in buffer samples
        self.speech_active = False
        # The open utterance has its cut (`_long_utterance_cut`) and closes there once `cut_lookahead_ms` after it
        # is heard: its final's pass is next, so a partial pass now would only hold it back.
        self.cut_pending = False
        self.voice = VoiceTracker(options)
        self.voice_events: list[VoiceEvent] = []

    @property
    def silence_after_s(self) -> float:
        """Silence heard since the open utterance's last speech (0 when none is open)."""
        return (self._buffer.size - self._open[-1]["end"]) / SAMPLE_RATE_HZ if self._open else 0.0

    @property
    def stream_s(self) -> float:
        return (self._buffer_start + self._buffer.size) / SAMPLE_RATE_HZ

    def feed(self, samples: np.ndarray) -> list[Utterance]:
        self._buffer = np.concatenate([self._buffer, samples])
        self.voice_events = []
        every = max(1, self.options.vad_check_every_ms * SAMPLE_RATE_HZ // 1000)
        crossed = (self._buffer_start + self._buffer.size - self._checked_to) // every
        if not crossed:
            return []
        self._checked_to += crossed * every
        return self._scan(final=False)

    def finish(self) -> list[Utterance]:
        """The stream ended: whatever speech is open closes now (and a voice that is not speech ends)."""
        closed = self._scan(final=True)
        self.voice_events += self.voice.finish(self.stream_s)
        return closed

    def open_utterance(self) -> Utterance | None:
        """The utterance still being spoken, as heard so far (for partial results).

        Its audio is cut as a closed one's is (`_utterance`): once `final_reuse_margin_ms` of
        silence follows the speech, it is the audio the utterance will have if the silence lasts.
        """
        if not self._open:
            return None
        return self._utterance(self._open[0]["start"], self._open[-1]["end"])

    def _utterance(self, start: int, end: int, heard_after: int = 0) -> Utterance:
        """The utterance of the speech from buffer sample `start` to `end`: its audio from
        `transcribe_pad_ms` before the speech to `final_reuse_margin_ms` after it, or `heard_after`
        samples where more (speech cut at `max_utterance_s`: `cut_lookahead_ms`), as far as heard.
        Whisper given more of the silence that follows tends to add words to it ("Thank you.")."""
        before = self.options.transcribe_pad_ms * SAMPLE_RATE_HZ // 1000
        after = max(self.options.final_reuse_margin_ms * SAMPLE_RATE_HZ // 1000, heard_after)
        lo, hi = max(0, start - before), min(self._buffer.size, end + after)
        return Utterance(
            index=self._index,
            speech_start_s=(self._buffer_start + start) / SAMPLE_RATE_HZ,
            speech_end_s=(self._buffer_start + end) / SAMPLE_RATE_HZ,
            audio=self._buffer[lo:hi].copy(),
            audio_start_s=(self._buffer_start + lo) / SAMPLE_RATE_HZ,
        )

    def _scan(self, final: bool) -> list[Utterance]:
        """Close every utterance that silence (or the stream's end) has ended.

        Silero merges speech separated by less than `end_of_speech_silence_ms`, so
        each span but the last is a whole utterance already.
        """
        o = self.options
        probs = self._probs.extend(self._buffer)
        spans = speech_spans(probs, self._buffer.size, o.vad_threshold, o.speech_start_ms, o.end_of_speech_silence_ms,
                             silence_threshold(o))
        if spans and spans[-1]["end"] == self._buffer.size and not self._is_speech(spans[-1], probs):
            spans.pop()  # still open and not yet speech_start_ms long (a blip, or speech about to start)
        self.voice_events = self.voice.update(probs, self._buffer_start // VAD_WINDOW,
                                              [self._buffer_start + s["start"] for s in spans], self.stream_s)
        self.cut_pending = False
        if not spans:
            self._open, self.speech_active = [], False
            self._forget_silence()
            return []
        needed = self.options.end_of_speech_silence_ms * SAMPLE_RATE_HZ // 1000
        longest = int(self.options.max_utterance_s * SAMPLE_RATE_HZ)
        lookahead = self.options.cut_lookahead_ms * SAMPLE_RATE_HZ // 1000
        closed = []
        while spans:
            first = spans.pop(0)
            speaking = not spans and not (final or self._buffer.size - first["end"] >= needed)
            # still spoken, or ended but longer than the cap (audio that came in one piece, a file sent unpaced)
            cut = (_long_utterance_cut(first, probs, longest, max(o.vad_threshold, CUT_GAP_THRESHOLD))
                   if speaking or first["end"] - first["start"] > longest else None)
            if speaking and (cut is None or self._buffer.size < cut + lookahead):
                spans, self.cut_pending = [first], cut is not None
                break  # the last span is still being spoken (and past a cut, not yet heard far enough)
            end = first["end"] if cut is None else cut
            closed.append(self._close(first["start"], end, lookahead if cut is not None else 0))
            dropped = end // VAD_WINDOW  # windows _close forgot of the buffer
            probs = probs[dropped:]
            if cut is not None and first["end"] - cut >= VAD_WINDOW:  # cut between words: the rest is an
                spans.insert(0, {"start": cut, "end": first["end"]})  # utterance of its own, maybe still open
            spans = [{"start": s["start"] - dropped * VAD_WINDOW, "end": s["end"] - dropped * VAD_WINDOW}
                     for s in spans]
        self._open, self.speech_active = spans, bool(spans)
        if spans:
            spans[-1]["end"] = self._last_speech_end(spans[-1])
        return closed

    def _is_speech(self, span: dict, probs: np.ndarray) -> bool:
        """Whether an open span is longer than `speech_start_ms`, measured as a closed one is: to
        where the silence after its last voice began (if it has), not to the end of the buffer
        (`speech_spans` counts an open span's silence too, so a 60 ms cough followed by 150 ms
        of silence would count as 200 ms of speech)."""
        voiced_to = probs.size * VAD_WINDOW  # the end of the last whole window
        negative = silence_threshold(self.options)
        for i in range(span["start"] // VAD_WINDOW, probs.size):
            if probs[i] >= self.options.vad_threshold:
                voiced_to = probs.size * VAD_WINDOW
            elif probs[i] < negative and voiced_to == probs.size * VAD_WINDOW:
                voiced_to = i * VAD_WINDOW
        return voiced_to - span["start"] > SAMPLE_RATE_HZ * self.options.speech_start_ms / 1000

    def _last_speech_end(self, span: dict) -> int:
        """Where the open utterance's speech really stopped, in buffer samples.

        Silero reports an open span as running to the end of the buffer until the full
        `end_of_speech_silence_ms` has passed; a second look at the last second, with a
        short silence window, finds the end of speech as soon as it is heard.
        """
        first = max(span["start"], self._buffer.size - SAMPLE_RATE_HZ) // VAD_WINDOW
        tail = speech_spans(self._probs.probs[first:], self._buffer.size - first * VAD_WINDOW,
                            self.options.vad_threshold, 0, VAD_FRAME_MS, silence_threshold(self.options))
        return first * VAD_WINDOW + tail[-1]["end"] if tail else span["start"] + 1

    def _close(self, start: int, end: int, heard_after: int = 0) -> Utterance:
        utterance = self._utterance(start, end, heard_after)
        self._index += 1
        self._drop(end // VAD_WINDOW)
        return utterance

    def _forget_silence(self) -> None:
        """Keep only the last second of a silent buffer, so memory stays bounded (and a voice that
        may yet become speech whole, unless it has lasted `max_utterance_s`)."""
        keep = SAMPLE_RATE_HZ
        if self._buffer.size > 2 * keep:
            windows = (self._buffer.size - keep) // VAD_WINDOW
            voice_from = self.voice.start
            if voice_from is not None and self.stream_s - voice_from / SAMPLE_RATE_HZ < self.options.max_utterance_s:
                windows = min(windows, max(0, voice_from - self._buffer_start) // VAD_WINDOW)
            self._drop(windows)

    def _drop(self, windows: int) -> None:
        """Forget the buffer's first `windows` VAD windows (whole windows keep the probabilities aligned)."""
        self._buffer_start += windows * VAD_WINDOW
        self._buffer = self._buffer[windows * VAD_WINDOW :]
        self._probs.drop(windows)


class Transcriber:
    """faster-whisper on a closed utterance; blocking, so services run it in a thread."""

    def __init__(self, options: AsrOptions) -> None:
        self.options = options
        model_class = (trimmed_whisper_class(round(options.encoder_min_s * 100)) if options.trim_encoder_input
                       else _whisper_class())
        try:
            self.model = model_class(
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
        _one_blas_thread()
        self.check_language(options.language)
        self._decoding = _decoding_options(self.model, options)

    def warm_up(self) -> None:
        """One pass on a second of faint noise, so the first user turn does not pay for it."""
        noise = np.random.default_rng(0).normal(0, 1e-3, SAMPLE_RATE_HZ).astype(np.float32)
        self.transcribe(Utterance(0, 0.0, 1.0, noise))

    def check_language(self, language: str) -> str:
        """`language` if this model can transcribe it ("" lets the model detect it); else ValueError."""
        if language and language not in self.model.supported_languages:
            if not self.model.model.is_multilingual:
                raise ValueError(f"the asr model {self.options.model!r} is English-only; "
                                 f"language {language!r} needs a multilingual model (asr.model)")
            raise ValueError(f"unknown language {language!r}: use an ISO 639-1 code such as 'en' or 'de'")
        return language

    def transcribe(self, utterance: Utterance, language: str | None = None, prompt: str = "",
                   before: SpeechBefore | None = None) -> Transcript:
        """One decoding pass over the utterance; `language`: None for `options.language`; `prompt`:
        text whisper takes as what was said just before (Whisper's previous-text prompt, Radford et
        al. 2022, sec. 4.5), which biases it toward those words and their spelling; `before`: the
        pass hears that audio first and goes on from its words (forced as whisper's prefix, which
        its decoder takes as already written), and gives only the words after them (less its saying
        the last of them once more: `said_again`).

        faster-whisper's `transcribe` goes on after a window's last word: it encodes and
        decodes the audio from there to the end once more, here the ~0.3 s of padding after
        the speech. That second pass cost ~40% of each pass and gave only words whisper
        invents for silence (which `asr_stream.spoken_words` drops). An utterance is at most
        `max_utterance_s` (< 30 s), so Whisper's first window holds all of it: this runs
        faster-whisper's own steps for that one window, on `encoder_features`.
        """
        model = self.model
        audio, audio_start_s, prefix = utterance.audio, utterance.audio_start_s, ""
        if before is not None and before.words:
            audio, audio_start_s, prefix = np.concatenate([before.audio, audio]), before.audio_start_s, before.text
        frames = min(audio.size // model.feature_extractor.hop_length, model.feature_extractor.nb_max_frames)
        samples = self.encoder_samples(audio.size)
        if prefix:
            samples = max(samples, min(model.feature_extractor.n_samples,
                                       round(self.options.context_encoder_min_s * SAMPLE_RATE_HZ)))
        encoder_output = model.encode(self.encoder_features(audio, samples))
        tokenizer = self._tokenizer(self.options.language if language is None else language, encoder_output)
        previous = tokenizer.encode(" " + prompt.strip()) if prompt.strip() else []
        prefix_tokens = tokenizer.encode(" " + prefix) if prefix else []
        max_new_tokens = MAX_TOKENS_PER_S * (1 + int(utterance.audio.size / SAMPLE_RATE_HZ)) + len(prefix_tokens)
        options = replace(self._decoding, max_new_tokens=max_new_tokens)
        tokens = model.get_prompt(tokenizer, previous, without_timestamps=options.without_timestamps,
                                  prefix=prefix or None)
        if before is not None and prefix and before.new_segment and not options.without_timestamps:
            tokens += self._new_segment(tokenizer, before, utterance.audio_start_s)
        result, avg_logprob, _, compression_ratio = model.generate_with_fallback(encoder_output, tokens, tokenizer,
                                                                                 options)
        measures = {"no_speech_prob": result.no_speech_prob, "avg_logprob": avg_logprob,
                    "compression_ratio": compression_ratio}
        o = self.options
        silent = result.no_speech_prob > o.no_speech_probability and avg_logprob <= o.no_speech_logprob
        if silent and not prefix:  # with words before, the window holds speech: the check is of them too
            return Transcript(text="", words=(), **measures)  # whisper's own silence check, as its transcribe skips it
        segments = segments_of(model, tokenizer, result.sequences_ids[0], frames)
        model.add_word_timestamps([segments], tokenizer, encoder_output, frames, options.prepend_punctuations,
                                  options.append_punctuations, last_speech_timestamp=0.0)
        prefix_chars = len(tokenizer.decode(prefix_tokens)) if prefix_tokens else 0
        words = tuple(_shift_words(_after_text(segments, prefix_chars), audio_start_s))
        if before is not None:
            words = words[said_again(before.words, words):]
        return Transcript(text=join_words(words), words=words, **measures)

    def _new_segment(self, tokenizer: Tokenizer, before: SpeechBefore, audio_start_s: float) -> list[int]:
        """The timestamps that close the words before's segment where their last word ends and open
        the utterance's where its audio begins, forced after them as part of the prefix.

        Given the words before alone as its prefix, whisper tiny sometimes ends the pass with them:
        "<|0.00|> … is to be ill-disposed.<|5.72|>", then the end of text, and nothing for the 5.5 s
        of speech after ("Had he married a more amiable woman, …", the Sense and Sensibility
        reading), or stopped a few words into it, and the utterance was then heard alone. Told that
        a segment begins at the utterance, it writes the utterance's words. Told so for a short
        sound that is no word (a hum just after a sentence), it wrote one ("Emmum."), where without
        it the end of its text was right: the stream does not tell it for short utterances."""
        precision = self.model.time_precision
        opens_s = audio_start_s - before.audio_start_s
        closes_s = min(before.words[-1].end_s - before.audio_start_s, opens_s)
        return [tokenizer.timestamp_begin + round(closes_s / precision),
                tokenizer.timestamp_begin + round(opens_s / precision)]

    def encoder_samples(self, audio_samples: int) -> int:
        """How long (in samples) the encoder's input is for audio of `audio_samples`: Whisper's 30 s
        window, or with `trim_encoder_input` the audio and `ENCODER_SILENCE_S` after it in whole
        seconds, at least `encoder_min_s`. The encoder's cost grows with its input: on 2 CPU cores
        whisper tiny.en encodes 30 s in ~470 ms and 10 s in ~50 ms."""
        window = self.model.feature_extractor.n_samples
        if not self.options.trim_encoder_input:
            return window
        whole_seconds = -(-(audio_samples + ENCODER_SILENCE_S * SAMPLE_RATE_HZ) // SAMPLE_RATE_HZ)
        return min(window, max(round(self.options.encoder_min_s * SAMPLE_RATE_HZ), whole_seconds * SAMPLE_RATE_HZ))

    def encoder_features(self, audio: np.ndarray, samples: int | None = None) -> np.ndarray:
        """Log-mel features of `audio` followed by digital silence, `samples` long in all (default:
        `encoder_samples`), as Whisper pads a short window: it computes the features of the audio
        padded with zero samples (openai/whisper `log_mel_spectrogram(audio, padding=N_SAMPLES)`).
        faster-whisper pads the features with zeros instead, and a feature of 0 is no silence
        (silence is ~-1 after Whisper's scaling) but a steady sound: given it, whisper tiny went
        on after the words ("Excuse me. Excuse me.", "How do volcanoes form? How do volcanoes
        forms?"). On 48 synthesized clips WER fell from 0.25 to 0.17 with silence, and to 0.14
        with timestamps as well (`without_timestamps`). Returns [80 mels, frames]."""
        extractor = self.model.feature_extractor
        samples = self.encoder_samples(audio.size) if samples is None else samples
        padded = np.zeros(samples, np.float32)
        padded[: min(audio.size, samples)] = audio[:samples]
        return extractor(padded, padding=0)[:, : samples // extractor.hop_length]

    def _tokenizer(self, language: str, encoder_output) -> Tokenizer:
        """The tokenizer for `language`; "" on a multilingual model: the language it detects in the audio."""
        from faster_whisper.tokenizer import Tokenizer

        multilingual = self.model.model.is_multilingual
        if multilingual and not language:
            language = self.model.model.detect_language(encoder_output)[0][0][0][2:-2]  # "<|de|>" -> "de"
        return Tokenizer(self.model.hf_tokenizer, multilingual, task="transcribe",
                         language=language if multilingual else "en")


def segments_of(model, tokenizer: Tokenizer, tokens: list[int], frames: int) -> list[dict]:
    """The pass's segments as faster-whisper splits them at timestamp tokens, and the words after
    the last pair of timestamps, which faster-whisper leaves to its next window (a pass has none):
    with timestamps, whisper tiny often ends an utterance's last sentence with no closing timestamp
    ("<|4.24|> We're just, you know, there's some speech errors, but cares.<|endoftext|>")."""
    duration_s = frames * model.feature_extractor.time_per_frame
    segments, _, _ = model._split_segments_by_timestamps(tokenizer, tokens, 0.0, frames, duration_s, 0)
    begin = tokenizer.timestamp_begin
    pairs = [i for i in range(1, len(tokens)) if tokens[i] >= begin and tokens[i - 1] >= begin]
    ends_with_timestamp = len(tokens) >= 2 and tokens[-2] < begin <= tokens[-1]
    if pairs and not ends_with_timestamp and any(t < tokenizer.eot for t in tokens[pairs[-1]:]):
        start_s = (tokens[pairs[-1]] - begin) * model.time_precision
        segments.append({"seek": 0, "start": start_s, "end": max(start_s, duration_s), "tokens": tokens[pairs[-1]:]})
    return segments


def _decoding_options(model, options: AsrOptions):
    """faster-whisper's options for our passes: one greedy pass at temperature 0 (no re-decoding at
    higher temperatures: a cut-off partial would trigger it, 6 passes for one result), word timings,
    no runaway repetition; `max_new_tokens` is set per pass."""
    from faster_whisper.tokenizer import Tokenizer
    from faster_whisper.transcribe import TranscriptionOptions, get_suppressed_tokens

    tokenizer = Tokenizer(model.hf_tokenizer, model.model.is_multilingual, task="transcribe", language="en")
    return TranscriptionOptions(
        beam_size=options.beam_size, best_of=1, patience=1.0, length_penalty=1.0, repetition_penalty=1.0,
        no_repeat_ngram_size=NO_REPEAT_NGRAM_TOKENS, log_prob_threshold=options.no_speech_logprob,
        no_speech_threshold=options.no_speech_probability, compression_ratio_threshold=None,
        condition_on_previous_text=False, prompt_reset_on_temperature=0.5, temperatures=[0.0],
        initial_prompt=None, prefix=None, suppress_blank=True, suppress_tokens=get_suppressed_tokens(tokenizer, [-1]),
        without_timestamps=options.without_timestamps, max_initial_timestamp=1.0, word_timestamps=True,
        prepend_punctuations="\"'“¿([{-", append_punctuations="\"'.。,，!！?？:：”)]}、", multilingual=False,
        max_new_tokens=None, clip_timestamps=[], hallucination_silence_threshold=None, hotwords=None,
    )


def _one_blas_thread() -> None:
    """numpy's OpenBLAS runs on one thread in this process from now on.

    faster-whisper projects each pass's power spectrum onto the mel filters with one numpy
    matrix product. At a few seconds of audio it is large enough for OpenBLAS to wake its
    other threads, which then spin waiting for more work for ~0.1 s: through the whole
    pass that follows, a second core busy for nothing (a pass cost ~90 ms of CPU instead
    of ~40 ms, and on 2 cores the spinning thread competes with the llm and tts). The
    products asr computes are small; one thread does them in well under a millisecond.
    """
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")


def _whisper_class() -> type:
    from faster_whisper import WhisperModel

    return WhisperModel


ENCODER_PAD_FRAMES = 100  # silence kept after the audio, so the decoder sees where it ends


def trimmed_whisper_class(min_frames: int) -> type:
    """faster-whisper with the encoder's input cut to the audio's own length.

    faster-whisper pads every segment's log-mel features with zero frames to 30 s, and the
    encoder's time grows with its input: on 2 CPU cores whisper tiny.en encodes 30 s in
    ~470 ms and 10 s in ~50 ms. For a few seconds of speech nearly all of that is padding,
    paid again on every partial pass. This keeps the audio's frames plus 1-2 s of the
    padding, and at least `min_frames` (10 ms each; `asr.encoder_min_s`).

    `Transcriber.transcribe` no longer gives it zero frames: it encodes `encoder_features`
    (silence, already trimmed), which pass through unchanged. This serves callers that still
    hand the encoder faster-whisper's zero-padded 30 s windows (`pipeline.asr_batch`).
    """
    from faster_whisper import WhisperModel

    class TrimmedWhisper(WhisperModel):
        def encode(self, features: np.ndarray):
            batch = features if features.ndim == 3 else features[None]  # [B, 80 mels, frames]
            audio_frames = np.flatnonzero(np.any(batch != 0, axis=(0, 1)))  # padding frames are exactly 0
            used = audio_frames[-1] + 1 if audio_frames.size else 0
            keep = max(min_frames, -(-used // ENCODER_PAD_FRAMES) * ENCODER_PAD_FRAMES + ENCODER_PAD_FRAMES)
            return super().encode(np.ascontiguousarray(batch[..., : min(keep, batch.shape[-1])]))

    return TrimmedWhisper


def _after_text(segments: list[dict], chars: int) -> list[dict]:
    """`segments` less their words that spell the first `chars` characters of the pass's text (the
    prefix it was given), and less a word begun in them; segments left with no word go too."""
    if not chars:
        return segments
    kept, seen = [], 0
    for segment in segments:
        words = []
        for w in segment.get("words", ()):
            seen += len(w["word"])
            if seen - len(w["word"]) >= chars:
                words.append(w)
        if words:
            kept.append(segment | {"words": words})
    return kept


def _shift_words(segments: list[dict], offset_s: float) -> Iterator[Word]:
    for segment in segments:
        if segment["start"] == segment["end"]:
            continue  # faster-whisper's transcribe drops such segments too
        for w in segment.get("words", ()):
            yield Word(
                text=w["word"],
                start_s=round(offset_s + w["start"], 3),
                end_s=round(offset_s + w["end"], 3),
                probability=float(w["probability"]),
            )


def norm_word(text: str) -> str:
    """A word as hypotheses are compared: lower case, letters and digits only."""
    return "".join(c for c in text.lower() if c.isalnum())


# A copy whisper crams into an instant may differ from what it copies by a word ("the reporting
# environment is also quite different. The reporting environment is also a quite different.", the
# second sentence timed at one instant but its last word): one of at least this many words is
# matched with one word added, left out or changed, where most of its words, and the one added or
# changed, have no duration.
LOOSE_COPY_MIN_WORDS = 4


def crammed_copy(copy: Sequence[Word], said: Sequence[Word]) -> bool:
    """Whether `copy` is whisper's copy of the words `said`, not the speaker's: the same words (as
    `norm_word` compares them), one of them given no duration, as no spoken word is (a real
    repetition, "bye bye", is timed like what it repeats); or, from `LOOSE_COPY_MIN_WORDS` words
    up, the same but for one word."""
    copied, original = [norm_word(w.text) for w in copy], [norm_word(w.text) for w in said]
    instant = [w.end_s <= w.start_s for w in copy]
    if copied == original:
        return any(instant)
    if min(len(copied), len(original)) < LOOSE_COPY_MIN_WORDS or 2 * sum(instant) <= len(copy):
        return False
    odd = _odd_word(copied, original)
    return odd is not None and all(instant[i] for i in odd)


def _odd_word(copy: Sequence[str], original: Sequence[str]) -> tuple[int, ...] | None:
    """Where `copy` has the one word added or changed that makes it from `original`, as its index (`()`: a
    word left out); None where no one word does (the two differ)."""
    if abs(len(copy) - len(original)) > 1:
        return None
    head = next((i for i, (a, b) in enumerate(zip(copy, original, strict=False)) if a != b),
                min(len(copy), len(original)))
    if copy[head + (len(copy) >= len(original)):] != original[head + (len(original) >= len(copy)):]:
        return None
    return (head,) if len(copy) >= len(original) else ()


def crammed_copy_of_last(copy: Sequence[Word], before: Sequence[Word]) -> bool:
    """Whether `copy` is whisper's copy (`crammed_copy`) of the last words of `before`: as many words as it
    has, or from `LOOSE_COPY_MIN_WORDS` up one more or fewer."""
    k = len(copy)
    lengths = (k,) if k < LOOSE_COPY_MIN_WORDS else (k, k - 1, k + 1)
    return any(0 < n <= len(before) and crammed_copy(copy, before[-n:]) for n in lengths)


def said_again(before: Sequence[Word], words: Sequence[Word]) -> int:
    """How many leading `words` of a pass that went on from the words `before` are whisper saying
    the last of those once more (`crammed_copy`); 0: none.

    Going on from "So this is the." (the speaker paused after "the"), whisper tiny wrote "So this
    is the sixth form." with "So" and "this" both at the instant the audio before ends: the words
    before, crammed in ahead of the new speech, as `asr_words.spoken_words` finds them crammed
    into the end of an utterance."""
    for k in range(len(words), 0, -1):
        if crammed_copy_of_last(words[:k], before):
            return k
    return 0


def join_words(words: Iterable[Word]) -> str:
    return "".join(w.text for w in words).strip()
