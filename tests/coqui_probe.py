"""Run the Coqui backend in the Coqui env for a test in the main env (which cannot import TTS).

  python tests/coqui_probe.py synth OUT.npz OPTIONS_JSON TEXT RATE
      loads CoquiSynthesizer with TtsOptions(**OPTIONS_JSON) and saves what the test checks:
      the whole audio, the same text's stream pieces, and the audio resampled to RATE. Each
      call starts from the same torch seed, so models that sample (XTTS) repeat themselves.
  python tests/coqui_probe.py load OPTIONS_LIST_JSON
      tries to load each TtsOptions in turn; prints a JSON list with, for each, the error a
      user would see (type and message), or the loaded backend's name and rate and a digest
      of its audio for a short text (the same voice and noise give the same digest).
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np

from pipeline.tts.backend import TtsOptions
from pipeline.tts.synthesizers import load_synthesizer

SHORT_TEXT = "Hello there."


def synth(out: str, options_json: str, text: str, rate: str) -> None:
    import torch

    synthesizer = load_synthesizer(TtsOptions(**json.loads(options_json)))
    torch.manual_seed(0)
    audio = synthesizer.synthesize(text)
    torch.manual_seed(0)
    pieces = list(synthesizer.stream(text))
    torch.manual_seed(0)
    np.savez(out, audio=audio, pieces=np.concatenate([p.audio for p in pieces]),
             piece_sizes=np.array([p.audio.size for p in pieces]),
             piece_rates=np.array([p.sample_rate_hz for p in pieces]),
             piece_words=np.array([p.words is not None for p in pieces]),
             resampled=synthesizer.synthesize(text, int(rate)), streams=getattr(synthesizer, "streams", False),
             sample_rate_hz=synthesizer.sample_rate_hz, name=synthesizer.name)


def load(options_list_json: str) -> None:
    results = []
    for options in json.loads(options_list_json):
        try:
            synthesizer = load_synthesizer(TtsOptions(**options))
            audio = synthesizer.synthesize(SHORT_TEXT)
            results.append({"name": synthesizer.name, "sample_rate_hz": synthesizer.sample_rate_hz,
                            "samples": audio.size, "sha1": hashlib.sha1(audio.tobytes()).hexdigest()})
        except Exception as error:  # the test reads the type and message
            results.append({"error": type(error).__name__, "message": str(error)})
    print(json.dumps(results))


if __name__ == "__main__":
    {"synth": synth, "load": load}[sys.argv[1]](*sys.argv[2:])
