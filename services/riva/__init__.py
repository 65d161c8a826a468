"""NVIDIA Riva's speech protocols (`nvidia.riva.asr`, `nvidia.riva.tts`) over the asr and tts
stages, for the clients that already speak them (nvidia-riva-client, Pipecat's NvidiaSTTService
and NvidiaTTSService). The servicer bases are the `nvidia-riva-client` wheel's generated code
(MIT); each servicer only converts Riva's messages to the stage's own calls and back.
"""

from __future__ import annotations

from riva.client.proto import riva_audio_pb2

from pipeline import g711

AudioEncoding = riva_audio_pb2.AudioEncoding
G711_LAWS: dict[int, g711.Law] = {AudioEncoding.MULAW: "mulaw", AudioEncoding.ALAW: "alaw"}
SERVED_ENCODINGS = "LINEAR_PCM, MULAW or ALAW"


def encoding_name(encoding: int) -> str:
    """The enum's name ("OGGOPUS"), or the number where the wheel knows no such value."""
    try:
        return AudioEncoding.Name(encoding)
    except ValueError:
        return str(encoding)


def check_encoding(encoding: int) -> None:
    """ValueError (INVALID_ARGUMENT) for an encoding specvox does not code: FLAC, OGGOPUS, unknown."""
    if encoding not in (AudioEncoding.LINEAR_PCM, *G711_LAWS):
        raise ValueError(f"encoding {encoding_name(encoding)} is not served here: use {SERVED_ENCODINGS}")


def language_of(language_code: str) -> str:
    """Riva's BCP-47 code ("en-US") as whisper names the language ("en"); "" stays "" (the model's default)."""
    return language_code.split("-")[0].split("_")[0].lower()
