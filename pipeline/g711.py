"""G.711 µ-law and A-law (ITU-T G.711), the 8-bit telephone codings that voice protocols carry
beside 16-bit PCM (Riva's MULAW and ALAW, the Realtime API's `audio/pcmu` and `audio/pcma`).

Coded by FFmpeg's `pcm_mulaw` / `pcm_alaw` through PyAV, which specvox already ships for media
files (the same tables as the standard's; no hand-written companding). Each byte is one sample
on its own, so a stream converts chunk by chunk with no state between chunks.
"""

from __future__ import annotations

from typing import Literal, cast

import av
import numpy as np
from av.audio.codeccontext import AudioCodecContext

Law = Literal["mulaw", "alaw"]
_RATE_HZ = 8_000  # the codecs need a rate; a sample's coding does not depend on it


def decode(data: bytes, law: Law) -> bytes:
    """G.711 bytes → mono 16-bit little-endian PCM (two bytes a sample)."""
    if not data:
        return b""
    decoder = cast(AudioCodecContext, av.CodecContext.create(f"pcm_{law}", "r"))
    decoder.sample_rate, decoder.layout = _RATE_HZ, "mono"
    frames = decoder.decode(av.Packet(data))
    return b"".join(frame.to_ndarray().astype("<i2").tobytes() for frame in frames)


def encode(pcm_s16le: bytes, law: Law) -> bytes:
    """Mono 16-bit little-endian PCM → G.711 bytes (one a sample)."""
    samples = np.frombuffer(pcm_s16le, "<i2")
    if samples.size == 0:
        return b""
    encoder = cast(AudioCodecContext, av.CodecContext.create(f"pcm_{law}", "w"))
    encoder.sample_rate, encoder.layout, encoder.format = _RATE_HZ, "mono", "s16"
    frame = av.AudioFrame.from_ndarray(samples.astype(np.int16)[None, :], format="s16", layout="mono")
    frame.sample_rate = _RATE_HZ
    return b"".join(bytes(packet) for packet in [*encoder.encode(frame), *encoder.encode(None)])
