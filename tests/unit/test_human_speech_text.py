"""bench.human_speech's readers and word comparison, on text made here (no download, no model)."""

from __future__ import annotations

import jiwer
import numpy as np
import pytest

from bench.human_speech import (
    HumanClip,
    RefPhrase,
    RefWord,
    matched_words,
    normalised_words,
    read_textgrid,
    word_errors,
)

LONG = '''File type = "ooTextFile"
Object class = "TextGrid"

xmin = 0
xmax = 2.5
tiers? <exists>
size = 2
item []:
    item [1]:
        class = "IntervalTier"
        name = "words"
        xmin = 0
        xmax = 2.5
        intervals: size = 3
        intervals [1]:
            xmin = 0
            xmax = 0.5
            text = ""
        intervals [2]:
            xmin = 0.5
            xmax = 1.25
            text = "say ""hi"""
        intervals [3]:
            xmin = 1.25
            xmax = 2.5
            text = "two
lines"
    item [2]:
        class = "TextTier"
        name = "marks"
        xmin = 0
        xmax = 2.5
        points: size = 1
        points [1]:
            number = 1.5
            mark = "beep"
'''

SHORT = '''File type = "ooTextFile"
Object class = "TextGrid"

0
2.5
<exists>
2
"TextTier"
"marks"
0
2.5
1
1.5
"beep"
"IntervalTier"
"words"
0
2.5
3
0
0.5
""
0.5
1.25
"say ""hi"""
1.25
2.5
"two
lines"
'''


@pytest.mark.parametrize("text", [LONG, SHORT], ids=["long", "short"])
def test_both_textgrid_formats_read_alike(tmp_path, text):
    path = tmp_path / "x.TextGrid"
    path.write_text(text)
    assert read_textgrid(path) == {"words": [(0.0, 0.5, ""), (0.5, 1.25, 'say "hi"'), (1.25, 2.5, "two lines")]}


@pytest.mark.parametrize(("text", "words"), [
    ("Hello, World!", ["hello", "world"]),
    ("I paid $25 for 3rd-class, 20% off.", ["i", "paid", "twenty", "five", "dollars", "for", "third", "class",
                                            "twenty", "percent", "off"]),
    ("um yknow <vocnoise> [adif] the the", ["um", "you", "know", "the", "the"]),
    ("to(2) be(3)", ["to", "be"]),
    ("It\u2019s Mr. Smith", ["it's", "mister", "smith"]),
    ("", []),
])
def test_words_are_normalised_as_spoken(text, words):
    assert normalised_words(text) == words


@pytest.mark.parametrize(("reference", "hypothesis"), [
    ("the cat sat on the mat", "the cat sat on mat"),
    ("the cat sat on the mat", "a cat sat on the mat today"),
    ("one two three", "three two one"),
    ("hello there", "hello hello there there"),
])
def test_word_errors_count_as_jiwer_does(reference, hypothesis):
    errors, n = word_errors(reference, hypothesis)
    expected = jiwer.process_words(reference, hypothesis)
    assert n == len(reference.split())
    assert errors == expected.substitutions + expected.deletions + expected.insertions


def test_an_empty_hypothesis_misses_every_word():
    assert word_errors("hello there", "") == (2, 2)


def test_matched_words_pair_only_equal_words_in_order():
    ref = "so this is the sick corpus".split()
    hyp = "this is a sick corpus indeed".split()
    pairs = matched_words(ref, hyp)
    assert pairs == [(1, 0), (2, 1), (4, 3), (5, 4)]
    assert all(ref[i] == hyp[j] for i, j in pairs)


def _clip(**kw) -> HumanClip:
    return HumanClip("x", "pkg==1", "MIT", np.zeros(16_000, np.float32), **kw)


def test_timed_words_index_the_normalised_reference():
    words = [RefWord("um", 0.1, 0.2), RefWord("yknow", 0.3, 0.5), RefWord("<vocnoise>", 0.5, 0.6),
             RefWord("$5", 0.7, 0.9)]
    clip = _clip(reference=words, reference_text=" ".join(w.text for w in words), timing="word")
    assert normalised_words(clip.reference_text) == ["um", "you", "know", "five", "dollars"]
    assert clip.timed_words() == [(0, 0.1), (1, 0.3), (3, 0.7)]


def test_phrase_clips_time_each_phrases_first_word_and_untimed_clips_none():
    phrases = (RefPhrase("Hello?", 0.5, 0.9, "a"), RefPhrase("Oh, hello there.", 1.2, 2.0, "b"))
    text = " ".join(p.text for p in phrases)
    assert _clip(phrases=phrases, reference_text=text, timing="phrase").timed_words() == [(0, 0.5), (1, 1.2)]
    assert _clip(phrases=phrases, reference_text=text, timing="none").timed_words() == []
    assert _clip(phrases=phrases, reference_text=text).reference_end_s == 2.0
