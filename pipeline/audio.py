"""Audio as the stages exchange it: validated 16-bit PCM, mono float32 for models.

Every input is checked here once, so the services can turn an `AudioFormatError`
into a clear gRPC status instead of failing deep inside a model.
"""

from __future__ import annotations

import io
import struct
import wave
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import soxr

MIN_SAMPLE_RATE_HZ = 8_000
MAX_SAMPLE_RATE_HZ = 48_000
PCM_SAMPLE_WIDTH_BYTES = 2
# A WAV header bigger than this is not a header we can stream (LIST chunks are small).
MAX_WAV_HEADER_BYTES = 64 * 1024


class AudioFormatError(ValueError):
    """The bytes or the declared format are not 16-bit PCM audio we accept."""


@dataclass(frozen=True)
class PcmFormat:
    sample_rate_hz: int
    channels: int = 1
    sample_width_bytes: int = PCM_SAMPLE_WIDTH_BYTES

    def validate(self) -> PcmFormat:
        if self.sample_width_bytes != PCM_SAMPLE_WIDTH_BYTES:
            raise AudioFormatError(
                f"sample width {self.sample_width_bytes} bytes is not supported: send 16-bit PCM (2 bytes)"
            )
        if not MIN_SAMPLE_RATE_HZ <= self.sample_rate_hz <= MAX_SAMPLE_RATE_HZ:
            raise AudioFormatError(
                f"sample rate {self.sample_rate_hz} Hz is outside {MIN_SAMPLE_RATE_HZ}-{MAX_SAMPLE_RATE_HZ} Hz"
            )
        if self.channels not in (1, 2):
            raise AudioFormatError(f"{self.channels} channels: send mono or interleaved stereo")
        return self

    @property
    def frame_bytes(self) -> int:
        return self.channels * self.sample_width_bytes

    @property
    def bytes_per_s(self) -> int:
        return self.sample_rate_hz * self.frame_bytes


def pcm_to_mono_float(pcm: bytes, fmt: PcmFormat) -> np.ndarray:
    """Decode interleaved s16le bytes to mono float32 in [-1, 1)."""
    if len(pcm) % fmt.frame_bytes:
        raise AudioFormatError(
            f"{len(pcm)} bytes is not a whole number of {fmt.frame_bytes}-byte frames"
        )
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
    if fmt.channels == 2:
        samples = samples.reshape(-1, 2).mean(axis=1)
    return samples


def resample(samples: np.ndarray, from_hz: int, to_hz: int) -> np.ndarray:
    """Resample mono float32 audio with libsoxr (high quality, streaming-safe for whole buffers)."""
    if from_hz == to_hz or samples.size == 0:
        return samples.astype(np.float32, copy=False)
    return soxr.resample(samples, from_hz, to_hz).astype(np.float32, copy=False)


class StreamResampler:
    """Mono float32 audio resampled piece by piece as one signal (libsoxr's stream): no seam where pieces meet.

    The stream holds back its last few milliseconds until the next piece or `finish()`.
    """

    def __init__(self, from_hz: int, to_hz: int) -> None:
        self.stream = soxr.ResampleStream(from_hz, to_hz, 1, dtype="float32") if from_hz != to_hz else None

    def feed(self, samples: np.ndarray) -> np.ndarray:
        samples = samples.astype(np.float32, copy=False)
        return self.stream.resample_chunk(samples) if self.stream else samples

    def finish(self) -> np.ndarray:
        nothing = np.zeros(0, np.float32)
        return self.stream.resample_chunk(nothing, last=True) if self.stream else nothing


def float_to_pcm16(samples: np.ndarray) -> bytes:
    clipped = np.clip(samples, -1.0, 32767 / 32768)
    return (clipped * 32768.0).astype("<i2").tobytes()


class PcmStreamDecoder:
    """Turns a stream of byte chunks into mono float32 at a target rate.

    Holds back a trailing partial frame until its other bytes arrive, so chunk
    boundaries may fall anywhere; an odd total is reported by `finish()`.
    """

    def __init__(self, fmt: PcmFormat, target_rate_hz: int) -> None:
        self.format = fmt.validate()
        self.target_rate_hz = target_rate_hz
        self._pending = b""
        self._resampler = (
            None
            if fmt.sample_rate_hz == target_rate_hz
            else soxr.ResampleStream(fmt.sample_rate_hz, target_rate_hz, 1, dtype="float32")
        )

    def feed(self, chunk: bytes) -> np.ndarray:
        data = self._pending + chunk
        whole = len(data) - len(data) % self.format.frame_bytes
        self._pending = data[whole:]
        return self._convert(pcm_to_mono_float(data[:whole], self.format), last=False)

    def finish(self) -> np.ndarray:
        if self._pending:
            raise AudioFormatError(
                f"stream ended inside a frame: {len(self._pending)} stray byte(s); "
                f"16-bit PCM has {self.format.frame_bytes}-byte frames"
            )
        return self._convert(np.zeros(0, np.float32), last=True)

    def _convert(self, samples: np.ndarray, last: bool) -> np.ndarray:
        if self._resampler is None:
            return samples
        return self._resampler.resample_chunk(samples, last=last)


def parse_wav_header(data: bytes) -> tuple[PcmFormat, int] | None:
    """Find the format and the offset of the sample data in the first bytes of a WAV stream.

    Returns None while more bytes are needed; raises AudioFormatError for anything that
    is not PCM WAVE.
    """
    if len(data) >= 4 and data[:4] != b"RIFF":
        raise AudioFormatError("not a WAV stream: it does not start with 'RIFF'")
    if len(data) >= 12 and data[8:12] != b"WAVE":
        raise AudioFormatError("not a WAV stream: RIFF type is not 'WAVE'")
    offset, fmt = 12, None
    while len(data) >= offset + 8:
        chunk_id, size = data[offset : offset + 4], struct.unpack("<I", data[offset + 4 : offset + 8])[0]
        body = offset + 8
        if chunk_id == b"data":
            if fmt is None:
                raise AudioFormatError("WAV stream has its 'data' chunk before 'fmt '")
            return fmt, body
        if len(data) < body + size:
            break
        if chunk_id == b"fmt ":
            fmt = _parse_fmt_chunk(data[body : body + size])
        offset = body + size + (size & 1)
    if len(data) > MAX_WAV_HEADER_BYTES:
        raise AudioFormatError(f"no WAV 'data' chunk in the first {MAX_WAV_HEADER_BYTES} bytes")
    return None


def _parse_fmt_chunk(body: bytes) -> PcmFormat:
    if len(body) < 16:
        raise AudioFormatError("WAV 'fmt ' chunk is too short")
    tag, channels, rate, _, _, bits = struct.unpack("<HHIIHH", body[:16])
    if tag not in (1, 0xFFFE):  # PCM or WAVE_FORMAT_EXTENSIBLE
        raise AudioFormatError(f"WAV format tag {tag} is not PCM: send 16-bit PCM")
    return PcmFormat(sample_rate_hz=rate, channels=channels, sample_width_bytes=bits // 8).validate()


class Encoding(IntEnum):
    """How a stream's bytes are framed; the numbers are those of the protos' AudioFormat.Encoding."""

    PCM_S16LE = 1  # raw PCM in a declared format
    WAV = 2  # a RIFF/WAVE stream, its format read from its header


class AudioStreamReader:
    """Strips the framing off a byte stream: raw PCM as declared, or WAV after its header.

    `format` is known from the start for PCM and once the header is complete for WAV.
    """

    def __init__(self, encoding: int, declared: PcmFormat) -> None:
        self.format: PcmFormat | None = None
        self.bytes_received = 0
        self._header = b""
        if encoding == Encoding.PCM_S16LE:
            self.format = declared.validate()
        elif encoding != Encoding.WAV:
            raise AudioFormatError("audio encoding is unspecified: choose PCM_S16LE or WAV")

    def feed(self, chunk: bytes) -> bytes:
        """The PCM bytes in `chunk` (none while a WAV header is still incomplete)."""
        self.bytes_received += len(chunk)
        if self.format is not None:
            return chunk
        self._header += chunk
        parsed = parse_wav_header(self._header)
        if parsed is None:
            return b""
        self.format, offset = parsed
        pcm, self._header = self._header[offset:], b""
        return pcm

    def finish(self) -> None:
        if self.bytes_received == 0:
            raise AudioFormatError("the stream carried no audio")
        if self.format is None:
            raise AudioFormatError("the stream ended before a complete WAV header")


def read_wav(path: str) -> tuple[bytes, PcmFormat]:
    """Read a WAV file's PCM bytes and format, validating it like a stream."""
    with open(path, "rb") as f:
        data = f.read()
    return split_wav_bytes(data)


def split_wav_bytes(data: bytes) -> tuple[bytes, PcmFormat]:
    parsed = parse_wav_header(data)
    if parsed is None:
        raise AudioFormatError("WAV data ended before its 'data' chunk")
    fmt, offset = parsed
    pcm = data[offset:]
    return pcm[: len(pcm) - len(pcm) % fmt.frame_bytes], fmt


def wav_bytes(pcm: bytes, sample_rate_hz: int, channels: int = 1) -> bytes:
    """Wrap s16le PCM in a WAV container."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(PCM_SAMPLE_WIDTH_BYTES)
        w.setframerate(sample_rate_hz)
        w.writeframes(pcm)
    return buf.getvalue()
