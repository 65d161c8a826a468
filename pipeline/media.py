"""A media file's audio as 16 kHz mono float32, decoded piece by piece with PyAV.

PyAV ships FFmpeg in its wheel, so WAV, FLAC, MP3 and the audio track of MP4, MKV and WebM
(AAC, Opus, Vorbis, ...) decode without a system FFmpeg. `MediaAudio` opens a file and checks
it before any decoding (a file FFmpeg cannot read, no audio stream, longer than the limit) and
then yields its audio in chunks of a few seconds, so an hour of audio never sits in memory at
once. The audio is mixed down to mono as the live path does (the mean of the channels,
`pipeline.audio.pcm_to_mono_float`) and resampled with the same libsoxr stream
(`pipeline.audio.StreamResampler`), so a file and the same audio streamed live give the models
the same samples.

Damage inside a file is tolerated as FFmpeg's own command line tolerates it: a packet that
does not decode is skipped and its time filled with silence (from the next frame's timestamp),
so later words keep their place on the file's timeline; a file most of whose packets fail is
refused as corrupt.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from pipeline.audio import StreamResampler

log = logging.getLogger(__name__)

SAMPLE_RATE_HZ = 16_000  # what Whisper and Silero VAD expect (pipeline.asr.SAMPLE_RATE_HZ)
CHUNK_S = 10.0  # audio per yielded chunk
DEFAULT_MAX_DURATION_S = 3 * 3600.0  # longer files are refused unless the caller allows more
# A frame that starts this much later than the audio decoded so far ends follows a gap (a packet
# that did not decode, or a stream that starts after the file's timeline does): filled with silence.
GAP_TOLERANCE_S = 0.02
# More packets than this failing, and more than this share of those read, is a corrupt file (a damaged
# stretch is tolerated: 600 bytes overwritten in an MP4's AAC took 21 packets, half a second, with them).
BAD_PACKETS_ALLOWED, BAD_PACKET_SHARE = 100, 0.5
DAMAGE_WARNINGS = 3  # damaged packets told one by one; the rest are counted at the end


class MediaError(ValueError):
    """A file that cannot be captioned; the message says why and, where it can, what to do."""


class UnreadableMedia(MediaError):
    """Not a media file FFmpeg knows (or an empty one), or one too damaged to decode."""


class NoAudioStream(MediaError):
    """A media file without an audio stream (a silent video, an image)."""


class MediaTooLong(MediaError):
    """Longer than the limit the caller set."""


@dataclass(frozen=True)
class MediaInfo:
    path: str
    container: str  # FFmpeg's name of the format ("wav", "mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm")
    codec: str  # the audio stream's codec ("pcm_s16le", "aac", "opus", ...)
    sample_rate_hz: int
    channels: int
    duration_s: float | None  # as the file states it (an estimate for some MP3s); None: unknown
    video: bool  # the file has a video stream too


def describe_duration(seconds: float) -> str:
    """"1 h 05 min", "12 min 30 s", "4.2 s"."""
    if seconds >= 3600:
        return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"
    if seconds >= 60:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{seconds:.1f} s"


class MediaAudio:
    """One file's first audio stream. Opening checks the file (`info`); `chunks()` decodes it.

    `max_duration_s`: a file longer than this (stated, or found while decoding where the file
    does not say) raises `MediaTooLong`; math.inf: no limit. Use as a context manager, or `close()`.
    """

    def __init__(self, path: str | os.PathLike[str], max_duration_s: float = DEFAULT_MAX_DURATION_S) -> None:
        import av

        self.path = os.fspath(path)
        self.max_duration_s = max_duration_s
        if os.path.isdir(self.path):
            raise UnreadableMedia(f"{self.path}: is a folder, not a media file")
        if not os.path.exists(self.path):
            raise UnreadableMedia(f"{self.path}: no such file")
        if os.path.getsize(self.path) == 0:
            raise UnreadableMedia(f"{self.path}: the file is empty")
        try:
            self._container = av.open(self.path, metadata_errors="ignore")
        except av.error.FFmpegError as e:
            raise UnreadableMedia(f"{self.path}: not a media file FFmpeg can read, or a corrupt one "
                                  f"({_reason(e)}); give WAV, FLAC, MP3, or an MP4, MKV or WebM video") from e
        try:
            self.info = self._check()
        except BaseException:
            self._container.close()
            raise

    def _check(self) -> MediaInfo:
        container = self._container
        if not container.streams.audio:
            kinds = ", ".join(sorted({str(s.type) for s in container.streams})) or "none"
            raise NoAudioStream(f"{self.path}: no audio stream to caption (streams: {kinds})")
        stream = container.streams.audio[0]
        context = stream.codec_context
        if stream.duration is not None and stream.time_base is not None:
            duration_s: float | None = float(stream.duration * stream.time_base)
        elif container.duration is not None:
            duration_s = container.duration / 1_000_000  # AV_TIME_BASE
        else:
            duration_s = None
        info = MediaInfo(self.path, container.format.name, context.name, context.sample_rate or 0,
                         context.channels or 0, duration_s, bool(container.streams.video))
        if duration_s is not None and duration_s > self.max_duration_s:
            raise MediaTooLong(self._too_long(duration_s))
        return info

    def _too_long(self, duration_s: float, stated: bool = True) -> str:
        length = describe_duration(duration_s) if stated else f"more than {describe_duration(duration_s)}"
        return (f"{self.path}: {length} of audio is longer than the limit of "
                f"{describe_duration(self.max_duration_s)}; split the file, or raise the limit")

    def chunks(self, chunk_s: float = CHUNK_S) -> Iterator[np.ndarray]:
        """The audio from the start of the file's timeline, in pieces of about `chunk_s` (the last
        shorter). A stream that starts later than the file's timeline begins with silence."""
        import av

        stream = self._container.streams.audio[0]
        to_float: av.AudioResampler | None = None
        out = _Chunker(round(chunk_s * SAMPLE_RATE_HZ), self.max_duration_s * SAMPLE_RATE_HZ,
                       lambda: MediaTooLong(self._too_long(self.max_duration_s, stated=False)))
        resampler: StreamResampler | None = None
        rate = 0
        origin_s = (self._container.start_time or 0) / 1_000_000
        decoded_s = 0.0  # input time decoded so far (gaps included), from origin_s
        packets = bad = 0
        for packet in self._container.demux(stream):
            packets += 1
            try:
                frames = packet.decode()
            except av.error.FFmpegError as e:
                bad += 1
                if bad <= DAMAGE_WARNINGS:
                    log.warning("%s: a damaged audio packet after %.2f s skipped (%s)", self.path, decoded_s,
                                _reason(e))
                if bad > BAD_PACKETS_ALLOWED and bad > BAD_PACKET_SHARE * packets:
                    raise UnreadableMedia(f"{self.path}: corrupt: {bad} of the first {packets} audio packets "
                                          "did not decode") from e
                continue
            for frame in frames:
                if frame.sample_rate != rate:
                    if resampler is not None:  # a stream that changes rate (rare): the old rate's tail first
                        yield from out.add(resampler.finish())
                    rate, resampler = frame.sample_rate, StreamResampler(frame.sample_rate, SAMPLE_RATE_HZ)
                    to_float = av.AudioResampler(format="fltp")  # this rate and layout: one row per channel
                assert resampler is not None and to_float is not None
                gap_s = 0.0
                if frame.pts is not None and frame.time_base is not None:
                    gap_s = float(frame.pts * frame.time_base) - origin_s - decoded_s
                if gap_s > GAP_TOLERANCE_S:
                    yield from out.silence(round(gap_s * SAMPLE_RATE_HZ))
                    decoded_s += gap_s
                samples = np.concatenate([f.to_ndarray() for f in to_float.resample(frame)], axis=1)
                decoded_s += samples.shape[1] / rate
                yield from out.add(resampler.feed(samples.mean(axis=0) if samples.shape[0] > 1 else samples[0]))
        if packets and bad == packets:
            raise UnreadableMedia(f"{self.path}: corrupt: none of its {packets} audio packets decoded")
        if bad:
            log.warning("%s: %d of %d audio packets were damaged; their time is silence", self.path, bad, packets)
        if resampler is not None:
            yield from out.add(resampler.finish())
        yield from out.finish()
        stated = self.info.duration_s
        if stated is not None and out.samples / SAMPLE_RATE_HZ < stated - 1.0:
            log.warning("%s: decoded %s of the %s the file states: it may be truncated or damaged", self.path,
                        describe_duration(out.samples / SAMPLE_RATE_HZ), describe_duration(stated))

    def close(self) -> None:
        self._container.close()

    def __enter__(self) -> MediaAudio:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Chunker:
    """Pieces of audio gathered into chunks of `size` samples (the last shorter), at most `limit` in all."""

    def __init__(self, size: int, limit: float, too_long) -> None:
        self.size, self.limit, self.too_long = size, limit, too_long
        self.samples = 0  # taken in all
        self._pending: list[np.ndarray] = []
        self._pending_samples = 0

    def add(self, piece: np.ndarray) -> Iterator[np.ndarray]:
        if not piece.size:
            return
        self.samples += piece.size
        if self.samples > self.limit:
            raise self.too_long()
        self._pending.append(piece)
        self._pending_samples += piece.size
        if self._pending_samples >= self.size:
            yield from self.finish()

    def silence(self, samples: int) -> Iterator[np.ndarray]:
        """`samples` of silence, a chunk's worth at a time (a stream that starts an hour late holds no hour)."""
        while samples > 0:
            piece = min(samples, self.size)
            yield from self.add(np.zeros(piece, np.float32))
            samples -= piece

    def finish(self) -> Iterator[np.ndarray]:
        if self._pending:
            chunk = np.concatenate(self._pending).astype(np.float32, copy=False)
            self._pending, self._pending_samples = [], 0
            yield chunk


def _reason(error: Exception) -> str:
    """FFmpeg's words for an error, without the errno and the path PyAV adds."""
    return getattr(error, "strerror", None) or str(error)


def decode_file(path: str | os.PathLike[str], max_duration_s: float = DEFAULT_MAX_DURATION_S) -> np.ndarray:
    """A whole (short) file's audio at once: for tests and tools, not for hours of audio."""
    with MediaAudio(path, max_duration_s) as media:
        parts = list(media.chunks())
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)
