"""The human-speech recordings (bench.human_speech): fetched from their packages, real speech that matches
its reference, and the bundled whisper hears in them what the reference says, when the reference says it."""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from bench.human_speech import CLIP_NAMES, HumanClip, load_clips, matched_words, normalised_words, wer
from pipeline.asr import Utterance


@pytest.fixture(scope="module")
def clips() -> dict[str, HumanClip]:
    return {c.name: c for c in load_clips()}  # downloads the sdists on a fresh machine (.ci/run does it first)


def test_every_clip_loads_as_16khz_mono_speech(clips):
    assert list(clips) == list(CLIP_NAMES)
    for clip in clips.values():
        audio = clip.audio
        assert clip.sample_rate == 16_000 and audio.dtype == np.float32 and audio.ndim == 1, clip.name
        frames = audio[: audio.size // 160 * 160].reshape(-1, 160)
        loud = np.sqrt(np.mean(frames**2, axis=1)) > 0.01  # 10 ms frames above -40 dBFS
        assert loud.mean() > 0.25, f"{clip.name}: {loud.mean():.0%} of it is sound"
        assert np.abs(audio).max() <= 1.0  # not clipped beyond full scale, and not a tone or a square wave:
        assert np.unique(np.round(frames[loud], 3)).size > 100, clip.name


def test_each_reference_spans_its_recording(clips):
    for clip in clips.values():
        assert normalised_words(clip.reference_text), clip.name
        assert clip.source_package.count("==") == 1 and clip.licence, clip.name
        # The audio ends within 0.5 s after the reference's last word, never before it.
        assert -0.05 <= clip.duration_s - clip.reference_end_s <= 0.5, (clip.name, clip.duration_s,
                                                                        clip.reference_end_s)
        timed = [(w.start_s, w.end_s) for w in clip.reference or ()] + [(p.start_s, p.end_s) for p in clip.phrases]
        assert all(0 <= a < b <= clip.duration_s + 0.05 for a, b in timed), clip.name
        if clip.reference is not None:
            starts = [w.start_s for w in clip.reference]
            assert starts == sorted(starts) and " ".join(w.text for w in clip.reference) == clip.reference_text
        if clip.timing != "none":
            assert clip.timed_words(), clip.name
    assert {len(c.speakers) for c in clips.values()} >= {1, 2}
    assert clips["telephone-diane-sheila"].speakers == ("Diane", "Sheila")


@pytest.mark.parametrize("name", ["telephone-diane-sheila", "mfa-acoustic-corpus"])
def test_the_bundled_whisper_hears_the_reference_at_its_times(clips, transcriber, name):
    """faster-whisper tiny.en on the whole recording (at most 30 s: whisper's one window): its words are the
    reference's (WER < 0.5; ~0.1-0.25 here) and start where the reference says they do (median within 0.3 s)."""
    clip = clips[name]
    assert clip.duration_s <= 30.0
    transcript = transcriber.transcribe(Utterance(0, 0.0, clip.duration_s, clip.audio))
    assert wer(clip.reference_text, transcript.text) < 0.5, transcript.text
    heard = [(word, w.start_s) for w in transcript.words for word in normalised_words(w.text)]
    pairs = dict(matched_words(normalised_words(clip.reference_text), [word for word, _ in heard]))
    errors = [abs(heard[pairs[i]][1] - start) for i, start in clip.timed_words() if i in pairs]
    assert len(errors) >= len(clip.timed_words()) // 2
    assert statistics.median(errors) < 0.3, errors
