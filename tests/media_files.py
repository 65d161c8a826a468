"""Media files made in the tests with PyAV: audio in WAV, FLAC, MP3, and video files (a few frames) with an audio
track in MP4 (AAC), MKV and WebM (Opus), each at the rate its codec takes; a video with no audio at all."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.audio import resample

# suffix -> (FFmpeg's container, audio codec, audio rate, video codec or None)
KINDS: dict[str, tuple[str, str, int, str | None]] = {
    "wav": ("wav", "pcm_s16le", 16_000, None),
    "flac": ("flac", "flac", 44_100, None),
    "mp3": ("mp3", "libmp3lame", 22_050, None),
    "mp4": ("mp4", "aac", 44_100, "libx264"),
    "mkv": ("matroska", "libopus", 48_000, "mpeg4"),
    "webm": ("webm", "libopus", 48_000, "libvpx"),
}
VIDEO_FPS, VIDEO_SIZE = 10, (64, 48)


def write_media(path: Path, audio: np.ndarray, sample_rate_hz: int = 16_000, video_frames: int = 10,
                channels: int = 1) -> Path:
    """`audio` (mono float32, or `channels` rows) in the file kind `path`'s suffix names, with `video_frames`
    frames of video where the kind holds video."""
    import av

    container, codec, rate, video_codec = KINDS[path.suffix.lstrip(".")]
    rows = audio.reshape(channels, -1) if audio.ndim == 1 and channels > 1 else np.atleast_2d(audio)
    rows = np.stack([resample(r, sample_rate_hz, rate) for r in rows]).astype(np.float32)
    layout = "mono" if channels == 1 else "stereo"
    with av.open(str(path), "w", format=container) as out:
        stream = out.add_stream(codec, rate=rate, layout=layout)
        video = None
        if video_codec:
            video = out.add_stream(video_codec, rate=VIDEO_FPS)
            video.width, video.height = VIDEO_SIZE
            video.pix_fmt = "yuv420p"
        step = 4096
        for i in range(0, rows.shape[1], step):
            piece = np.ascontiguousarray(rows[:, i : i + step])
            frame = av.AudioFrame.from_ndarray(piece, format="fltp", layout=layout)
            frame.sample_rate, frame.pts = rate, i
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
        if video is not None:
            _write_frames(out, video, video_frames)
    return path


def write_silent_video(path: Path, frames: int = 10) -> Path:
    """A video stream only (MP4, H.264)."""
    import av

    with av.open(str(path), "w", format="mp4") as out:
        video = out.add_stream("libx264", rate=VIDEO_FPS)
        video.width, video.height = VIDEO_SIZE
        video.pix_fmt = "yuv420p"
        _write_frames(out, video, frames)
    return path


def _write_frames(out, video, frames: int) -> None:
    import av

    for k in range(frames):
        image = np.full((VIDEO_SIZE[1], VIDEO_SIZE[0], 3), (k * 25) % 256, np.uint8)
        frame = av.VideoFrame.from_ndarray(image, format="rgb24")
        frame.pts = k
        out.mux(video.encode(frame))
    out.mux(video.encode(None))
