"""What a phrase says aloud, word by word; words timed by the voice's alignment or in proportion."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from pipeline.audio import resample
from pipeline.captions import CaptionTrack, Cue
from pipeline.tts.piper_backend import MAX_PIECE_FRAMES, phoneme_word_spans
from pipeline.tts.speaker import ReplySpeaker
from pipeline.tts.speech_text import speech_text


@pytest.mark.parametrize(("written", "said"), [
    ("It costs $1,200.50 today.", "It costs one thousand two hundred dollars and fifty cents today."),
    ("About 15% of them,", "About fifteen percent of them,"),
    ("On May 21st, 2024 at 3:05 pm", "On May twenty first, twenty twenty four at three oh five P M"),
    ("Dr. Smith & Mr. Jones", "doctor Smith and mister Jones"),
    ("It was -3.5 or 30°C", "It was minus three point five or thirty degrees Celsius"),
    ("Meet at 12:00.", "Meet at twelve o'clock."),
    ("Plain words, as written!", "Plain words, as written!"),
])
def test_numbers_symbols_and_abbreviations_are_said_in_words(written, said):
    assert speech_text(written).spoken == said


def test_each_written_word_keeps_the_words_said_for_it():
    words = speech_text("Pay $1,200 — now.").words
    assert [w.text for w in words] == ["Pay", "$1,200 —", "now."]
    assert words[1].spoken == ("one", "thousand", "two", "hundred", "dollars")


def test_punctuation_alone_says_nothing():
    assert speech_text("... — !!!").words == ()


def test_words_are_the_runs_of_phonemes_between_separators_pauses_excluded():
    # Piper's alignment: ^ (start), phonemes with their samples, $ (end)
    alignment = [("^", 100), ("h", 10), ("ˈ", 5), ("a", 20), (",", 50), (" ", 30), ("j", 10), ("o", 15),
                 (".", 40), ("$", 60)]
    assert phoneme_word_spans(alignment) == [(100, 135), (215, 240)]


def test_piper_times_every_word_from_its_phoneme_alignment(synthesizer):
    said = speech_text("Well, I paid $40 for it.")
    pieces = list(synthesizer.stream(said.spoken))
    starts_s = np.cumsum([0, *(p.audio.size for p in pieces)]) / synthesizer.sample_rate_hz
    timed = [(w.text, start_s + w.start_s, start_s + w.end_s)
             for piece, start_s in zip(pieces, starts_s, strict=False) for w in piece.words or ()]
    assert [text for text, _, _ in timed] == said.spoken_words
    assert all(0 <= a[1] < a[2] <= b[1] < b[2] <= starts_s[-1] for a, b in pairwise(timed))
    # a word comes with the piece its audio ends in
    assert all(0 < w.end_s <= p.audio.size / synthesizer.sample_rate_hz for p in pieces for w in p.words or ())


def test_piper_decodes_a_sentence_in_pieces_that_join_into_its_whole_audio(synthesizer):
    """The first piece is short (it is what the listener waits for); the pieces add up to Piper's own decode."""
    from piper import PiperVoice
    from piper.config import SynthesisConfig

    from pipeline.models import resolve_piper_voice

    text = "The first piece of this rather long sentence is out well before the rest of it is decoded."
    pieces = list(synthesizer.stream(text))
    assert len(pieces) >= 3
    assert pieces[0].audio.size / synthesizer.sample_rate_hz <= 0.2
    assert all(a.audio.size < b.audio.size for a, b in pairwise(pieces[:-1]))
    whole = SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0, normalize_audio=False)  # as the fixture's voice
    files = resolve_piper_voice("bundled")
    stock_voice = PiperVoice.load(files.model_path, files.config_path)  # the graph run whole
    [stock] = [c.audio_float_array for c in stock_voice.synthesize(text, whole)]
    stock = np.clip(stock * synthesizer.gain, -1.0, 1.0)  # one gain for the voice, not one a sentence
    assert np.abs(np.concatenate([p.audio for p in pieces]) - stock).max() < 1e-4
    later = list(synthesizer.stream(text, after_s=2.0))  # with 2 s of the reply out already: no hurry,
    longest_s = MAX_PIECE_FRAMES * synthesizer.phonemizer.config.hop_length / synthesizer.sample_rate_hz
    assert len(later) >= 2 and all(p.audio.size / synthesizer.sample_rate_hz <= longest_s + 1e-6 for p in later)
    assert np.abs(np.concatenate([p.audio for p in later]) - stock).max() < 1e-4  # but pieces of at most 2 s


def test_the_voice_speaks_at_about_piper_s_own_level(synthesizer):
    """Piper scales every sentence to full scale; one gain per voice keeps its sentences near that."""
    for text in ("Sure, I can help with that.", "Bees make honey from nectar, and they store it in the hive."):
        peak = float(np.abs(synthesizer.synthesize(text)).max())
        assert 0.5 < peak <= 1.0, (text, peak)


def check_track(track: CaptionTrack, end_s: float) -> None:
    """Phrases tile the audio; words lie in order inside their phrase."""
    assert track.phrases[0].start_s == 0.0 and track.phrases[-1].end_s == pytest.approx(end_s, abs=1e-3)
    assert all(a.end_s == b.start_s for a, b in pairwise(track.phrases))
    assert all(a.end_s <= b.start_s for a, b in pairwise(track.words))
    assert all(w.start_s <= w.end_s for w in track.words)


def test_a_caption_word_spans_everything_said_for_it(synthesizer):
    speaker = ReplySpeaker(synthesizer, 16_000)
    pieces = list(speaker.speak("It costs $1,200 now."))
    words = speaker.captions.words
    assert [w.text for w in words] == ["It", "costs", "$1,200", "now."]
    amount = words[2]
    assert amount.end_s - amount.start_s > 3 * (words[1].end_s - words[1].start_s)  # five words said, one shown
    assert pieces[-1].phrase_cue == Cue(0.0, round(speaker.end_s, 3), "It costs $1,200 now.")
    check_track(speaker.captions, speaker.end_s)


def test_a_word_espeak_splits_keeps_all_of_its_audio(synthesizer):
    said = speech_text("The COVID-19 report is state-of-the-art.")
    timed = [w for piece in synthesizer.stream(said.spoken) for w in (piece.words or ())]
    assert [w.text for w in timed] == said.spoken_words  # espeak says "COVID-19" as two words
    covid = timed[1]
    assert covid.end_s - covid.start_s > 2 * (timed[0].end_s - timed[0].start_s)


def test_words_the_voice_cannot_align_are_placed_in_proportion(synthesizer):
    text = "It is a 3D x86 chip from the 1990s."  # espeak's words, in context, do not add up to the text's
    assert all(p.words is None for p in synthesizer.stream(speech_text(text).spoken))
    speaker = ReplySpeaker(synthesizer, 16_000)
    pieces = list(speaker.speak(text))
    assert not any(p.word_cues for p in pieces[:-1])  # all of them come with the phrase's end
    words = speaker.captions.words
    assert [w.text for w in words] == text.split()
    check_track(speaker.captions, speaker.end_s)
    assert words[-1].end_s == pytest.approx(speaker.end_s, abs=1e-3)
    lengths = {w.text: w.end_s - w.start_s for w in words}
    assert lengths["chip"] > lengths["a"]


def test_a_voice_graph_without_piper_s_decoder_node_runs_whole_and_still_times_words(synthesizer, monkeypatch):
    from pipeline.tts import piper_backend

    monkeypatch.setattr(piper_backend, "DECODER_INPUT_NODE", "/no/such/node")  # as a graph exported otherwise
    whole = piper_backend.PiperSynthesizer(piper_backend.TtsOptions(noise_scale=0.0, noise_w_scale=0.0))
    assert whole.model.decoder is None and whole.aligned
    text = "Well, I paid forty dollars for that."
    [piece] = list(whole.stream(text))
    assert [w.text for w in piece.words or ()] == text.split()
    assert np.abs(piece.audio - synthesizer.synthesize(text)).max() < 1e-4


def test_a_phrase_resampled_in_pieces_sounds_as_if_resampled_whole(synthesizer):
    """Pieces that join mid-word are resampled as one signal: no seam where they meet."""
    text = "The pieces of this sentence meet in the middle of its words."
    pieces = list(ReplySpeaker(synthesizer, 16_000).speak(text))
    assert len(pieces) >= 3
    whole = resample(synthesizer.synthesize(text), synthesizer.sample_rate_hz, 16_000)
    assert np.abs(np.concatenate([p.audio for p in pieces]) - whole).max() < 1e-5


def test_phrases_follow_each_other_in_the_reply_timeline(synthesizer):
    speaker = ReplySpeaker(synthesizer, 24_000)
    first = list(speaker.speak("Hello there,"))
    second = list(speaker.speak("how are you?"))
    assert first[0].start_s == 0.0 and second[0].start_s == pytest.approx(first[-1].end_s)
    assert {p.phrase_index for p in first} == {0} and {p.phrase_index for p in second} == {1}
    assert list(speaker.speak("...")) == []
    check_track(speaker.captions, speaker.end_s)
