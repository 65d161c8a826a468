"""What every speech backend offers the tts stage, and choosing one from the settings.

A backend turns one phrase of text into audio, in one or more pieces (Piper decodes each
sentence a few frames at a time; a streaming model such as XTTS yields several as it
goes). Word timings come with a piece when the backend can align its own output (Piper's
phoneme widths); otherwise the speaker places words in proportion within the phrase. Visemes
come with the piece they start in: from the same widths (Piper), or spread over the sentence in
proportion to its phonemes and marked approximate (Coqui); see pipeline/tts/visemes.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pipeline.tts.visemes import Viseme

BACKENDS = ("piper", "coqui")


@dataclass(frozen=True)
class TtsOptions:
    backend: str = "piper"  # piper or coqui
    voice: str = "bundled"  # piper: the bundled en_US-joe-medium, or a Piper .onnx path
    # coqui: a model name known to the TTS package (e.g. tts_models/en/ljspeech/vits), or a local
    # checkpoint with its config (coqui_model = the checkpoint path, coqui_config = config.json).
    coqui_model: str = ""
    coqui_config: str = ""
    coqui_speaker: str = ""  # multi-speaker models: the speaker's name
    coqui_language: str = ""  # multilingual models (XTTS): the language code
    device: str = "cpu"  # where the model runs (cuda for a GPU)
    use_cuda: bool = False  # piper: run the ONNX model with CUDA
    # onnxruntime (piper) or torch (coqui) intra-op threads; 0: one per core. On a quiet 2-core
    # machine two threads synthesize 2.4x faster than one (RTF 0.08 against 0.19); when the
    # cores are saturated by other work one thread did slightly better (docs/benchmarks/history.md).
    threads: int = 0
    # The voice's generator and phoneme-width noise; None keeps the voice's own. 0 makes synthesis
    # deterministic (the tests use that, so their speech is the same on every run).
    noise_scale: float | None = None
    noise_w_scale: float | None = None


@dataclass(frozen=True)
class WordTiming:
    text: str
    start_s: float  # from the piece's start; before it (negative) for a word begun in an earlier piece
    end_s: float  # within the piece: a word comes with the piece it ends in


@dataclass(frozen=True)
class Synthesis:
    """One piece of a phrase's audio."""

    audio: np.ndarray  # mono float32 at sample_rate_hz
    sample_rate_hz: int
    words: tuple[WordTiming, ...] | None = None  # None: the backend cannot align its output
    visemes: tuple[Viseme, ...] = ()  # those that start in this piece, timed from its start


class Synthesizer(Protocol):
    name: str
    sample_rate_hz: int  # the voice's own rate

    def warm_up(self) -> None: ...

    def stream(self, text: str, after_s: float = 0.0) -> Iterator[Synthesis]:
        """The audio of `text` in pieces, in order, as soon as each exists (blocking).

        `after_s`: how much of the reply's audio is out before this text. A backend that
        chooses its pieces makes them larger the more there is: only audio the listener
        is about to run out of is worth the cost of many small pieces.
        """
        ...

    def synthesize(self, text: str, sample_rate_hz: int = 0) -> np.ndarray:
        """The whole audio of `text`, mono float32 at `sample_rate_hz` (0: the voice's rate)."""
        ...

