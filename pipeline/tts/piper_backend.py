"""Piper synthesis of one phrase at a time (blocking: services run it in a thread)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from pipeline.audio import resample
from pipeline.models import resolve_piper_voice
from pipeline.tts.backend import Synthesis, TtsOptions

__all__ = ["PiperSynthesizer", "TtsOptions"]


class PiperSynthesizer:
    name = "piper"

    def __init__(self, options: TtsOptions) -> None:
        from piper import PiperVoice
        from piper.config import SynthesisConfig

        files = resolve_piper_voice(options.voice)
        self.voice = PiperVoice.load(files.model_path, config_path=files.config_path, use_cuda=options.use_cuda)
        self.sample_rate_hz = int(self.voice.config.sample_rate)
        self.config = SynthesisConfig(noise_scale=options.noise_scale, noise_w_scale=options.noise_w_scale)

    def warm_up(self) -> None:
        self.synthesize("Hello there.")

    def stream(self, text: str) -> Iterator[Synthesis]:
        """One piece per sentence, as Piper synthesizes them."""
        for chunk in self.voice.synthesize(text, self.config):
            yield Synthesis(chunk.audio_float_array.astype(np.float32), self.sample_rate_hz)

    def synthesize(self, text: str, sample_rate_hz: int = 0) -> np.ndarray:
        """Mono float32 audio of `text` at `sample_rate_hz` (0: the voice's rate)."""
        parts = [piece.audio for piece in self.stream(text)]
        audio = np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)
        return resample(audio, self.sample_rate_hz, sample_rate_hz or self.sample_rate_hz)
