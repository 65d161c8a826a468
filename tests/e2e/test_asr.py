"""End-of-speech detection and transcription on real synthesized speech."""

from __future__ import annotations

import time

import jiwer
import numpy as np
import pytest

from pipeline.asr import (
    SAMPLE_RATE_HZ,
    VAD_WINDOW,
    AsrOptions,
    SileroProbabilities,
    Transcriber,
    UtteranceSegmenter,
    VoiceEnded,
    VoiceStarted,
    VoiceTracker,
    silence_threshold,
    speech_spans,
)
from pipeline.asr_stream import spoken_words
from pipeline.asr_words import utterance_words


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
        # As the streaming recognizer takes them: without words whisper adds to the silence after.
        words = transcriber.transcribe(utterance).words
        spoken = spoken_words(words, utterance, True, AsrOptions().tail_min_probability)
        text = "".join(w.text for w in spoken)
        assert jiwer.wer(_norm(reference), _norm(text)) < 0.1, text
        starts = [w.start_s for w in spoken]
        assert starts == sorted(starts)
        assert utterance.audio_start_s <= starts[0] and spoken[-1].end_s <= audio.size / SAMPLE_RATE_HZ


def test_a_pass_encodes_the_audio_once_with_silence_after_it(speech, transcriber):
    """One encode per pass (faster-whisper's transcribe went on to a second window over the padding),
    of the audio's features and then those of digital silence up to whole seconds, at least
    encoder_min_s: the value Whisper's own padding has (~-1 after its scaling), not faster-whisper's 0."""
    closed, at_end = stream(UtteranceSegmenter(AsrOptions()), speech("Can you recommend a good book?"))
    utterance = (closed + at_end)[0]
    encoded: list[np.ndarray] = []
    encode = transcriber.model.encode
    transcriber.model.encode = lambda features: encoded.append(features) or encode(features)  # runs the real one
    try:
        ours = transcriber.transcribe(utterance)
    finally:
        del transcriber.model.encode
    assert len(encoded) == 1 and _norm(ours.text) == "can you recommend a good book"
    features = encoded[0]  # [80 mels, frames]
    audio_frames = utterance.audio.size // 160
    assert features.shape == (80, max(400, -(-(audio_frames + 100) // 100) * 100))
    silence = features[:, audio_frames + 2 :]  # past the last frame the audio's window reaches
    assert silence.size and np.all(silence == silence.flat[0]) and silence.flat[0] < -0.5
    assert np.all(features[:, :audio_frames] >= silence.flat[0])


@pytest.mark.parametrize("voice", ["speech", "espeak"])
def test_a_short_utterance_is_written_once(request, transcriber, voice):
    """Given zero features after the audio and no timestamps, whisper tiny said a short utterance
    again and again, the copies timed inside the speech ("Stop... Stop... Stop...", "Hello Hello
    Hello Hello Hello"): now the words kept say it once (a copy crammed into the end of the speech,
    which whisper still writes at times, goes with spoken_words)."""
    for said in ("Stop.", "Yes.", "Hello?", "Thank you very much."):
        closed, at_end = stream(UtteranceSegmenter(AsrOptions()), request.getfixturevalue(voice)(said))
        utterance = (closed + at_end)[0]
        words = utterance_words(transcriber.transcribe(utterance), utterance, AsrOptions())
        assert _norm("".join(w.text for w in words)) == _norm(said)


def test_features_keep_the_other_threads_idle(speech, transcriber):
    """faster-whisper's mel projection is a BLAS matrix product that left OpenBLAS's threads
    spinning through the rest of each pass; with a transcriber loaded, BLAS runs on one thread."""
    audio = speech("Can you recommend a good book for a long train ride?")
    features = transcriber.model.feature_extractor
    time.sleep(0.5)  # threads that earlier work woke (the voice, say) go back to sleep
    process_s, thread_s = time.process_time(), time.thread_time()
    for _ in range(20):
        features(audio)
    thread_s = time.thread_time() - thread_s
    assert time.process_time() - process_s - thread_s < 0.25 * thread_s  # CPU time of the process's other threads


def test_streamed_vad_probabilities_and_spans_equal_faster_whispers_whole_buffer_pass(speech):
    from faster_whisper.vad import VadOptions, get_speech_timestamps, get_vad_model

    gap = np.zeros(SAMPLE_RATE_HZ, np.float32)
    audio = np.concatenate([gap, speech("Good morning."), gap, speech("Thank you very much."), gap])
    audio = audio[: audio.size // VAD_WINDOW * VAD_WINDOW]
    streamed = SileroProbabilities()
    for end in range(1600, audio.size + 1600, 1600):  # 100 ms at a time, as the segmenter sees it
        probs = streamed.extend(audio[:end])
    np.testing.assert_allclose(probs, get_vad_model()(audio).reshape(-1), atol=1e-6)
    for silence_ms in (32, 400):
        whole = get_speech_timestamps(audio, VadOptions(threshold=0.5, min_speech_duration_ms=200,
                                                        min_silence_duration_ms=silence_ms, speech_pad_ms=0))
        assert speech_spans(probs, audio.size, 0.5, 200, silence_ms, 0.35) == whole
        assert len(whole) >= 2


def test_an_open_utterances_audio_stops_the_reuse_margin_after_the_last_speech(speech):
    segmenter = UtteranceSegmenter(AsrOptions(end_of_speech_silence_ms=1000))
    audio = np.concatenate([speech("Good morning to you"), np.zeros(8000, np.float32)])
    closed = [u for i in range(0, audio.size, 1600) for u in segmenter.feed(audio[i : i + 1600])]
    utterance = segmenter.open_utterance()
    assert closed == [] and utterance is not None  # 0.9 s of silence so far: still open
    audio_end_s = utterance.audio_start_s + utterance.audio.size / SAMPLE_RATE_HZ
    assert audio_end_s == pytest.approx(utterance.speech_end_s + AsrOptions().final_reuse_margin_ms / 1000, abs=0.001)
    assert segmenter.stream_s - audio_end_s > 0.5


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
    closed, at_end = stream(UtteranceSegmenter(AsrOptions()), speech("Thank you very much."))
    utterance = (closed + at_end)[0]
    for language in ("en", ""):  # given, or left to the model
        # As the streaming recognizer takes them: whisper may say the utterance once more into the
        # silence after it (it did on an AVX2 CPU), every repeated word at the end of the speech.
        words = transcriber.transcribe(utterance, language).words
        spoken = spoken_words(words, utterance, True, AsrOptions().tail_min_probability)
        assert _norm("".join(w.text for w in spoken)) == "thank you very much"


def window_s(windows: int) -> float:
    return windows * VAD_WINDOW / SAMPLE_RATE_HZ


def track(probs, utterance_starts=(), options=AsrOptions(), per_check: int = 1, finish: bool = False):
    """VoiceTracker over window probabilities, `per_check` new windows at each VAD check."""
    tracker, probs, events = VoiceTracker(options), np.asarray(probs, np.float32), []
    for end in range(per_check, probs.size + per_check, per_check):
        events += tracker.update(probs[:end], 0, utterance_starts, window_s(min(end, probs.size)))
    return events + (tracker.finish(window_s(probs.size)) if finish else [])


def test_voice_is_reported_once_two_windows_are_voiced_and_its_end_once_silence_closes_it():
    quiet = [0.0] * 8
    assert track([0.0, 0.9, 0.1, *quiet]) == []  # one 32 ms window: a click, not voice_start_ms of voice
    # two voiced windows: reported when the second is heard; closed by 150 ms below 0.35 (the 6th
    # silent window's start is 160 ms after the silence began, as speech_spans closes a span)
    assert track([0.0, 0.9, 0.9, *quiet]) == [VoiceStarted(window_s(1), window_s(3)), VoiceEnded(window_s(9))]
    # a window between the thresholds neither ends the voice nor adds to it; 96 ms of silence joins two halves
    assert track([0.9, 0.4, 0.9, 0.1, 0.1, 0.1, 0.9, *quiet]) == [VoiceStarted(0.0, window_s(3)),
                                                                    VoiceEnded(window_s(13))]
    assert track([0.9, 0.9, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.9, 0.9]) == [
        VoiceStarted(0.0, window_s(2)), VoiceEnded(window_s(8)), VoiceStarted(window_s(8), window_s(10))]
    assert track([0.9, 0.9, 0.9], finish=True)[-1] == VoiceEnded(window_s(3))  # the stream ended inside it
    assert track([0.9, 0.9, 0.9], options=AsrOptions(voice_start_ms=96)) == [VoiceStarted(0.0, window_s(3))]


def test_the_voice_of_an_utterance_is_reported_first_and_never_ended():
    starts = [VAD_WINDOW]  # an utterance (as the segmenter found it) begins with the voice: reported at once
    assert track([0.0, 0.9, 0.9, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], starts) == [VoiceStarted(window_s(1), window_s(2))]
    assert track([0.0, 0.9, 0.9, 0.0], starts, finish=True) == [VoiceStarted(window_s(1), window_s(2))]
    # a check that sees all of it at once: the voice first, its end never, whatever the voice_start_ms
    events = track([0.0, 0.9, *[0.0] * 8], starts, AsrOptions(voice_start_ms=500), per_check=10)
    assert events == [VoiceStarted(window_s(1), window_s(10))]


def test_a_dip_under_the_silence_threshold_ends_the_speech():
    """A 320 ms dip to probability 0.3 between two voiced stretches: silence where the silence threshold is
    the service's at vad_threshold 0.5 (0.35), speech at vad_threshold 0.35 with Silero's own hysteresis
    (0.2), and silence again where a stream keeps 0.35 as its silence threshold (vad_silence_threshold)."""
    probs = np.array([0.9] * 10 + [0.3] * 10 + [0.9] * 10 + [0.02] * 10, np.float32)
    size = probs.size * VAD_WINDOW
    spans = {}
    for name, options in {"0.5": AsrOptions(), "0.35": AsrOptions(vad_threshold=0.35),
                          "0.35, silence 0.35": AsrOptions(vad_threshold=0.35, vad_silence_threshold=0.35)}.items():
        spans[name] = [(s["start"] // VAD_WINDOW, s["end"] // VAD_WINDOW) for s in speech_spans(
            probs, size, options.vad_threshold, 200, 150, silence_threshold(options))]
    assert spans == {"0.5": [(0, 10), (20, 30)], "0.35": [(0, 30)], "0.35, silence 0.35": [(0, 10), (20, 30)]}


def test_voice_spans_are_the_spans_speech_is_found_in():
    """On random probabilities, seen a few windows per check: every span speech_spans finds (any
    length) with voice_start_ms of voice is reported once, and ended unless it holds speech."""
    rng = np.random.default_rng(3)
    options = AsrOptions()
    for _ in range(200):
        levels = rng.choice([0.02, 0.4, 0.9], size=rng.integers(5, 60), p=[0.5, 0.1, 0.4])
        probs = np.repeat(levels, rng.integers(1, 5, levels.size)).astype(np.float32)
        size = probs.size * VAD_WINDOW
        utterances = [s["start"] for s in speech_spans(probs, size, 0.5, options.speech_start_ms, 150, 0.35)]
        events = track(probs, utterances, options, per_check=int(rng.integers(1, 5)), finish=True)
        expected = []
        for span in speech_spans(probs, size, 0.5, 0, 150, 0.35):
            span_windows = probs[span["start"] // VAD_WINDOW : span["end"] // VAD_WINDOW]
            last_voiced = span["start"] + (np.flatnonzero(span_windows >= 0.5)[-1] + 1) * VAD_WINDOW
            if span["start"] in utterances or last_voiced - span["start"] >= 1024:
                expected.append(("started", span["start"] / SAMPLE_RATE_HZ))
                if span["start"] not in utterances:
                    expected.append(("ended", None))
        got = [("started", e.speech_start_s) if isinstance(e, VoiceStarted) else ("ended", None) for e in events]
        assert got == expected, (probs.tolist(), utterances)


def test_a_clipped_word_and_its_silence_are_voice_not_speech(speech):
    """150 ms of a word: six voiced windows, and Silero's own trailing windows; followed by silence.
    Measured to where its silence began (as a closed span is), it is not speech_start_ms long, so no
    utterance opens (counting the silence of a still-open span, as speech_spans does, it would)."""
    word = speech("Yeah")
    begin = int(np.argmax(np.abs(word) > 0.01))
    audio = np.concatenate([np.zeros(SAMPLE_RATE_HZ // 2, np.float32), word[begin : begin + 2400],
                            np.zeros(SAMPLE_RATE_HZ, np.float32)])
    segmenter = UtteranceSegmenter(AsrOptions())
    active, voice = [], []
    for i in range(0, audio.size, 320):  # 20 ms chunks
        assert segmenter.feed(audio[i : i + 320]) == []
        active.append(segmenter.speech_active)
        voice += segmenter.voice_events
    assert segmenter.finish() == [] and not any(active)
    assert [type(e) for e in voice] == [VoiceStarted, VoiceEnded]
    assert 0.5 <= voice[0].speech_start_s < 0.6 and voice[0].heard_s < 0.65


def _norm(text: str) -> str:
    return "".join(c for c in text.lower() if c.isalnum() or c.isspace()).strip()


def test_whisper_base_is_an_asr_model_setting(speech):
    """asr.model=base: the multilingual whisper base from its two packages (the asr-base extra), joined
    once into the model cache, loads and transcribes; it takes languages tiny.en refuses."""
    import importlib.util

    from pipeline.models import WHISPER_BASE_PARTS, resolve_asr

    if not all(importlib.util.find_spec(module) for module, _, _ in WHISPER_BASE_PARTS):
        pytest.skip("whisper base is not installed: pip install -e '.[asr-base]'")
    folder = resolve_asr("base")
    assert resolve_asr("base") == folder  # joined once, found again
    options = AsrOptions(model="base")
    base = Transcriber(options)
    assert base.check_language("de") == "de" and base.model.model.is_multilingual
    closed, at_end = stream(UtteranceSegmenter(options), speech("Can you recommend a good book?"))
    utterance = (closed + at_end)[0]
    words = utterance_words(base.transcribe(utterance), utterance, options)
    assert _norm("".join(w.text for w in words)) == "can you recommend a good book"
