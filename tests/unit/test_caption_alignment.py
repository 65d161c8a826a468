"""Caption mode: the LLM's cleaned caption aligned to the ASR's word times (pipeline/captions.align_caption).

The project's test extras have no hypothesis, so the property test is a seeded random loop over random edits.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass, field
from itertools import pairwise

import pytest
import webvtt

from pipeline.asr import Word
from pipeline.caption_style import CueStyle, broadcast_cues
from pipeline.captions import Cue, align_caption, srt_document, webvtt_document

SLACK_S = 0.15  # the requirement: a cue within 150 ms of the ASR's times for the words it stands for
EPS = 1e-9


def timed(text: str, start_s: float = 0.0, step_s: float = 0.3, length_s: float = 0.25) -> list[Word]:
    return [Word(f" {t}", round(start_s + n * step_s, 3), round(start_s + n * step_s + length_s, 3), 0.9)
            for n, t in enumerate(text.split())]


def spaced(*spec: tuple[str, float, float]) -> list[Word]:
    return [Word(f" {t}", s, e, 0.9) for t, s, e in spec]


def assert_valid(cues: list[Cue], caption: str, words: list[Word]) -> None:
    """One cue per caption word, as written; each at least 1 ms; ordered, non-overlapping, inside the utterance."""
    assert [c.text for c in cues] == caption.split()
    lo, hi = words[0].start_s, max(max(w.end_s for w in words), words[0].start_s + 0.001 * len(cues))
    for cue in cues:
        assert cue.end_s - cue.start_s >= 0.001 - EPS, cue
        assert lo - EPS <= cue.start_s and cue.end_s <= hi + EPS, (cue, lo, hi)
    for a, b in pairwise(cues):
        assert a.end_s <= b.start_s + EPS, (a, b)


def assert_near(cue: Cue, first: Word, last: Word | None = None) -> None:
    """The cue starts within 150 ms of the first ASR word's start and ends within 150 ms of the last one's end."""
    last = last or first
    assert abs(cue.start_s - first.start_s) <= SLACK_S + EPS, (cue, first)
    assert abs(cue.end_s - last.end_s) <= SLACK_S + EPS, (cue, last)


def assert_inside(cue: Cue, first: Word, last: Word | None = None) -> None:
    """The cue lies within the ASR words' span, give or take 150 ms."""
    last = last or first
    assert first.start_s - SLACK_S - EPS <= cue.start_s and cue.end_s <= last.end_s + SLACK_S + EPS, (cue, first)


def test_equal_words_take_their_asr_times_whatever_the_case_and_punctuation():
    words = timed("hello there how are you")
    cues = align_caption("Hello there, how are you?", words)
    assert_valid(cues, "Hello there, how are you?", words)
    assert [(c.start_s, c.end_s) for c in cues] == [(w.start_s, w.end_s) for w in words]


def test_a_number_in_digits_spans_the_words_it_was_said_in():
    words = timed("i have twenty five cats")
    cues = align_caption("I have 25 cats.", words)
    assert_valid(cues, "I have 25 cats.", words)
    assert [c.text for c in cues] == ["I", "have", "25", "cats."]
    assert (cues[2].start_s, cues[2].end_s) == (words[2].start_s, words[3].end_s)
    assert_near(cues[3], words[4])


@pytest.mark.parametrize(("heard", "caption", "cue", "first", "last"), [
    ("in twenty twenty we met", "In 2020 we met.", 1, 1, 2),  # a year as it is said
    ("in two thousand and twenty we met", "In 2020 we met.", 1, 1, 4),
    ("in two thousand twenty we met", "In 2020 we met.", 1, 1, 3),
    ("on the twenty first we met", "On the 21st we met.", 2, 2, 3),
    ("call nine one one we met", "Call 911 we met.", 1, 1, 3),
])
def test_numbers_in_digits_span_the_words_they_were_said_in(heard, caption, cue, first, last):
    words = timed(heard)
    cues = align_caption(caption, words)
    assert_valid(cues, caption, words)
    assert (cues[cue].start_s, cues[cue].end_s) == (words[first].start_s, words[last].end_s)
    for n in range(cue):
        assert (cues[n].start_s, cues[n].end_s) == (words[n].start_s, words[n].end_s)
    assert (cues[-2].start_s, cues[-1].end_s) == (words[-2].start_s, words[-1].end_s)


def test_digits_heard_and_words_written_share_the_number_word():
    words = timed("in 2020 we met")
    cues = align_caption("In two thousand and twenty we met.", words)
    assert_valid(cues, "In two thousand and twenty we met.", words)
    assert cues[1].start_s == words[1].start_s and cues[4].end_s == words[1].end_s
    assert all(a.end_s == b.start_s for a, b in pairwise(cues[1:5]))
    assert_near(cues[5], words[2])


def test_money_and_percent_signs_match_the_words_said():
    words = timed("it costs five dollars or fifty percent")
    cues = align_caption("It costs $5 or 50%.", words)
    assert_valid(cues, "It costs $5 or 50%.", words)
    assert_near(cues[2], words[2], words[3])
    assert_near(cues[4], words[5], words[6])


def test_a_caption_word_for_several_asr_words_spans_them():
    words = timed("we can not go")
    cues = align_caption("We cannot go.", words)
    assert_valid(cues, "We cannot go.", words)
    assert (cues[1].start_s, cues[1].end_s) == (words[1].start_s, words[2].end_s)


def test_several_caption_words_for_one_asr_word_share_its_time_by_length():
    words = spaced(("i'm", 0.0, 0.2), ("gonna", 0.3, 0.9), ("go", 1.0, 1.2))
    cues = align_caption("I'm going to go.", words)
    assert_valid(cues, "I'm going to go.", words)
    going, to = cues[1], cues[2]
    assert going.start_s == 0.3 and to.end_s == 0.9 and going.end_s == to.start_s
    assert going.end_s - going.start_s > 2 * (to.end_s - to.start_s)  # "going" is longer than "to"
    assert_near(cues[0], words[0])
    assert_near(cues[3], words[2])


def test_dropped_fillers_give_their_time_to_no_neighbour():
    words = spaced(("so", 0.0, 0.2), ("um", 0.3, 1.1), ("I", 1.2, 1.3), ("think", 1.3, 1.6),
                   ("uh", 1.7, 2.6), ("yes", 2.7, 3.0))
    cues = align_caption("So I think yes.", words)
    assert_valid(cues, "So I think yes.", words)
    for cue, word in zip(cues, [words[0], words[2], words[3], words[5]], strict=True):
        assert_near(cue, word)
    assert cues[0].end_s <= 0.2 + SLACK_S and cues[1].start_s >= 1.2 - SLACK_S
    assert cues[2].end_s <= 1.6 + SLACK_S and cues[3].start_s >= 2.7 - SLACK_S


def test_a_corrected_word_takes_the_time_of_the_word_it_corrects_fillers_aside():
    words = spaced(("um", 0.0, 0.5), ("their", 0.6, 0.8), ("going", 0.8, 1.1), ("home", 1.1, 1.5))
    cues = align_caption("They're going home.", words)
    assert_valid(cues, "They're going home.", words)
    assert (cues[0].start_s, cues[0].end_s) == (0.6, 0.8)
    assert_near(cues[1], words[2])
    assert_near(cues[2], words[3])


def test_an_inserted_word_takes_part_of_a_pause_beside_the_word_before():
    words = spaced(("went", 0.0, 0.3), ("to", 0.3, 0.45), ("store", 1.5, 1.9))
    cues = align_caption("Went to the store.", words)
    assert_valid(cues, "Went to the store.", words)
    the = cues[2]
    assert the.start_s == 0.45 and 0.08 <= the.end_s - the.start_s <= 0.4  # a word's length, not the whole pause
    for cue, word in zip([cues[0], cues[1], cues[3]], words, strict=True):
        assert (cue.start_s, cue.end_s) == (word.start_s, word.end_s)


def test_an_inserted_word_without_a_pause_takes_a_share_of_its_neighbours():
    words = spaced(("went", 0.0, 0.3), ("to", 0.3, 0.6), ("store", 0.6, 1.0))
    cues = align_caption("Went to the store.", words)
    assert_valid(cues, "Went to the store.", words)
    assert cues[1].end_s < 0.6 < cues[3].start_s and cues[2].start_s < 0.6 < cues[2].end_s
    assert_near(cues[1], words[1])
    assert_near(cues[3], words[2])


@pytest.mark.parametrize("caption", ["Well, yes I think so.", "Yes I think so, really.",
                                     "Oh well, yes I think so, really truly."])
def test_inserted_words_at_either_end_stay_inside_the_utterance(caption):
    words = timed("yes i think so", start_s=2.0)
    cues = align_caption(caption, words)
    assert_valid(cues, caption, words)
    by_text = {c.text.strip(",.").lower(): c for c in cues}
    for word in words:
        assert_near(by_text[word.text.strip()], word)


def test_many_inserted_words_without_room_still_get_time_of_their_own():
    words = spaced(("a", 0.0, 0.1), ("b", 0.1, 0.2))
    caption = "A one two three four five six b"
    cues = align_caption(caption, words)
    assert_valid(cues, caption, words)
    assert cues[0].start_s == 0.0 and cues[-1].end_s == 0.2


def test_a_caption_unlike_the_transcript_is_spread_over_the_utterance_by_length():
    words = timed("purple monkey dishwasher", start_s=1.0)
    caption = "The weather is lovely today."
    cues = align_caption(caption, words)
    assert_valid(cues, caption, words)
    assert cues[0].start_s == 1.0 and cues[-1].end_s == words[-1].end_s
    assert all(a.end_s == b.start_s for a, b in pairwise(cues))
    lengths = [c.end_s - c.start_s for c in cues]
    assert lengths[1] > lengths[0] > lengths[2]  # weather > the > is


def test_punctuation_alone_rides_with_the_word_beside_it():
    words = timed("well okay")
    caption = "— Well, okay ."
    cues = align_caption(caption, words)
    assert_valid(cues, caption, words)
    assert_inside(cues[0], words[0])
    assert_inside(cues[1], words[0])
    assert_inside(cues[3], words[1])


@pytest.mark.parametrize(("caption", "words"), [
    ("", timed("hello")), ("   \n", timed("hello")), ("Hello.", []), ("", []),
])
def test_an_empty_caption_or_no_words_gives_no_cues(caption, words):
    assert align_caption(caption, words) == []


@pytest.mark.parametrize("words", [
    spaced(("hi", 1.0, 1.0)),  # a zero-length word
    spaced(("hi", 1.0, 1.0), ("there", 1.0, 1.0), ("you", 1.0, 1.001)),
    spaced(("hi", 1.0, 1.4), ("there", 1.2, 1.6), ("you", 1.5, 1.7)),  # overlapping words
    spaced(("hi", 1.0, 1.4), ("there", 0.9, 1.6), ("you", 1.5, 1.2)),  # a start going back, an end before a start
])
def test_degenerate_asr_times_still_give_ordered_cues_of_their_own(words):
    caption = "Hi there, you and all."
    cues = align_caption(caption, words)
    assert_valid(cues, caption, words)


def test_caption_words_cut_into_broadcast_cues_and_documents_parse_with_webvtt_py():
    words = timed("um what is the capital of france") + timed("thanks a lot", start_s=4.0)
    caption = "What is the capital of France? Thanks a lot!"
    lines = broadcast_cues([align_caption(caption, words)], CueStyle(max_line_chars=20))
    assert " ".join(c.text for c in lines) == caption
    assert all(len(line) <= 20 for c in lines for line in c.shown_lines)
    assert lines[0].start_s == words[1].start_s  # shown from its first word, "um" dropped
    assert all(a.end_s <= b.start_s for a, b in pairwise(lines))
    assert_documents(lines)


def parse_ms(timestamp: str) -> int:
    hms, ms = timestamp.replace(",", ".").split(".")
    h, m, s = (int(x) for x in hms.split(":"))
    return ((h * 60 + m) * 60 + s) * 1000 + int(ms)


def assert_documents(cues: list[Cue]) -> None:
    """The WebVTT and SRT documents parse with webvtt-py into the same cues, in order, none overlapping."""
    vtt = webvtt.from_string(webvtt_document(cues))
    srt = webvtt.from_buffer(io.StringIO(srt_document(cues)), format="srt")
    for parsed in (vtt, srt):
        assert [c.text for c in parsed] == ["\n".join(c.shown_lines) for c in cues]
        times = [(parse_ms(c.start), parse_ms(c.end)) for c in parsed]
        assert times == [(round(c.start_s * 1000), round(c.end_s * 1000)) for c in cues]
        assert all(s < e for s, e in times)
        assert all(a[1] <= b[0] for a, b in pairwise(times))


# The property: random word sequences, random edits of the kind a caption LLM makes, the invariants always hold,
# and the words it kept (and, with kept words either side, the ones it corrected, merged or split) are within 150 ms.

VOCAB = ("apple river stone cloud garden yellow window music coffee morning train ticket station blue market paper "
         "silver forest mountain letter orange summer winter bridge candle doctor harbor island jacket kitchen lemon "
         "mirror needle ocean pencil rabbit saddle tiger violin wagon basket castle dragon engine feather guitar "
         "hammer ladder meadow planet rocket tunnel velvet").split()
REPLACEMENTS = "zebra quartz walrus nectar jigsaw fjord sphinx yodel kumquat oxbow".split()
INSERTS = "just really very then also quite".split()
COMMON = "the a i to and of it you that is".split()
FILLERS = ("um", "uh", "er", "hmm")
NUMBERS = [(f"{tens} {units}", str(10 * t + u)) for t, tens in enumerate(
    "twenty thirty forty fifty sixty seventy eighty ninety".split(), start=2)
    for u, units in enumerate("one two three four five six seven eight nine".split(), start=1)]


@dataclass
class Said:
    text: str
    sources: list[int] = field(default_factory=list)  # indices of the ASR words it stands for
    kind: str = "keep"  # keep, replace, merge, split, number, insert, punctuation


def restyle(rng: random.Random, word: str) -> str:
    word = rng.choice([word, word, word.capitalize(), word.upper()])
    return rng.choice(["", "", "", "(", '"']) + word + rng.choice(["", "", "", ",", ".", "?", "!"])


def random_case(rng: random.Random, repeats: bool = False) -> tuple[list[Word], list[Said]]:
    """ASR words and the caption's words, each with the ASR words it stands for. Without repeats no word is heard
    twice (fillers aside) and no caption word is heard elsewhere, so which ASR word a kept word is is certain."""
    heard: list[str] = []
    said: list[Said] = []
    vocab = rng.choices(COMMON + VOCAB[:6], k=rng.randint(1, 24)) if repeats else rng.sample(VOCAB, rng.randint(1, 14))
    number_at = rng.randrange(len(vocab) + 1) if rng.random() < 0.3 else -1
    items: list[str] = []
    for n, word in enumerate(vocab):
        if n == number_at:
            items.append("#")
        items.append(word)
        if rng.random() < 0.15:
            items.append(rng.choice(FILLERS))
    if number_at == len(vocab):
        items.append("#")
    n = 0
    while n < len(items):
        item = items[n]
        if item in FILLERS:  # the caption drops every filler
            heard.append(item)
        elif item == "#":
            spoken, digits = rng.choice(NUMBERS)
            at = len(heard)
            heard += spoken.split()
            if rng.random() < 0.7:
                said.append(Said(restyle(rng, digits), [at, at + 1], "number"))
            else:
                said += [Said(restyle(rng, w), [at + k]) for k, w in enumerate(spoken.split())]
        else:
            roll = rng.random()
            following = items[n + 1] if n + 1 < len(items) else ""
            merged = item + following
            if roll < 0.1:
                heard.append(item)  # dropped
            elif roll < 0.2:
                said.append(Said(restyle(rng, rng.choice(REPLACEMENTS)), [len(heard)], "replace"))
                heard.append(item)
            elif roll < 0.28 and following in VOCAB and merged not in VOCAB:
                said.append(Said(restyle(rng, merged), [len(heard), len(heard) + 1], "merge"))
                heard += [item, following]
                n += 1
            elif roll < 0.33:
                said += [Said(restyle(rng, w), [len(heard)], "split") for w in rng.sample(REPLACEMENTS, 2)]
                heard.append(item)
            else:
                if roll < 0.43:
                    said.append(Said(rng.choice(INSERTS), [], "insert"))
                said.append(Said(restyle(rng, item), [len(heard)]))
                heard.append(item)
                if rng.random() < 0.05:
                    said.append(Said(rng.choice(["—", "-", "...", "!"]), [], "punctuation"))
                if rng.random() < 0.05:
                    said.append(Said(rng.choice(INSERTS), [], "insert"))
        n += 1
    words: list[Word] = []
    t = rng.uniform(0.0, 5.0)
    for text in heard:
        length = rng.choice([0.0, 0.01]) if rng.random() < 0.05 else rng.uniform(0.05, 0.7)
        words.append(Word(f" {text}", round(t, 2), round(t + length, 2), 0.9))
        t += length + (rng.choice([0.0, 0.0, rng.uniform(0.0, 0.9)]) if rng.random() > 0.05 else -0.02)
        t = max(t, words[-1].start_s)
    return words, said


@pytest.mark.parametrize("seed", range(400))
def test_random_edits_keep_cues_ordered_non_overlapping_and_near_the_asr_times(seed):
    rng = random.Random(seed)
    words, said = random_case(rng)
    caption = " ".join(s.text for s in said)
    cues = align_caption(caption, words)
    if not said:
        assert cues == []
        return
    assert_valid(cues, caption, words)
    assert_documents(broadcast_cues([cues], CueStyle(max_line_chars=rng.randint(10, 42))))
    assert_documents(cues)
    kept = [s for s in said if s.kind == "keep"]
    if 2 * len(kept) < len(said):  # a caption rewritten this much may be spread over the utterance instead
        return
    for n, (cue, s) in enumerate(zip(cues, said, strict=True)):
        if s.kind == "keep":
            assert_near(cue, words[s.sources[0]])
        elif s.kind in ("replace", "merge", "number", "split") and isolated(said, n, len(words)):
            if s.kind == "split":
                assert_inside(cue, words[s.sources[0]])
            else:
                assert_near(cue, words[s.sources[0]], words[s.sources[-1]])


@pytest.mark.parametrize("seed", range(200))
def test_random_edits_of_repeated_words_keep_cues_ordered_and_non_overlapping(seed):
    rng = random.Random(seed)
    words, said = random_case(rng, repeats=True)
    caption = " ".join(s.text for s in said)
    cues = align_caption(caption, words)
    if said:
        assert_valid(cues, caption, words)
        assert_documents(broadcast_cues([cues]))


def isolated(said: list[Said], n: int, n_words: int) -> bool:
    """With the same ASR words, kept words right before and after (or the utterance's edge), and nothing else."""
    first, last = said[n].sources[0], said[n].sources[-1]
    lo, hi = n, n
    while lo > 0 and said[lo - 1].sources == said[n].sources:
        lo -= 1
    while hi + 1 < len(said) and said[hi + 1].sources == said[n].sources:
        hi += 1
    before_ok = (lo == 0 and first == 0) or (lo > 0 and said[lo - 1].kind == "keep"
                                             and said[lo - 1].sources[0] == first - 1)
    after_ok = (hi == len(said) - 1 and last == n_words - 1) or (
        hi + 1 < len(said) and said[hi + 1].kind == "keep" and said[hi + 1].sources[0] == last + 1)
    return before_ok and after_ok
