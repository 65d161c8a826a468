"""Placing synthesized phrases one after another in the reply's timeline, with their caption cues.

Each phrase is said as `speech_text` spells it; its pieces of audio go out as the
backend makes them, each with the word cues it settles. A word's cue spans the
audio of every spoken word it became ("1,200" → "one thousand two hundred"). Words
the backend could not align are placed in proportion to their length within what
is left of the phrase. A phrase's visemes are placed by the voice's own clock (the samples
it made before them), so resampling moves none of them; each goes out with the first piece
whose audio reaches its start.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from pipeline.audio import StreamResampler
from pipeline.captions import CaptionTrack, Cue
from pipeline.tts.backend import Synthesis, Synthesizer
from pipeline.tts.speech_text import SpeechText, speech_text
from pipeline.tts.visemes import Viseme


@dataclass(frozen=True)
class SpeechPiece:
    """Audio of one phrase, in order; the phrase's last piece carries its phrase cue (and may be silent)."""

    phrase_index: int
    audio: np.ndarray  # mono float32 at `sample_rate_hz`
    sample_rate_hz: int
    start_s: float  # in the reply's timeline
    word_cues: tuple[Cue, ...] = ()
    phrase_cue: Cue | None = None
    visemes: tuple[Viseme, ...] = ()  # in the reply's timeline; each starts in this piece's audio or later

    @property
    def end_s(self) -> float:
        return self.start_s + self.audio.size / self.sample_rate_hz


class ReplySpeaker:
    """Synthesizes phrases in order; each starts where the previous one's audio ended."""

    def __init__(self, synthesizer: Synthesizer, sample_rate_hz: int = 0) -> None:
        self.synthesizer = synthesizer
        self.sample_rate_hz = sample_rate_hz or synthesizer.sample_rate_hz
        self.captions = CaptionTrack()
        self._next_index = 0
        self._next_start_s = 0.0
        self._visemes_end_s = 0.0  # where the last phrase's visemes end (a resampled phrase's audio may end a
        # sample sooner): the next phrase's begin no earlier
        self.chunks_out = 0  # audio chunks the caller has numbered so far (their index in the reply)

    @property
    def end_s(self) -> float:
        return self._next_start_s

    @property
    def next_phrase_index(self) -> int:
        return self._next_index

    def resume_at(self, phrase_index: int, start_s: float, chunks_out: int) -> None:
        """Continue a reply another speaker began: the next phrase said is `phrase_index`, its audio
        starts at `start_s` of the reply's timeline and its first chunk is numbered `chunks_out`."""
        self._next_index, self._next_start_s, self.chunks_out = phrase_index, start_s, chunks_out

    def speak(self, text: str) -> Iterator[SpeechPiece]:
        """The phrase's pieces as they are synthesized; nothing for a phrase with no words to say."""
        said = speech_text(text)
        if not said.words:
            return
        index, start_s = self._next_index, self._next_start_s
        self._next_index += 1
        timer = _WordTimer(said, start_s)
        visemes = _VisemePlacer(start_s, self.synthesizer.sample_rate_hz, self._visemes_end_s)
        resampler = StreamResampler(self.synthesizer.sample_rate_hz, self.sample_rate_hz)  # no seams mid-word
        for piece in self.synthesizer.stream(said.spoken, after_s=start_s):
            piece_start_s = self._next_start_s
            audio = self._advance(resampler.feed(piece.audio))
            cues = timer.place(piece, piece_start_s, self._next_start_s)
            self.captions.words.extend(cues)
            yield SpeechPiece(index, audio, self.sample_rate_hz, piece_start_s, cues,
                              visemes=visemes.place(piece, self._next_start_s))
        tail_start_s = self._next_start_s
        audio = self._advance(resampler.finish())
        cues = timer.finish(self._next_start_s)
        phrase_cue = Cue(round(start_s, 3), round(self._next_start_s, 3), " ".join(w.text for w in said.words))
        self.captions.words.extend(cues)
        self.captions.phrases.append(phrase_cue)
        yield SpeechPiece(index, audio, self.sample_rate_hz, tail_start_s, cues, phrase_cue,
                          visemes.finish(self._next_start_s))
        self._visemes_end_s = visemes.last_end_s

    def _advance(self, audio: np.ndarray) -> np.ndarray:
        self._next_start_s += audio.size / self.sample_rate_hz
        return audio


class _VisemePlacer:
    """Puts a phrase's visemes on the reply's timeline: the phrase's start plus the voice's own samples
    before them (the resampler holds a few milliseconds back, but moves no time); holds each back
    until the audio out reaches its start, so it goes out with the piece that plays it."""

    def __init__(self, start_s: float, voice_rate_hz: int, earliest_s: float = 0.0) -> None:
        self.start_s = start_s
        self.voice_rate_hz = voice_rate_hz
        self.voice_samples = 0  # the phrase's audio made so far, at the voice's rate
        self.last_end_s = max(start_s, earliest_s)
        self.pending: list[Viseme] = []

    def place(self, piece: Synthesis, out_until_s: float) -> tuple[Viseme, ...]:
        piece_start_s = self.start_s + self.voice_samples / self.voice_rate_hz
        self.voice_samples += piece.audio.size
        for v in piece.visemes:
            begin = max(piece_start_s + v.start_s, self.last_end_s)
            self.last_end_s = max(piece_start_s + v.end_s, begin)
            self.pending.append(Viseme(begin, self.last_end_s, v.viseme, v.azure_id, v.weight, v.approximate))
        due = [v for v in self.pending if v.start_s < out_until_s]
        self.pending = self.pending[len(due) :]
        return tuple(due)

    def finish(self, end_s: float) -> tuple[Viseme, ...]:
        """The rest, none past the phrase's audio (`end_s`)."""
        due = [Viseme(v.start_s, min(v.end_s, end_s), v.viseme, v.azure_id, v.weight, v.approximate)
               for v in self.pending if v.start_s < end_s]
        if self.pending:
            self.last_end_s = due[-1].end_s if due else min(self.last_end_s, end_s)
        self.pending = []
        return tuple(due)


class _WordTimer:
    """Times a phrase's spoken words as pieces arrive; makes a cue per written word once all of it is timed."""

    def __init__(self, said: SpeechText, start_s: float) -> None:
        self.said = said
        self.spoken = said.spoken_words
        self.times: list[tuple[float, float]] = []
        self.aligned = True  # every piece so far came with word times that fit
        self.last_end_s = start_s
        self._cued = 0  # written words with a cue

    def place(self, piece: Synthesis, start_s: float, end_s: float) -> tuple[Cue, ...]:
        words = piece.words
        expected = self.spoken[len(self.times) : len(self.times) + len(words or ())]
        if not self.aligned or words is None or [w.text for w in words] != expected:
            self.aligned = False
            return ()
        for w in words:
            begin = min(max(start_s + w.start_s, self.last_end_s), end_s)
            self.last_end_s = min(max(start_s + w.end_s, begin), end_s)
            self.times.append((begin, self.last_end_s))
        return self._cues()

    def finish(self, end_s: float) -> tuple[Cue, ...]:
        """The words left untimed, in proportion to their letters over the rest of the phrase."""
        rest = self.spoken[len(self.times) :]
        weights = np.array([max(1, sum(ch.isalnum() for ch in w)) for w in rest], dtype=np.float64)
        edges = self.last_end_s + (end_s - self.last_end_s) * np.concatenate([[0.0], np.cumsum(weights)]) / max(
            weights.sum(), 1.0)
        self.times += [(float(a), float(b)) for a, b in zip(edges[:-1], edges[1:], strict=True)]
        return self._cues()

    def _cues(self) -> tuple[Cue, ...]:
        cues = []
        first_spoken = sum(len(w.spoken) for w in self.said.words[: self._cued])
        for word in self.said.words[self._cued :]:
            last_spoken = first_spoken + len(word.spoken) - 1
            if last_spoken >= len(self.times):
                break
            cues.append(Cue(round(self.times[first_spoken][0], 3), round(self.times[last_spoken][1], 3), word.text))
            first_spoken = last_spoken + 1
            self._cued += 1
        return tuple(cues)
