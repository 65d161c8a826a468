"""End-of-speech detection and transcription on real synthesized speech."""

from __future__ import annotations

import jiwer
import numpy as np
import pytest

from pipeline.asr import SAMPLE_RATE_HZ, AsrOptions, Transcriber, UtteranceSegmenter


@pytest.fixture(scope="module")
def transcriber():
    return Transcriber(AsrOptions())


def stream(segmenter: UtteranceSegmenter, audio: np.ndarray, chunk_s: float = 0.1):
    step = int(chunk_s * SAMPLE_RATE_HZ)
    closed = []
    for i in range(0, audio.size, step):
        closed += segmenter.feed(audio[i : i + step])
    return closed, segmenter.finish()


def test_two_utterances_are_closed_by_silence_and_transcribed(speech, transcriber):
    first, second = "What is the capital of France?", "Thank you very much."
    gap = np.zeros(SAMPLE_RATE_HZ, np.float32)
    audio = np.concatenate([speech(first), gap, speech(second), gap])
    closed, at_end = stream(UtteranceSegmenter(AsrOptions()), audio)
    assert len(closed) == 2 and at_end == []  # both closed by silence, not by the stream's end
    assert closed[0].speech_end_s < closed[1].speech_start_s
    for utterance, reference in zip(closed, (first, second), strict=True):
        transcript = transcriber.transcribe(utterance)
        assert jiwer.wer(_norm(reference), _norm(transcript.text)) < 0.1, transcript.text
        starts = [w.start_s for w in transcript.words]
        assert starts == sorted(starts)
        assert utterance.audio_start_s <= starts[0] and transcript.words[-1].end_s <= audio.size / SAMPLE_RATE_HZ


def test_speech_cut_off_by_the_end_of_the_stream_still_closes(speech):
    audio = speech("Good morning to you")[: -int(0.4 * SAMPLE_RATE_HZ)]  # no trailing silence
    closed, at_end = stream(UtteranceSegmenter(AsrOptions()), audio)
    assert closed == [] and len(at_end) == 1


def test_silence_closes_nothing_and_memory_stays_bounded():
    segmenter = UtteranceSegmenter(AsrOptions())
    closed, at_end = stream(segmenter, np.zeros(10 * SAMPLE_RATE_HZ, np.float32))
    assert closed == [] and at_end == []
    assert segmenter._buffer.size <= 2 * SAMPLE_RATE_HZ


def test_a_streams_language_must_be_one_the_model_knows(speech, transcriber):
    assert transcriber.check_language("en") == "en" and transcriber.check_language("") == ""
    with pytest.raises(ValueError, match="English-only"):  # tiny.en, the bundled model
        transcriber.check_language("de")
    with pytest.raises(ValueError, match="English-only"):
        Transcriber(AsrOptions(language="fr"))  # a misconfigured service fails at start, not per turn
    closed, _ = stream(UtteranceSegmenter(AsrOptions()), speech("Thank you very much."))
    for language in ("en", ""):  # given, or left to the model
        assert _norm(transcriber.transcribe(closed[0], language).text) == "thank you very much"


def _norm(text: str) -> str:
    return "".join(c for c in text.lower() if c.isalnum() or c.isspace()).strip()
