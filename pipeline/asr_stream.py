"""Streaming recognition: partial transcripts that never take a word back, then a final one.

The open utterance is re-transcribed as audio arrives. Which words to show as settled comes
from LocalAgreement-n, after Macháček, Dabre and Bojar (2023), "Turning Whisper into
Real-Time Transcription System" (IJCNLP-AACL system demonstrations, arXiv 2307.14743):

- a *hypothesis* is the word sequence of one transcription pass over the open utterance;
- a word is *committed* once n consecutive hypotheses agree on it: the committed words grow
  by the longest common prefix of the last n hypotheses' words after those already
  committed. Committed words are never taken back;
- the rest of the newest hypothesis is *tentative*: shown, but it may still change.

The final transcript of an utterance is not stitched from the partials: it is one pass over
the utterance's own audio, whole (`pipeline.asr_words.utterance_words`), so it says word for word
what the same model writes for that audio. Stitching the committed words of passes over the
audio as it grew to one last pass's tentative rest gave what no pass said ("a friendly robot?
dog?", "What is that tallest mountain": words settled on a cut-off audio). The pass at the first
silence (`speech_ending`) is that final's pass if the silence lasts, so its partial carries the
final's words, committed, and may change words earlier partials had committed; the final then
costs no pass of its own. The partials in between never take a committed word back.

With `asr.context_pause_ms` (0, off, by default; a stream may ask for it, as the gateway's
caption streams do) a sentence cut at a pause is heard whole: the final's pass of an utterance
begun less than that after the last one hears the stream's audio of the utterances just before
it (`SpeechBefore`, at most `asr.context_s`) and goes on from their finals' words, which whisper
is given as already written; the final is the words after them, so nothing said before a pause
is said again ("Hello Hello, can you…"; nor whisper's saying the last of them once more ahead of
the new speech: `pipeline.asr.said_again`). Whisper is told that a segment of its text begins
at the utterance (`SpeechBefore.new_segment`: going on from a finished sentence, it sometimes ended
its text there and wrote nothing for the speech after), except where the utterance is voiced for
less than `short_utterance_ms` (told so, it wrote a hum after a sentence as a word). Such a pass
is the final only where its words lie in the utterance's audio and reach the end of its speech
(`went_on`); else the utterance is heard alone. Partial passes hear the open utterance alone:
they are many, and the final may change their words anyway.

Whisper's prompt comes two ways. `vocabulary` (OpenAI's transcription prompt, Riva's speech
contexts) is every pass's prompt. `expected` (what the gateway expects while the user speaks over
the avatar: its backchannels) is asked only where a brief utterance's pass wrote other words: a pass
prompted with the phrases that writes only their words is heard instead (a murmured "Mm-hmm." as
such, or as no words, not as "In a moment."); any other speech is heard as without them
(`StreamingRecognizer._words`). Under a prompt of short phrases whisper tiny loops and drops words on real speech:
"Sorry, what was that?" came out "sorry. what was that? what was that? sorry. what was not?", "Why?"
as "y.", "Wait, what about cats?" over a reply as "What about cats? what about cats? what what about
cats?" (tests/e2e/test_asr_stream.py).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import takewhile

import numpy as np

from pipeline.asr import (
    SAMPLE_RATE_HZ,
    AsrOptions,
    SpeechBefore,
    Transcriber,
    Utterance,
    UtteranceSegmenter,
    VoiceEnded,
    VoiceEvent,
    VoiceStarted,
    Word,
    join_words,
    voiced_briefly,
)
from pipeline.asr_words import norm_word, spoken_words, utterance_words

__all__ = ["AsrEvent", "FinalTranscript", "LocalAgreement", "PartialTranscript", "SpeechStarted",
           "StreamingRecognizer", "VoiceEnded", "VoiceStarted", "join_words", "norm_word", "normalised_text",
           "spoken_words", "went_on"]

# Whisper's word timings jitter; a word starting this early before the last committed
# word's end is still taken as new (the paper uses the same 0.1 s slack).
TIME_SLACK_S = 0.1
# A hypothesis may repeat up to this many committed words at its head; they are dropped.
MAX_OVERLAP_WORDS = 5
# While the user speaks, words ending this close to the end of what a pass heard stay tentative.
EDGE_GUARD_S = 0.3
WINDOW_S = 29.0  # the most audio one pass hears: whisper's 30 s window, less the silence after it
# A pass that went on from the words before stopped short of its utterance's speech where its last
# word ends this long before it, and strayed into the speech before where its first word starts
# STRAYED_S before the utterance's audio (`went_on`). Heard alone, on the clips of `specvox bench
# asr-finals`, 1 final in 99 ends so early (the VAD's end lags a word's fading end: p95 0.43 s,
# p99 0.88 s); the passes that stopped short ("The river" for "The river rose by 12% last spring.")
# ended 1.4-2.2 s early. No pass alone starts before its audio (its pad, 0.3 s, covers whisper's lead).
STOPPED_SHORT_S = 1.0
STRAYED_S = 0.3


def _ms(seconds: float) -> int:
    """Seconds as whole milliseconds, so that 1.5 s - 1.3 s counts as 200 ms (not 199.99...)."""
    return round(seconds * 1000)


def normalised_text(text: str) -> str:
    """Text as two transcripts are compared (preemptive turns): words of `norm_word`."""
    return " ".join(w for w in (norm_word(t) for t in text.split()) if w)


class LocalAgreement:
    """LocalAgreement-n over word hypotheses of one utterance (see the module docstring)."""

    def __init__(self, n: int = 2) -> None:
        if n < 1:
            raise ValueError("LocalAgreement needs n >= 1")
        self.n = n
        self.committed: list[Word] = []
        self.tentative: list[Word] = []
        self._recent: list[list[Word]] = []  # the last n-1 hypotheses, after the committed words

    def update(self, hypothesis: Sequence[Word], settled_until_s: float = math.inf) -> list[Word]:
        """Take one more hypothesis; returns the words it newly committed.

        Only words ending by `settled_until_s` may be committed by this hypothesis (a word
        cut off by the end of the audio a pass heard is often misheard, the same way twice).
        """
        history = [*self._recent, self.unseen(hypothesis)]
        settled = list(takewhile(lambda w: w.end_s <= settled_until_s, history[-1]))
        agreed = _common_prefix([*history[:-1], settled]) if len(history) >= self.n else []
        self.committed += agreed
        self._recent = [h[len(agreed):] for h in history][len(history) - (self.n - 1):] if self.n > 1 else []
        self.tentative = history[-1][len(agreed):]
        return agreed

    def reset(self, committed: Sequence[Word] = ()) -> None:
        """Start over with `committed` as the committed words (the utterance's final words, or none)."""
        self.committed, self.tentative, self._recent = list(committed), [], []

    def unseen(self, hypothesis: Sequence[Word]) -> list[Word]:
        """The words of a hypothesis that come after the committed ones."""
        if not self.committed:
            return list(hypothesis)
        last_end_s = self.committed[-1].end_s
        fresh = [w for w in hypothesis if w.start_s > last_end_s - TIME_SLACK_S]
        # The paper's n-gram check: drop a head of `fresh` that repeats the committed tail.
        for k in range(1, min(MAX_OVERLAP_WORDS, len(self.committed), len(fresh)) + 1):
            if [norm_word(w.text) for w in self.committed[-k:]] == [norm_word(w.text) for w in fresh[:k]]:
                return fresh[k:]
        return fresh


def _common_prefix(hypotheses: list[list[Word]]) -> list[Word]:
    """The longest prefix all hypotheses share (compared by `norm_word`); words of the newest."""
    newest = hypotheses[-1]
    length = 0
    while all(len(h) > length for h in hypotheses) and len({norm_word(h[length].text) for h in hypotheses}) == 1:
        length += 1
    return newest[:length]


@dataclass(frozen=True)
class SpeechStarted:
    utterance_index: int
    heard_s: float  # how much of the stream had been heard when speech was detected


@dataclass(frozen=True)
class PartialTranscript:
    """The open utterance so far: `committed` words are final, `tentative` ones may change."""

    utterance_index: int
    committed: tuple[Word, ...]
    tentative: tuple[Word, ...]
    speech_start_s: float
    speech_end_s: float  # the last speech the VAD has heard, in the stream's timeline
    heard_s: float  # how much of the stream this pass heard
    speech_ending: bool  # silence follows the speech: the final will likely say just this

    @property
    def text(self) -> str:
        return join_words((*self.committed, *self.tentative))

    @property
    def stability(self) -> float:
        """The committed share of the words, 0 to 1."""
        total = len(self.committed) + len(self.tentative)
        return len(self.committed) / total if total else 1.0


@dataclass(frozen=True)
class FinalTranscript:
    utterance: Utterance
    words: tuple[Word, ...]
    reused_partial: bool  # the last partial pass had heard the end of speech: no new pass ran
    before: SpeechBefore | None = None  # what its pass heard before the utterance (see the module docstring)

    @property
    def text(self) -> str:
        return join_words(self.words)


# In stream order: VoiceStarted comes before the SpeechStarted of the same speech; a voice that
# never becomes an utterance gets VoiceEnded instead, and one that does never gets it.
AsrEvent = VoiceStarted | VoiceEnded | SpeechStarted | PartialTranscript | FinalTranscript


class SharedCadence:
    """The partial passes of the streams one model thread serves, shared out among those speaking.

    The asr's thread runs every stream's passes on cores the llm and tts need too. While one
    user speaks, a stream's partials come every `partial_every_ms`; with n users speaking at
    once, each one's come n times as far apart, so the thread's partial passes stay about one
    per `partial_every_ms` in all and the machine's cores go to the replies being written.
    The pass at the first silence (preemption's, and the final's when it can be reused) and
    the finals are never spaced out: they are what the turn waits for.
    """

    def __init__(self) -> None:
        self._speaking: set[int] = set()

    def speaking(self, stream: int, active: bool) -> None:
        if active:
            self._speaking.add(stream)
        else:
            self._speaking.discard(stream)

    @property
    def streams(self) -> int:
        """Streams with speech open now, at least 1."""
        return max(1, len(self._speaking))


class StreamingRecognizer:
    """VAD, partial passes and LocalAgreement over one audio stream; blocking (a model thread).

    The VAD's voice events (`VoiceStarted`, `VoiceEnded`) come first, at the VAD check that
    finds them (every `vad_check_every_ms`), before speech has started.

    `feed` is `listen` then `transcribe`. A service with several streams on one whisper thread
    calls them apart: `listen` (the VAD, ~1 ms) on a thread of its own, and `transcribe` on the
    model thread only when `transcription_due`, so that a voice onset, which pauses the
    avatar, never waits behind another stream's whisper pass.

    A partial pass runs when `partial_every_ms` of new audio has arrived since the last one
    while the user speaks, and once when `final_reuse_margin_ms` of silence follows the
    speech. At end of speech the final reuses that last pass if it heard the whole utterance,
    so the final costs no transcription of its own.
    """

    def __init__(self, options: AsrOptions, transcriber: Transcriber, language: str | None = None,
                 cadence: SharedCadence | None = None) -> None:
        """`language`: this stream's (checked with `Transcriber.check_language`); None: `options.language`;
        `cadence`: shared with the other streams of the same model thread (None: this stream alone).
        Call `close` when the stream is done with."""
        self.options = options
        self.cadence = cadence or SharedCadence()
        self.transcriber = transcriber
        self.language = options.language if language is None else language
        self.segmenter = UtteranceSegmenter(options)
        self.agreement = LocalAgreement(options.agreement_n)
        # Whisper's prompts for the passes from now on (see `_words`, Transcriber.transcribe).
        self.vocabulary = ""  # every pass's: words and names to spell as given
        self.expected = ""  # what the speaker may say next: a brief utterance that is only these is heard so
        self._pass_index = -1  # utterance of the last pass
        self._pass_heard_s = 0.0
        self._ending: _EndingPass | None = None  # the last pass at a first silence, for the final to reuse
        # What `listen` heard that `transcribe` has yet to give out, in stream order: events, and
        # the utterances the VAD closed (each becomes its final there).
        self._pending: list[AsrEvent | Utterance] = []
        self._open: Utterance | None = None  # the open utterance as the last `listen` left it (its audio copied once)
        keep_s = options.context_s + options.max_utterance_s + 1
        self._heard = _RecentAudio(keep_s) if options.context_pause_ms else None
        self._said: list[FinalTranscript] = []  # with context: the finals with words whose audio is kept, oldest first

    def feed(self, samples: np.ndarray) -> list[AsrEvent]:
        return self.listen(samples) + self.transcribe()

    def listen(self, samples: np.ndarray) -> list[AsrEvent]:
        """The VAD over new audio. The events it found that need no transcription and come before
        any utterance it closed are returned now; the rest waits for `transcribe`."""
        was_active = self.segmenter.speech_active
        if self._heard is not None:
            self._heard.extend(samples)
        closed = self.segmenter.feed(samples)
        before, after = _voice_around(self.segmenter.voice_events, closed)
        open_utterance = self._open = self.segmenter.open_utterance()
        self.cadence.speaking(id(self), open_utterance is not None)
        heard_s = self.segmenter.stream_s
        if not was_active and closed:
            self._pending.append(SpeechStarted(closed[0].index, heard_s))
        self._pending += [*closed, *after]
        if open_utterance is not None and (closed or not was_active):  # a new utterance has begun
            self._pending.append(SpeechStarted(open_utterance.index, heard_s))
        ready = list(takewhile(lambda e: not isinstance(e, Utterance), self._pending))
        del self._pending[:len(ready)]
        return [*before, *ready]  # type: ignore[list-item]

    @property
    def transcription_due(self) -> bool:
        """Whether `transcribe` runs whisper: a closed utterance whose final cannot reuse the last
        pass, or a partial pass due. Otherwise it is a few list operations."""
        finals = (u for u in self._pending if isinstance(u, Utterance))
        if any(not self._reuses_pass(u) for u in finals):
            return True
        return self._open is not None and self._pass_due(self._open)

    def transcribe(self) -> list[AsrEvent]:
        """The finals of the utterances `listen` closed, the events after them, and a partial pass
        over the open utterance if one is due."""
        events = self._pending_events()
        if self._open is not None and self._pass_due(self._open):
            events.append(self._partial(self._open))
        return events

    def finish(self) -> list[AsrEvent]:
        """The stream ended: the open utterance (if any) gets its final now; a voice that was not
        speech gets its VoiceEnded."""
        self.close()
        pending, self._open = self._pending_events(), None
        was_active = self.segmenter.speech_active
        closed = self.segmenter.finish()
        before, after = _voice_around(self.segmenter.voice_events, closed)
        started = [SpeechStarted(closed[0].index, self.segmenter.stream_s)] if closed and not was_active else []
        return [*pending, *before, *started, *(self._final(u) for u in closed), *after]

    def _pending_events(self) -> list[AsrEvent]:
        """What `listen` left for `transcribe`, the closed utterances made finals."""
        events = [self._final(e) if isinstance(e, Utterance) else e for e in self._pending]
        self._pending = []
        return events

    def close(self) -> None:
        """This stream no longer takes a share of the cadence."""
        self.cadence.speaking(id(self), False)

    def _pass_due(self, utterance: Utterance) -> bool:
        """A pass once `partial_every_ms` of new audio has come while the user speaks. Once the VAD
        hears silence, only the pass that hears `final_reuse_margin_ms` of it (the final, if the
        silence lasts): a pass over silence finds no new words, and one still running when the
        VAD closes the utterance would hold the final back."""
        passed = self._pass_index == utterance.index  # a pass of this utterance has run
        if self.segmenter.cut_pending:
            return False
        if self.segmenter.silence_after_s > 0:
            margin_heard = passed and self._heard_margin(self._pass_heard_s, utterance)
            return _ms(self.segmenter.silence_after_s) >= self.options.final_reuse_margin_ms and not margin_heard
        since_s = self._pass_heard_s if passed else utterance.speech_start_s
        return _ms(self.segmenter.stream_s - since_s) >= self.options.partial_every_ms * self.cadence.streams

    def _heard_margin(self, heard_s: float, utterance: Utterance) -> bool:
        """Audio heard up to `heard_s` holds `final_reuse_margin_ms` of silence after the speech."""
        return _ms(heard_s - utterance.speech_end_s) >= self.options.final_reuse_margin_ms

    def _words(self, utterance: Utterance, ended: bool, before: SpeechBefore | None = None) -> tuple[Word, ...]:
        """The words of a pass over the utterance's audio as heard (going on from `before`) with the
        `vocabulary` as prompt, less what the speaker did not say (`utterance_words`; while the user
        speaks, `ended` False, the words at the audio's edge stay). Where that pass wrote a word
        not among the `expected` phrases' on an utterance voiced briefly (`voiced_briefly`), a pass with
        them as prompt too decides: its words if each is one of the phrases' (a murmur that whisper,
        unprompted, writes as words: "In a moment." for "Mm-hmm."; none, for a hum), else the first's."""
        words = self._pass_words(utterance, ended, self.vocabulary, before)
        if not self.expected or _only_words_of(words, self.expected) or not voiced_briefly(utterance, self.options):
            return words
        prompted = self._pass_words(utterance, ended, f"{self.vocabulary} {self.expected}".strip(), before)
        return prompted if _only_words_of(prompted, self.expected) else words

    def _pass_words(self, utterance: Utterance, ended: bool, prompt: str,
                    before: SpeechBefore | None) -> tuple[Word, ...]:
        transcript = self.transcriber.transcribe(utterance, self.language, prompt, before)
        return utterance_words(transcript, utterance, self.options, ended)

    def _final_words(self, utterance: Utterance) -> tuple[tuple[Word, ...], SpeechBefore | None]:
        """The words of the utterance's final pass, and the speech before it that the pass went on
        from (`_before`; None: it heard the utterance alone, as it does where that pass did not
        go on from the words before through the utterance's speech: `went_on`)."""
        before = self._before(utterance)
        if before is not None:
            words = self._words(utterance, True, before)
            after_s = before.words[-1].end_s if _rest_of_cut(self._said, utterance) else None
            if went_on(words, utterance, self.options, after_s):
                return words, before
        return self._words(utterance, ended=True), None

    def _before(self, utterance: Utterance) -> SpeechBefore | None:
        """The finals just before `utterance` its final's pass goes on from: those of the utterances
        each begun less than `context_pause_ms` after the last, whose audio begins at most `context_s`
        before the utterance's (and fits whisper's window with it); None: it is heard alone. Whisper
        is told a segment begins at an utterance voiced for `short_utterance_ms` or more."""
        o, heard = self.options, self._heard
        if heard is None:
            return None
        chain: list[FinalTranscript] = []
        after_s = utterance.speech_start_s
        earliest_s = max(utterance.audio_start_s - o.context_s, heard.start_s,
                         utterance.audio_start_s + utterance.audio.size / SAMPLE_RATE_HZ - WINDOW_S)
        for final in reversed(self._said):
            u = final.utterance
            if _ms(after_s - u.speech_end_s) >= o.context_pause_ms or u.audio_start_s < earliest_s:
                break
            chain.insert(0, final)
            after_s = u.speech_start_s
        if not chain:
            return None
        start_s = chain[0].utterance.audio_start_s
        return SpeechBefore(heard.between(start_s, utterance.audio_start_s), start_s,
                            tuple(w for f in chain for w in f.words), new_segment=not voiced_briefly(utterance, o))

    def _partial(self, utterance: Utterance) -> PartialTranscript:
        heard_s = self.segmenter.stream_s  # the pass's audio may stop short of it (silence)
        ending = self._heard_margin(heard_s, utterance)
        words, before = self._final_words(utterance) if ending else (self._words(utterance, False), None)
        self._pass_index, self._pass_heard_s = utterance.index, heard_s
        if ending:  # the utterance's audio whole, if the silence lasts: the final's words
            self._ending = _EndingPass(utterance.index, utterance.audio_start_s, utterance.audio.size, words, before)
            self.agreement.reset(words)
        else:
            self.agreement.update(words, self._pass_heard_s - EDGE_GUARD_S)
        return PartialTranscript(
            utterance_index=utterance.index,
            committed=tuple(self.agreement.committed),
            tentative=tuple(self.agreement.tentative),
            speech_start_s=utterance.speech_start_s,
            speech_end_s=utterance.speech_end_s,
            heard_s=self._pass_heard_s,
            speech_ending=ending,
        )

    def _reuses_pass(self, utterance: Utterance) -> bool:
        """The pass at the first silence heard this utterance's audio, all of it: the final is its words."""
        return self._ending is not None and self._ending.heard(utterance)

    def _final(self, utterance: Utterance) -> FinalTranscript:
        reuse = self._reuses_pass(utterance)
        if reuse and self._ending:
            words, before = self._ending.words, self._ending.before
        else:
            words, before = self._final_words(utterance)
        self.agreement.reset()
        self._pass_index, self._ending = -1, None
        final = FinalTranscript(utterance, words, reused_partial=reuse, before=before)
        if self._heard is not None:  # what the next finals may go on from
            # An utterance with no words (a hum, a cough) ends it: its audio would be heard with no
            # words for it, and whisper would write some. Not the rest of speech cut at max_utterance_s
            # (it begins where the last ended), whose words the pass before may have written already:
            # heard alone after it, the cold speaker's quiet "acoustic corpus" was no speech. A final
            # whose audio is no longer kept is done with.
            kept = [f for f in self._said if f.utterance.audio_start_s >= self._heard.start_s]
            self._said = [*kept, final] if words or _rest_of_cut(kept, utterance) else []
        return final


@dataclass(frozen=True)
class _EndingPass:
    """The words of the pass at the first silence after an utterance's speech, and the audio it heard."""

    utterance_index: int
    audio_start_s: float
    audio_samples: int
    words: tuple[Word, ...]
    before: SpeechBefore | None

    def heard(self, utterance: Utterance) -> bool:
        """Whether it heard the very audio of `utterance`: the same utterance, from and to the same samples."""
        return (self.utterance_index, self.audio_start_s, self.audio_samples) == (
            utterance.index, utterance.audio_start_s, utterance.audio.size)


def went_on(words: Sequence[Word], utterance: Utterance, options: AsrOptions, after_s: float | None = None) -> bool:
    """Whether a pass that went on from the words before wrote the utterance's speech, no more
    and no less: its words lie in the utterance's audio and reach the end of its speech.

    Going on from the words before, whisper sometimes stops early: after "… the Overwatch
    League for 2020." it wrote nothing for 4 s of speech cut off with no pause, and it
    ended "The train leaves from platform nine …" after "from". The next final, going on
    from "The train leaves from", then wrote "platform nine" in the speech before its own:
    said, but in the wrong final, at the wrong time. An utterance voiced for less than
    `short_utterance_ms` may get no word (a filler or a hum whisper rightly leaves out).

    `after_s`, where the words before end, for the rest of speech cut at `max_utterance_s`
    (`_rest_of_cut`): its words may begin from there. The pass before heard the speech only up to
    the cut, and whisper tiny often leaves out the word or two at the end of its audio ("… there's
    some speech" for "… some speech errors, but cares.", the cut after "errors"); going on with no
    pause, the next pass writes them where they were said, in the right order and at once."""
    if not words:
        return voiced_briefly(utterance, options)
    earliest_s = utterance.audio_start_s - STRAYED_S
    if after_s is not None:
        earliest_s = min(earliest_s, after_s - TIME_SLACK_S)
    return words[0].start_s >= earliest_s and words[-1].end_s >= utterance.speech_end_s - STOPPED_SHORT_S


def _only_words_of(words: Sequence[Word], phrases: str) -> bool:
    """Every word is one of the phrases' words (as `norm_word` compares them)."""
    allowed = {norm_word(w) for w in phrases.split()}
    return all(norm_word(w.text) in allowed for w in words)


def _rest_of_cut(said: Sequence[FinalTranscript], utterance: Utterance) -> bool:
    """Whether `utterance` is the rest of speech cut at `max_utterance_s`: it begins where the last of
    the finals `said` ended, with no pause."""
    return bool(said) and utterance.speech_start_s <= said[-1].utterance.speech_end_s


class _RecentAudio:
    """At least the last `keep_s` seconds of a stream's audio, as the chunks it came in (appending
    costs no copy), to hear an utterance's final after the speech before it."""

    def __init__(self, keep_s: float) -> None:
        self._keep = round(keep_s * SAMPLE_RATE_HZ)
        self._chunks: deque[np.ndarray] = deque()
        self._start = 0  # the stream sample of the first chunk's first
        self._size = 0

    @property
    def start_s(self) -> float:
        return self._start / SAMPLE_RATE_HZ

    def extend(self, samples: np.ndarray) -> None:
        self._chunks.append(samples.astype(np.float32, copy=False))
        self._size += samples.size
        while self._chunks and self._size - self._chunks[0].size >= self._keep:
            dropped = self._chunks.popleft()
            self._start, self._size = self._start + dropped.size, self._size - dropped.size

    def between(self, start_s: float, end_s: float) -> np.ndarray:
        """The audio from `start_s` to `end_s` (in the stream's timeline), as far as it is kept."""
        lo, hi = (max(0, round(t * SAMPLE_RATE_HZ) - self._start) for t in (start_s, end_s))
        parts, at = [], 0
        for chunk in self._chunks:
            if at >= hi:
                break
            if at + chunk.size > lo:
                parts.append(chunk[max(0, lo - at):hi - at])
            at += chunk.size
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def _voice_around(voice: list[VoiceEvent], closed: list[Utterance]) -> tuple[list[VoiceEvent], list[VoiceEvent]]:
    """The voice events of one VAD check split into those before and after the utterances it
    closed: from the first voice begun after the last closed utterance's speech on, they come
    after its final (only a check over more than ~200 ms of audio sees both)."""
    if not closed:
        return voice, []
    end_s = closed[-1].speech_end_s
    at = next((i for i, e in enumerate(voice) if isinstance(e, VoiceStarted) and e.speech_start_s >= end_s),
              len(voice))
    return voice[:at], voice[at:]
