import struct

import numpy as np
import pytest

from pipeline.audio import (
    AudioFormatError,
    AudioStreamReader,
    Encoding,
    PcmFormat,
    PcmStreamDecoder,
    float_to_pcm16,
    parse_wav_header,
    split_wav_bytes,
    wav_bytes,
)


def tone(hz: float, seconds: float, rate: int) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def test_stream_decoder_joins_frames_split_across_chunks():
    pcm = float_to_pcm16(tone(440, 0.1, 16_000))
    decoder = PcmStreamDecoder(PcmFormat(16_000), 16_000)
    pieces = [decoder.feed(pcm[i : i + 333]) for i in range(0, len(pcm), 333)]  # odd-sized chunks
    out = np.concatenate(pieces + [decoder.finish()])
    assert out.size == len(pcm) // 2
    np.testing.assert_allclose(out, tone(440, 0.1, 16_000), atol=1 / 16_000)


def test_stereo_is_averaged_to_mono():
    left, right = np.full(100, 0.5, np.float32), np.full(100, -0.25, np.float32)
    interleaved = np.stack([left, right], axis=1).reshape(-1)
    decoder = PcmStreamDecoder(PcmFormat(16_000, channels=2), 16_000)
    out = np.concatenate([decoder.feed(float_to_pcm16(interleaved)), decoder.finish()])
    np.testing.assert_allclose(out, 0.125, atol=1e-4)


def test_resampling_keeps_duration_and_pitch():
    decoder = PcmStreamDecoder(PcmFormat(44_100), 16_000)
    out = np.concatenate([decoder.feed(float_to_pcm16(tone(440, 1.0, 44_100))), decoder.finish()])
    assert abs(out.size - 16_000) <= 16
    peak_hz = np.argmax(np.abs(np.fft.rfft(out))) * 16_000 / out.size
    assert abs(peak_hz - 440) < 3


def test_stray_byte_at_end_of_stream_is_an_error():
    decoder = PcmStreamDecoder(PcmFormat(16_000), 16_000)
    decoder.feed(b"\x00\x01\x02")
    with pytest.raises(AudioFormatError, match="stray byte"):
        decoder.finish()


@pytest.mark.parametrize(
    "fmt, message",
    [
        (PcmFormat(16_000, sample_width_bytes=3), "sample width"),
        (PcmFormat(7), "sample rate"),
        (PcmFormat(96_000), "sample rate"),
        (PcmFormat(16_000, channels=6), "channels"),
    ],
)
def test_unsupported_formats_are_rejected(fmt, message):
    with pytest.raises(AudioFormatError, match=message):
        PcmStreamDecoder(fmt, 16_000)


def test_wav_header_round_trip_and_incremental_parse():
    data = wav_bytes(float_to_pcm16(tone(300, 0.2, 22_050)), 22_050)
    assert parse_wav_header(data[:20]) is None  # needs more bytes
    pcm, fmt = split_wav_bytes(data)
    assert fmt == PcmFormat(22_050, 1, 2)
    assert len(pcm) == int(0.2 * 22_050) * 2


def test_stream_reader_strips_a_wav_header_split_across_chunks():
    pcm = float_to_pcm16(tone(300, 0.1, 16_000))
    data = wav_bytes(pcm, 16_000)
    reader = AudioStreamReader(Encoding.WAV, PcmFormat(0))
    out = b"".join(reader.feed(data[i : i + 7]) for i in range(0, len(data), 7))
    reader.finish()
    assert out == pcm and reader.format == PcmFormat(16_000)


def test_stream_reader_rejects_empty_and_unframed_streams():
    with pytest.raises(AudioFormatError, match="no audio"):
        AudioStreamReader(Encoding.PCM_S16LE, PcmFormat(16_000)).finish()
    with pytest.raises(AudioFormatError, match="unspecified"):
        AudioStreamReader(0, PcmFormat(16_000))
    reader = AudioStreamReader(Encoding.WAV, PcmFormat(0))
    reader.feed(b"RIFF\x10\x00\x00\x00WAVE")
    with pytest.raises(AudioFormatError, match="before a complete WAV header"):
        reader.finish()


def test_non_audio_and_wrong_width_wavs_are_rejected():
    with pytest.raises(AudioFormatError, match="RIFF"):
        parse_wav_header(b"%PDF-1.7 this is not audio at all")
    fmt_8bit = struct.pack("<HHIIHH", 1, 1, 8000, 8000, 1, 8)
    wav = b"RIFF" + struct.pack("<I", 36) + b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt_8bit
    with pytest.raises(AudioFormatError, match="sample width 1"):
        parse_wav_header(wav + b"data" + struct.pack("<I", 0))
    float_fmt = struct.pack("<HHIIHH", 3, 1, 16000, 64000, 4, 32)
    wav = b"RIFF" + struct.pack("<I", 36) + b"WAVE" + b"fmt " + struct.pack("<I", 16) + float_fmt
    with pytest.raises(AudioFormatError, match="not PCM"):
        parse_wav_header(wav + b"data" + struct.pack("<I", 0))
