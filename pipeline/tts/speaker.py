"""Placing synthesized phrases one after another in the reply's timeline."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.captions import Cue
from pipeline.tts.piper_backend import PiperSynthesizer


@dataclass(frozen=True)
class SpokenPhrase:
    index: int
    text: str
    audio: np.ndarray  # mono float32 at `sample_rate_hz`
    sample_rate_hz: int
    start_s: float  # in the reply's timeline

    @property
    def end_s(self) -> float:
        return self.start_s + self.audio.size / self.sample_rate_hz

    @property
    def cue(self) -> Cue:
        return Cue(round(self.start_s, 3), round(self.end_s, 3), self.text)


class ReplySpeaker:
    """Synthesizes phrases in order; each starts where the previous one's audio ended."""

    def __init__(self, synthesizer: PiperSynthesizer, sample_rate_hz: int = 0) -> None:
        self.synthesizer = synthesizer
        self.sample_rate_hz = sample_rate_hz or synthesizer.sample_rate_hz
        self._next_index = 0
        self._next_start_s = 0.0

    def speak(self, text: str) -> SpokenPhrase:
        audio = self.synthesizer.synthesize(text, self.sample_rate_hz)
        phrase = SpokenPhrase(self._next_index, text, audio, self.sample_rate_hz, self._next_start_s)
        self._next_index += 1
        self._next_start_s = phrase.end_s
        return phrase
