"""pipeline/media.py on files made here with PyAV: every kind decodes to 16 kHz mono float32 with its sound at
the right time and pitch, in bounded chunks; a file that cannot be captioned is refused with a message that
says why (not media, empty, corrupt, no audio stream, too long)."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.media import (
    SAMPLE_RATE_HZ,
    MediaAudio,
    MediaTooLong,
    NoAudioStream,
    UnreadableMedia,
    decode_file,
)
from tests.media_files import KINDS, write_media, write_silent_video

RATE = SAMPLE_RATE_HZ
TONE_AT_S, TONE_S, TOTAL_S = 1.0, 0.5, 2.5
TIMING_TOLERANCE_S = 0.02  # a codec's frame and priming handling must not shift the timeline more than this


def tone_file_audio(hz: float = 440.0, at_s: float = TONE_AT_S) -> np.ndarray:
    """Silence with one tone of `TONE_S` at `at_s`."""
    audio = np.zeros(int(TOTAL_S * RATE), np.float32)
    t = np.arange(int(TONE_S * RATE)) / RATE
    audio[int(at_s * RATE) : int(at_s * RATE) + t.size] = 0.5 * np.sin(2 * np.pi * hz * t)
    return audio


def onset_s(audio: np.ndarray, threshold: float = 0.1) -> float:
    return float(np.argmax(np.abs(audio) > threshold)) / RATE


def packet_position(path, at_s: float) -> int:
    """The byte offset in the file of the first audio packet at or after `at_s`."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.audio[0]
        return next(p.pos for p in container.demux(stream) if p.pts is not None and p.pts * stream.time_base >= at_s)


def pitch_hz(audio: np.ndarray) -> float:
    spectrum = np.abs(np.fft.rfft(audio))
    return float(np.argmax(spectrum)) * RATE / audio.size


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_decodes_to_16khz_mono_with_its_tone_in_place(tmp_path, kind):
    path = write_media(tmp_path / f"tone.{kind}", tone_file_audio(440.0))
    with MediaAudio(path) as media:
        assert media.info.duration_s == pytest.approx(TOTAL_S, abs=0.05)
        assert media.info.video == (KINDS[kind][3] is not None)
        audio = np.concatenate(list(media.chunks()))
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert audio.size / RATE == pytest.approx(TOTAL_S, abs=0.05)
    assert onset_s(audio) == pytest.approx(TONE_AT_S, abs=TIMING_TOLERANCE_S)
    tone = audio[int((TONE_AT_S + 0.05) * RATE) : int((TONE_AT_S + TONE_S - 0.05) * RATE)]
    assert pitch_hz(tone) == pytest.approx(440.0, abs=5.0)
    assert np.sqrt(np.mean(tone**2)) == pytest.approx(0.5 / np.sqrt(2), rel=0.1)  # level kept (lossy codecs too)


def test_stereo_is_mixed_down_as_the_mean_of_its_channels(tmp_path):
    left, right = tone_file_audio(440.0), tone_file_audio(440.0) * 0.0
    audio = decode_file(write_media(tmp_path / "stereo.flac", np.stack([left, right]), channels=2))
    tone = audio[int((TONE_AT_S + 0.05) * RATE) : int((TONE_AT_S + TONE_S - 0.05) * RATE)]
    assert np.sqrt(np.mean(tone**2)) == pytest.approx(0.5 / np.sqrt(2) / 2, rel=0.05)  # not summed, not one side


def test_chunks_are_bounded_and_join_into_the_whole(tmp_path):
    path = write_media(tmp_path / "tone.mp3", tone_file_audio())
    with MediaAudio(path) as media:
        chunks = list(media.chunks(chunk_s=0.5))
    sizes = [c.size for c in chunks]
    assert len(chunks) >= 4
    assert all(0.5 * RATE <= s <= 0.5 * RATE + 4096 for s in sizes[:-1])  # a chunk and at most one frame's worth
    assert 0 < sizes[-1] <= 0.5 * RATE + 4096
    np.testing.assert_array_equal(np.concatenate(chunks), decode_file(path))


def test_a_damaged_packet_in_the_middle_keeps_later_sound_in_place(tmp_path, caplog):
    """Bytes overwritten inside an MP4's audio: the packets that do not decode are skipped (with a warning)
    and their time kept as silence, so the tone after them is still where it was."""
    path = write_media(tmp_path / "tone.mp4", tone_file_audio(440.0, at_s=2.0), video_frames=0)
    data = bytearray(path.read_bytes())
    at = packet_position(path, 1.0)
    data[at : at + 200] = np.random.default_rng(0).integers(0, 256, 200, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(data))
    audio = decode_file(path)
    assert onset_s(audio[int(1.5 * RATE) :]) + 1.5 == pytest.approx(2.0, abs=TIMING_TOLERANCE_S)
    assert audio.size / RATE == pytest.approx(TOTAL_S, abs=0.05)
    assert "damaged" in caplog.text


@pytest.mark.parametrize(("name", "content", "says"), [
    ("noise.mp3", np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes(), "not a media file"),
    ("notes.wav", b"These are my meeting notes, not a recording.\n" * 20, "not a media file"),
    ("empty.wav", b"", "empty"),
])
def test_what_is_not_media_is_refused_with_its_reason(tmp_path, name, content, says):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(UnreadableMedia, match=says) as refused:
        MediaAudio(path)
    assert name in str(refused.value)


def test_a_missing_file_is_refused(tmp_path):
    with pytest.raises(UnreadableMedia, match="no such file"):
        MediaAudio(tmp_path / "nowhere.wav")


def test_a_video_without_audio_is_refused(tmp_path):
    with pytest.raises(NoAudioStream, match="no audio stream") as refused:
        MediaAudio(write_silent_video(tmp_path / "silent.mp4"))
    assert "video" in str(refused.value)


def test_a_file_longer_than_the_limit_is_refused_before_decoding_and_allowed_with_a_higher_one(tmp_path):
    path = write_media(tmp_path / "long.flac", tone_file_audio())
    with pytest.raises(MediaTooLong, match=r"2\.5 s of audio is longer than the limit of 2\.0 s"):
        MediaAudio(path, max_duration_s=2.0)
    with MediaAudio(path, max_duration_s=float("inf")) as media:
        assert sum(c.size for c in media.chunks()) == pytest.approx(TOTAL_S * RATE, abs=0.05 * RATE)
