"""What a phrase says aloud, word by word; words timed by the voice's alignment or in proportion."""

from __future__ import annotations

from itertools import pairwise

import pytest

from pipeline.captions import CaptionTrack, Cue
from pipeline.tts.piper_backend import phoneme_word_spans
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
    timed = [w for piece in pieces for w in (piece.words or ())]
    assert [w.text for w in timed] == said.spoken_words
    duration_s = sum(p.audio.size for p in pieces) / synthesizer.sample_rate_hz
    assert all(0 <= a.start_s < a.end_s <= b.start_s <= duration_s for a, b in pairwise(timed))


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


def test_phrases_follow_each_other_in_the_reply_timeline(synthesizer):
    speaker = ReplySpeaker(synthesizer, 24_000)
    first = list(speaker.speak("Hello there,"))
    second = list(speaker.speak("how are you?"))
    assert first[0].start_s == 0.0 and second[0].start_s == pytest.approx(first[-1].end_s)
    assert {p.phrase_index for p in first} == {0} and {p.phrase_index for p in second} == {1}
    assert list(speaker.speak("...")) == []
    check_track(speaker.captions, speaker.end_s)
