"""The configured speech backend, loaded by name: Piper (the default) or Coqui TTS, each imported
only when chosen (Coqui runs in its own environment, see coqui_backend.py)."""

from __future__ import annotations

from pipeline.tts.backend import BACKENDS, Synthesizer, TtsOptions


def load_synthesizer(options: TtsOptions) -> Synthesizer:
    if options.backend == "piper":
        from pipeline.tts.piper_backend import PiperSynthesizer

        return PiperSynthesizer(options)
    if options.backend == "coqui":
        from pipeline.tts.coqui_backend import CoquiSynthesizer

        return CoquiSynthesizer(options)
    raise ValueError(f"unknown tts backend {options.backend!r}: choose one of {', '.join(BACKENDS)}")
